// A loss-curve PNG: train loss (and validation loss when present) against the step, with axes,
// ticks and a legend, drawn with Cairo.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace loom::train {

struct Series {
  std::string label;
  std::vector<std::pair<double, double>> points;  // (step, value)
  double r = 0, g = 0, b = 0;                     // colour
};

// Writes `path` (through a temporary name and a rename). Returns false (with a reason in `why`)
// when the build has no PNG support.
bool plot_png(const std::string& path, const std::string& title, const std::vector<Series>& series,
              const std::string& ylabel, std::string* why = nullptr, int width = 900, int height = 560);

}  // namespace loom::train

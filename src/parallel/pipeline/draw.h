// Pictures of pipeline timelines: one row per rank, a box per compute (forward, backward,
// backward-input, weight gradient in different colours, darker for later chunks) labelled with
// its micro-batch. The timeline comes from the checker's simulation of a schedule or from the
// executor's measured trace, so the picture of a plan and of a run look alike.
#pragma once
#include <string>
#include <vector>

#include "parallel/pipeline/checker.h"
#include "parallel/pipeline/schedule.h"

namespace loom::parallel::pipeline {

struct Box {
  double start = 0, end = 0;  // any unit (simulated cost units or seconds)
  Op op = Op::forward;
  int mb = 0, chunk = 0;
};

struct Timeline {
  std::string title;
  std::vector<std::vector<Box>> rows;  // [rank] compute boxes
  std::vector<std::string> labels;     // per row (empty: "rank r")
};

// The compute boxes of a checked schedule's simulated timeline.
Timeline schedule_timeline(const Schedule& sch, const CheckResult& res);

// Writes a PNG (through a temporary file and a rename). Returns false with a reason in `why`
// when this build has no Cairo; throws naming the path when it cannot be written.
bool draw_png(const std::string& path, const Timeline& tl, std::string* why = nullptr);

// A text picture, one line per rank, one character per `unit` of time: F/B/b/W letters
// (lower case for odd chunks) or '.' when idle.
std::string draw_text(const Timeline& tl, double unit = 1.0);

}  // namespace loom::parallel::pipeline

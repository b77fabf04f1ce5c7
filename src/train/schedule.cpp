#include "train/schedule.h"

#include <algorithm>
#include <cmath>

namespace loom::train {

float LrSchedule::at(int64_t step) const {
  if (step < warmup) return lr * float(step + 1) / float(warmup);
  if (kind == "constant" || total <= warmup) return lr;
  double frac = std::clamp(double(step - warmup) / double(std::max<int64_t>(1, total - warmup)), 0.0, 1.0);
  double coeff = kind == "linear" ? 1.0 - frac : 0.5 * (1.0 + std::cos(M_PI * frac));
  return float(min_lr + coeff * (lr - min_lr));
}

}  // namespace loom::train

// Learning-rate schedules: linear warm-up, then cosine, linear or constant decay to min_lr.
#pragma once
#include <cstdint>
#include <string>

namespace loom::train {

struct LrSchedule {
  float lr = 6e-4f, min_lr = 6e-5f;
  int64_t warmup = 0, total = 1;
  std::string kind = "cosine";
  // Learning rate of optimizer step `step` (0-based).
  float at(int64_t step) const;
};

}  // namespace loom::train

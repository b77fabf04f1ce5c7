#include "optim/sharded_adamw.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/adamw.h"

namespace loom::optim {

ShardedAdamW::ShardedAdamW(std::vector<FlatSegment> segments, int64_t begin, int64_t end, const AdamWConfig& cfg,
                           MemoryPool& state_pool)
    : FlatOptimizer(cfg, begin, end) {
  cfg_.validate();
  LOOM_CHECK(0 <= begin && begin <= end, "sharded adamw: bad shard [{}, {})", begin, end);
  int64_t prev = 0;
  for (const FlatSegment& s : segments) {
    LOOM_CHECK(s.begin >= prev && s.end >= s.begin, "sharded adamw: segment '{}' [{}, {}) is out of order", s.name,
               s.begin, s.end);
    prev = s.end;
    int64_t b = std::max(s.begin, begin), e = std::min(s.end, end);
    if (b < e) local_.push_back({b - begin, e - begin, s.decay, s.name, s.in_norm, {}});
  }
  m_ = Tensor::zeros({end - begin}, DType::f32, MemTag::optimizer, state_pool);
  v_ = Tensor::zeros({end - begin}, DType::f32, MemTag::optimizer, state_pool);
}

double ShardedAdamW::grad_sum_squares(const float* grad_shard) const {
  double s = 0;
  for (const FlatSegment& seg : local_)
    if (seg.in_norm) s += cpu::sum_squares(grad_shard + seg.begin, seg.end - seg.begin);
  return s;
}

StepStats ShardedAdamW::step(float* param_shard, const float* grad_shard, double global_norm, double lr) {
  const StepStats st = begin_step(global_norm, "adamw");
  for (const FlatSegment& seg : local_)
    cpu::adamw_update(param_shard + seg.begin, grad_shard + seg.begin, m_.f32() + seg.begin, v_.f32() + seg.begin,
                      seg.end - seg.begin, segment_args(lr, seg.decay, st));
  return st;
}

}  // namespace loom::optim

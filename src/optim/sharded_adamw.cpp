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
  if (!std::isfinite(global_norm))
    throw Error(fmt::format("adamw: gradient norm is {} at step {}", global_norm, t_ + 1));
  ++t_;
  StepStats st;
  st.grad_norm = global_norm;
  st.clip_scale = cpu::clip_scale(global_norm, cfg_.max_norm);
  st.step = t_;
  for (const FlatSegment& seg : local_) {
    cpu::AdamWArgs a;
    a.lr = lr < 0 ? cfg_.lr : lr;
    a.beta1 = cfg_.beta1;
    a.beta2 = cfg_.beta2;
    a.eps = cfg_.eps;
    a.weight_decay = seg.decay ? cfg_.weight_decay : 0.0;
    a.step = t_;
    a.grad_scale = st.clip_scale;
    cpu::adamw_update(param_shard + seg.begin, grad_shard + seg.begin, m_.f32() + seg.begin, v_.f32() + seg.begin,
                      seg.end - seg.begin, a);
  }
  return st;
}

}  // namespace loom::optim

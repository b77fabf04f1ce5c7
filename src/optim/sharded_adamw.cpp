#include "optim/sharded_adamw.h"

namespace loom::optim {

ShardedAdamW::ShardedAdamW(std::vector<FlatSegment> segments, int64_t begin, int64_t end, const AdamWConfig& cfg,
                           Backend& be)
    : FlatOptimizer(segments, begin, end, cfg, "sharded adamw"), be_(be) {
  m_ = be.empty({end - begin}, DType::f32, MemTag::optimizer);
  v_ = be.empty({end - begin}, DType::f32, MemTag::optimizer);
  be.fill_zero(m_.raw(), int64_t(m_.nbytes()));
  be.fill_zero(v_.raw(), int64_t(v_.nbytes()));
}

StepStats ShardedAdamW::step(float* param_shard, const float* grad_shard, double global_norm, double lr) {
  const StepStats st = begin_step(global_norm, "adamw");
  if (!plan_ || param_shard != planned_param_ || grad_shard != planned_grad_) {
    std::vector<AdamWTensor> t;
    for (const FlatSegment& seg : segments_)
      t.push_back({.param = param_shard + seg.begin, .grad = grad_shard + seg.begin, .m = m_.f32() + seg.begin,
                   .v = v_.f32() + seg.begin, .n = seg.end - seg.begin,
                   .weight_decay = seg.decay ? cfg_.weight_decay : 0.0});
    plan_ = be_.plan_adamw(t);
    planned_param_ = param_shard;
    planned_grad_ = grad_shard;
  }
  plan_->step({.lr = lr < 0 ? cfg_.lr : lr, .beta1 = cfg_.beta1, .beta2 = cfg_.beta2, .eps = cfg_.eps, .step = st.step,
               .max_norm = cfg_.max_norm, .grad_scale = 1.f, .global_norm = global_norm});
  return st;
}

}  // namespace loom::optim

#include "optim/sharded_adamw.h"

#include <algorithm>
#include <cmath>

#include "kernels/cpu/adamw.h"

namespace loom::optim {

ShardedAdamW::ShardedAdamW(std::vector<FlatSegment> segments, int64_t begin, int64_t end, const AdamWConfig& cfg,
                           MemoryPool& state_pool)
    : FlatOptimizer(segments, begin, end, cfg, "sharded adamw") {
  m_ = Tensor::zeros({end - begin}, DType::f32, MemTag::optimizer, state_pool);
  v_ = Tensor::zeros({end - begin}, DType::f32, MemTag::optimizer, state_pool);
}

StepStats ShardedAdamW::step(float* param_shard, const float* grad_shard, double global_norm, double lr) {
  const StepStats st = begin_step(global_norm, "adamw");
  for (const FlatSegment& seg : segments_)
    cpu::adamw_update(param_shard + seg.begin, grad_shard + seg.begin, m_.f32() + seg.begin, v_.f32() + seg.begin,
                      seg.end - seg.begin, segment_args(lr, seg.decay, st));
  return st;
}

}  // namespace loom::optim

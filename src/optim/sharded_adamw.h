// AdamW over one shard of a flat parameter buffer (ZeRO). Parameters are concatenated in a fixed
// order into a flat f32 buffer (each at its padded allocation size); a rank owns the elements
// [begin, end) of it and keeps both moments for exactly those elements. The update is the
// element-wise torch.optim.AdamW of optim/adamw.h, applied per parameter segment (weight decay on
// parameters of two or more dimensions only; padding rows and the flat buffer's tail are never
// touched), so any split of the buffer updates exactly like the unsharded optimizer.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/memory.h"
#include "core/tensor.h"
#include "optim/adamw.h"
#include "optim/flat_optimizer.h"

namespace loom::optim {

class ShardedAdamW final : public FlatOptimizer {
 public:
  // segments: the logical parameter elements of the whole flat buffer (sorted, disjoint).
  // [begin, end): this rank's shard. Moments f32 [end - begin] (tag optimizer) from state_pool.
  ShardedAdamW(std::vector<FlatSegment> segments, int64_t begin, int64_t end, const AdamWConfig& cfg,
               MemoryPool& state_pool);

  StepStats step(float* param_shard, const float* grad_shard, double global_norm, double lr = -1.0) override;
  int64_t state_bytes() const override { return 2 * (end_ - begin_) * int64_t(sizeof(float)); }

  Tensor& exp_avg() { return m_; }     // f32 [end - begin]
  Tensor& exp_avg_sq() { return v_; }  // f32 [end - begin]

 private:
  Tensor m_, v_;
};

}  // namespace loom::optim

// AdamW over one shard of a flat parameter buffer (ZeRO). Parameters are concatenated in a fixed
// order into a flat f32 buffer (each at its padded allocation size); a rank owns the elements
// [begin, end) of it and keeps both moments for exactly those elements. The update is the
// element-wise torch.optim.AdamW of optim/adamw.h, applied per parameter segment (weight decay on
// parameters of two or more dimensions only; padding rows and the flat buffer's tail are never
// touched), so any split of the buffer updates exactly like the unsharded optimizer. The moments
// and the update are on a backend (core/backend.h: Backend::plan_adamw, clipped by the global norm
// the caller formed over every shard): a device's for a shard in its memory, a CPU backend's for
// one in host memory (optimizer offload); on the CPU the update is the AdamW of kernels/cpu/adamw.h.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "optim/adamw.h"
#include "optim/flat_optimizer.h"

namespace loom::optim {

class ShardedAdamW final : public FlatOptimizer {
 public:
  // segments: the logical parameter elements of the whole flat buffer (sorted, disjoint).
  // [begin, end): this rank's shard. Moments f32 [end - begin] (tag optimizer, zeroed) in be's
  // memory, where step() then updates shards of its memory. `be` must outlive the optimizer.
  ShardedAdamW(std::vector<FlatSegment> segments, int64_t begin, int64_t end, const AdamWConfig& cfg, Backend& be);

  StepStats step(float* param_shard, const float* grad_shard, double global_norm, double lr = -1.0) override;
  int64_t state_bytes() const override { return 2 * (end_ - begin_) * int64_t(sizeof(float)); }

  Tensor& exp_avg() { return m_; }     // f32 [end - begin]
  Tensor& exp_avg_sq() { return v_; }  // f32 [end - begin]

 private:
  Backend& be_;
  Tensor m_, v_;
  // The update's plan over the segments of the shards last given (made again when they change).
  std::unique_ptr<AdamWPlan> plan_;
  float* planned_param_ = nullptr;
  const float* planned_grad_ = nullptr;
};

}  // namespace loom::optim

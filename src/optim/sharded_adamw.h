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

namespace loom::optim {

// A run of elements of the flat buffer that belongs to one parameter's logical values.
struct FlatSegment {
  int64_t begin = 0, end = 0;  // flat element indices
  bool decay = false;
  std::string name;            // the parameter, for messages
  bool in_norm = true;         // counted by grad_sum_squares (a replicated copy counts elsewhere)
};

class ShardedAdamW {
 public:
  // segments: the logical parameter elements of the whole flat buffer (sorted, disjoint).
  // [begin, end): this rank's shard. Moments f32 [end - begin] (tag optimizer) from state_pool.
  ShardedAdamW(std::vector<FlatSegment> segments, int64_t begin, int64_t end, const AdamWConfig& cfg,
               MemoryPool& state_pool);

  // Sum of squares (double) of grad_shard f32 [end - begin] over this shard's logical elements
  // of the segments with in_norm, segment by segment in flat order (deterministic for any thread
  // count).
  double grad_sum_squares(const float* grad_shard) const;
  // One step on param_shard / grad_shard f32 [end - begin] with a global gradient norm computed
  // over all shards (clipping), at learning rate lr (the configured one when lr < 0).
  StepStats step(float* param_shard, const float* grad_shard, double global_norm, double lr = -1.0);

  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  const AdamWConfig& config() const { return cfg_; }
  int64_t steps_taken() const { return t_; }
  void set_steps_taken(int64_t t) { t_ = t; }
  Tensor& exp_avg() { return m_; }     // f32 [end - begin]
  Tensor& exp_avg_sq() { return v_; }  // f32 [end - begin]
  int64_t state_bytes() const { return 2 * (end_ - begin_) * int64_t(sizeof(float)); }

 private:
  AdamWConfig cfg_;
  std::vector<FlatSegment> local_;  // segments clipped to [begin, end), shard-relative
  int64_t begin_, end_;
  Tensor m_, v_;
  int64_t t_ = 0;
};

}  // namespace loom::optim

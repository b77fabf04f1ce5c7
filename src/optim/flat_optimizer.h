// The optimizers data parallelism drives (parallel/data/data_parallel.h): each updates a range
// [begin, end) of the flat f32 parameter buffer, in which every parameter's logical elements are
// one segment. ShardedAdamW (optim/sharded_adamw.h) is element-wise, so any range of the buffer (a
// ZeRO shard) updates alike; GaLore (optim/galore.h) needs whole matrices (ZeRO stage 0).
#pragma once
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/backend.h"
#include "core/error.h"
#include "core/tensor.h"
#include "kernels/cpu/adamw.h"
#include "optim/adamw.h"

namespace loom::optim {

// A run of elements of the flat buffer that belongs to one parameter's logical values.
struct FlatSegment {
  int64_t begin = 0, end = 0;  // flat element indices
  bool decay = false;
  std::string name;            // the parameter, for messages
  bool in_norm = true;         // counted by grad_sum_squares (a replicated copy counts elsewhere)
  Shape shape;                 // the parameter's logical shape when the segment is all of it (else empty)
  // With the shape: the matrices it stacks by rows, (label, rows) (model::ParamSpec::row_blocks).
  std::vector<std::pair<std::string, int64_t>> row_blocks = {};
};

class FlatOptimizer {
 public:
  // segments: the logical parameter elements of the whole flat buffer (sorted, disjoint); `who`
  // names the optimizer in errors. Keeps those in [begin, end), clipped to it and range-relative.
  FlatOptimizer(const std::vector<FlatSegment>& segments, int64_t begin, int64_t end, const AdamWConfig& cfg,
                const char* who);
  virtual ~FlatOptimizer() = default;
  FlatOptimizer(const FlatOptimizer&) = delete;
  FlatOptimizer& operator=(const FlatOptimizer&) = delete;

  // Sum of squares (double) of grad_shard f32 [end - begin] over this range's logical elements of
  // the segments with in_norm, segment by segment in flat order (deterministic for any thread
  // count): in be's memory (Backend::sum_squares), or with be null in host memory. With `others`
  // set, the same over the segments without in_norm goes there (replicated copies: not in the
  // norm, but a non-finite value in one must skip the step as well).
  double grad_sum_squares(const float* grad_shard, Backend* be = nullptr, double* others = nullptr) const;
  // One step on param_shard / grad_shard f32 [end - begin] with a global gradient norm computed
  // over all ranges (clipping), at learning rate lr (the configured one when lr < 0).
  virtual StepStats step(float* param_shard, const float* grad_shard, double global_norm, double lr = -1.0) = 0;
  // Bytes of optimizer state held (tag optimizer).
  virtual int64_t state_bytes() const = 0;

  // The segments in this range, range-relative (a segment cut by the range keeps its parameter's
  // shape: its length then differs from the shape's elements).
  const std::vector<FlatSegment>& segments() const { return segments_; }
  int64_t begin() const { return begin_; }
  int64_t end() const { return end_; }
  const AdamWConfig& config() const { return cfg_; }
  int64_t steps_taken() const { return t_; }
  void set_steps_taken(int64_t t) { t_ = t; }

 protected:
  // A step's start: the norm checked (`who` names the optimizer), the step counted, its stats.
  StepStats begin_step(double global_norm, const char* who) {
    if (!std::isfinite(global_norm))
      throw Error(fmt::format("{}: gradient norm is {} at step {}", who, global_norm, t_ + 1));
    ++t_;
    StepStats st;
    st.grad_norm = global_norm;
    st.clip_scale = cpu::clip_scale(global_norm, cfg_.max_norm);
    st.step = t_;
    return st;
  }
  // The element-wise AdamW of a segment in this step at learning rate lr (the configured one when
  // lr < 0).
  cpu::AdamWArgs segment_args(double lr, bool decay, const StepStats& st) const {
    cpu::AdamWArgs a;
    a.lr = lr < 0 ? cfg_.lr : lr;
    a.beta1 = cfg_.beta1;
    a.beta2 = cfg_.beta2;
    a.eps = cfg_.eps;
    a.weight_decay = decay ? cfg_.weight_decay : 0.0;
    a.step = st.step;
    a.grad_scale = st.clip_scale;
    return a;
  }

  AdamWConfig cfg_;
  int64_t begin_, end_;
  std::vector<FlatSegment> segments_;
  int64_t t_ = 0;
};

}  // namespace loom::optim

// ZeRO stage 1 over any list of this rank's parameters and a data-parallel communicator: the
// parameters and gradients stay whole on every dp rank, the AdamW moments are sharded over dp.
// It knows nothing of the model: tensor/sequence/context-parallel parts (model::GPT over tp / cp),
// a pipeline stage's parameters or a whole model::GPT are all "a list of parameters".
//
// Layout: the parameters, in the given order, in one flat f32 buffer (flat_layout.h): each at
// its allocation size rounded up to 16 elements, the total N_pad a multiple of 16 dp; rank r of
// dp owns the shard [r S, (r + 1) S), S = N_pad / dp. The parameters' value and gradient tensors
// become views of two flat buffers (values copied in at construction, the same on every dp rank).
//
// A step, on every rank of the dp group after the step's backward passes (gradients accumulated
// in the parameters' grad tensors, e.g. over micro-batches):
//   double sq = opt.reduce_gradients();  // collective over dp: reduce-scatter, mean over replicas;
//                                        // sum of squares of this rank's shard of the counted
//                                        // parameters (Zero1Options::in_norm)
//   double norm = std::sqrt(sum_over_ranks(tp, sum_over_ranks(dp, sq)));  // caller's groups
//   opt.step(norm, lr);                  // AdamW on the shard, then all-gather over dp
// The caller decides which parameters count in the norm on this rank and over which groups it
// adds the sums: a tensor-parallel parameter replicated over tp counts on tp rank 0 only; the sum
// over dp comes first, then over the model-parallel groups, so every rank gets the same bits.
//
// In a pipeline: each stage builds one Zero1Optimizer over its parameters (the stage's chain
// blocks, plus the last stage's copy of a tied wte with in_norm = false, its gradient already
// added to the first stage's) and its dp communicator (the replicas of that stage); after the
// pipeline flush (and the tied-embedding exchange) every stage calls reduce_gradients(), adds the
// sums over dp and then over pp (norm = sqrt(sum_over_ranks(pp, sum_over_ranks(dp, sq)))) and
// steps. Checkpoints gather each parameter's full moments by its index in the stage's list.
//
// Per-rank bytes by pool tag (f32 everywhere), from construction on (the model's own parameter
// and gradient allocations are released when its tensors are re-pointed, unless held elsewhere):
//   params    4 N_pad   the flat parameter buffer
//   grads     4 N_pad   the flat gradient buffer
//   optimizer 8 S       both AdamW moments of this rank's shard
// with N_pad = round_up(sum_i round_up(alloc_i, 16), 16 dp), S = N_pad / dp, alloc_i the
// allocation elements of parameter i (ParamSpec::alloc_numel). The reduce-scatter and the
// all-gather run in place: no other buffer of the pool is used by a step.
//
// Equality with optim::AdamW over all-reduced gradients: the moments of each element are updated
// by the same kernel with the same clipping factor, so a step differs only by the reduction order
// of the gradients (the comm contract's, deterministic) and of the norm.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/comm.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "model/param.h"
#include "optim/adamw.h"
#include "optim/sharded_adamw.h"
#include "parallel/data/flat_layout.h"

namespace loom::parallel {

// The part of one parameter's AdamW moments a rank holds: its logical elements [begin, end) (of
// the rank's part of the parameter) at exp_avg and exp_avg_sq (empty when begin == end).
struct MomentPart {
  int64_t begin = 0, end = 0;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
};

struct Zero1Options {
  // Per parameter, in the constructor's order: whether its gradient counts in this rank's sum
  // of squares (empty: every parameter counts).
  std::vector<bool> in_norm;
  // The reduce-scattered sum is divided by this (0: the group's size, the mean over replicas).
  // Over dp x cp the cp ranks hold partial sums of one replica's gradient, and the sum over cp
  // is part of the gradient: replicas = dp.
  int replicas = 0;
};

class Zero1Optimizer {
 public:
  // Takes over the parameters' value and gradient tensors (views of the flat buffers from `pool`,
  // tags params and grads; moments tag optimizer). Collective over `dp` only in later calls; the
  // parameters must be distinct and allocated; `dp` must outlive this object.
  Zero1Optimizer(std::vector<model::Parameter*> params, comm::Comm& dp, const optim::AdamWConfig& adam,
                 MemoryPool& pool, Zero1Options opt = {});
  Zero1Optimizer(const Zero1Optimizer&) = delete;
  Zero1Optimizer& operator=(const Zero1Optimizer&) = delete;

  // Zeroes the whole flat gradient buffer.
  void zero_grad();
  // Collective over dp: reduce-scatters the gradients (sum, then times 1 / replicas: the mean
  // over the replicas) into this rank's shard; returns the sum of squares (double) of the shard's elements
  // of the parameters counted in the norm. The other shards' gradients are left as they were.
  double reduce_gradients();
  // Collective over dp: AdamW on this rank's shard with the global gradient norm (clipping) at
  // learning rate lr (the configured one when lr < 0), then all-gathers the parameters.
  optim::StepStats step(double global_norm, double lr = -1.0);

  // The moments of parameter i in this rank's shard (for checkpoints, written and read in place).
  MomentPart moment_part(size_t i);

  const std::vector<model::Parameter*>& parameters() const { return params_; }
  const FlatLayout& layout() const { return lay_; }
  int64_t flat_elements() const { return lay_.n_pad; }  // N_pad
  int64_t shard_elements() const { return lay_.shard; }  // S
  // The formulas above: bytes this object holds per tag.
  int64_t param_bytes() const { return 4 * lay_.n_pad; }
  int64_t grad_bytes() const { return 4 * lay_.n_pad; }
  int64_t optimizer_bytes() const { return 8 * lay_.shard; }
  int64_t steps_taken() const { return opt_->steps_taken(); }
  void set_steps_taken(int64_t t) { opt_->set_steps_taken(t); }  // when restoring a checkpoint
  const optim::AdamWConfig& config() const { return opt_->config(); }

 private:
  const FlatParam& flat(size_t i) const;
  int64_t shard_begin() const { return int64_t(rank_) * lay_.shard; }

  std::vector<model::Parameter*> params_;
  comm::Comm& dp_;
  int rank_ = 0, world_ = 1;
  int replicas_ = 1;  // the reduce-scattered sum is divided by this
  FlatLayout lay_;
  Tensor values_;  // f32 [N_pad], tag params
  Tensor grads_;   // f32 [N_pad], tag grads
  std::unique_ptr<optim::ShardedAdamW> opt_;
};

}  // namespace loom::parallel

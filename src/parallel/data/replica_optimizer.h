// The optimizer of one model replica's parameters on a rank of its data-parallel group, the one
// place that reduces a step's gradients over data parallelism: over dp, or over dp x cp when the
// context-parallel ranks of a replica hold partial sums of its gradients (model::GPT over tp / cp groups
// leaves them so). Either way the group's gradients are summed and divided by `replicas` (the dp
// size): the cp partial sums add up and the dp replicas average, in one collective.
//
//   zero_stage 0: an all-reduce over the group, then AdamW with full moments on every rank (the
//                 gradients are views of one flat buffer, so the all-reduce is one collective);
//   zero_stage 1: ZeRO-1's reduce-scatter over the group, AdamW on this rank's shard of the
//                 moments, then the parameters' all-gather (parallel/data/zero1.h).
//
// A step, on every rank of the group after the step's backward passes:
//   double sq = opt.reduce_gradients();  // collective over the group: the sum of squares of the
//                                        // counted parameters' reduced gradients, the same on
//                                        // every rank of the group
//   double norm = std::sqrt(sum_over_ranks(tp, sq));   // the caller's model-parallel groups
//   opt.step(norm, lr);
// Which parameters count in the norm on this rank is the caller's (Options::in_norm): a
// tensor-parallel parameter replicated over tp counts on tp rank 0 only, a pipeline's copy of a
// tied wte not at all.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "comm/comm.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "model/param.h"
#include "optim/adamw.h"
#include "parallel/data/zero1.h"

namespace loom::parallel {

class ReplicaOptimizer {
 public:
  struct Options {
    int zero_stage = 0;         // 0 or 1
    int replicas = 0;           // the reduced sum is divided by this (0: the group's size)
    std::vector<bool> in_norm;  // per parameter: counted in the norm on this rank (empty: all)
  };
  // group: the data-parallel group (null: this rank alone); it must outlive this object. Under
  // ZeRO-1 the parameters' value and gradient tensors become views of its flat buffers.
  ReplicaOptimizer(std::vector<model::Parameter*> params, comm::Comm* group, Options opt,
                   const optim::AdamWConfig& adam, MemoryPool& pool);
  ~ReplicaOptimizer();
  ReplicaOptimizer(const ReplicaOptimizer&) = delete;
  ReplicaOptimizer& operator=(const ReplicaOptimizer&) = delete;

  // Zeroes every gradient (under ZeRO-1 the whole flat buffer).
  void zero_grad();
  // Collective over the group: see above.
  double reduce_gradients();
  // AdamW with the global norm (clipping) at learning rate lr (the configured one when lr < 0);
  // collective over the group under ZeRO-1. A non-finite norm (the same on every rank) skips
  // the update (StepStats::skipped).
  optim::StepStats step(double global_norm, double lr = -1.0);

  // The moments of parameter i this rank holds (for checkpoints, written and read in place).
  MomentPart moment_part(size_t i);
  const std::vector<model::Parameter*>& parameters() const { return params_; }
  bool sharded() const { return zero1_ != nullptr; }
  Zero1Optimizer* zero1() const { return zero1_.get(); }  // ZeRO-1's state (null at stage 0)
  int64_t steps_taken() const;
  void set_steps_taken(int64_t t);  // when restoring a checkpoint

 private:
  std::vector<model::Parameter*> params_;
  comm::Comm* group_;
  Options opt_;
  std::unique_ptr<optim::AdamW> adam_;     // zero_stage 0
  Tensor flat_grads_;                      // zero_stage 0 over a group: every gradient's storage
  std::unique_ptr<Zero1Optimizer> zero1_;  // zero_stage 1
};

}  // namespace loom::parallel

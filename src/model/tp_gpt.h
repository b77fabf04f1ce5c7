// GPT-2 over a tensor-, sequence- and context-parallel group: one object per rank, driven like
// model::GPT (forward / backward / parameters), holding only this rank's shards.
//
// Tensor parallel (Megatron): attention c_attn column-parallel by heads, c_proj row-parallel; MLP
// c_fc column-parallel, c_proj row-parallel; wte (and lm_head) split by vocabulary rows, with a
// vocabulary-parallel embedding and cross-entropy (no rank materialises full logits). A head
// count that tp does not divide is refused; any vocabulary is padded (masked) to tp shards.
// Sequence parallel (sp): LayerNorms and residual regions hold rows sp_rows(N, tp, rank) of the
// N = B * T / cp token rows; all-gather before each column-parallel GEMM, reduce-scatter after
// each row-parallel one; the gathered LayerNorm output is not kept but gathered again in backward.
// Context parallel (cp): the rank's two load-balanced chunks of every sequence, ring attention.
//
// Every rank of a tp x cp group passes the same full micro-batch tokens [B, T]; the model takes
// its own positions. Initialisation is the single-device one (a pure function of the global
// element index), so any layout starts from the same weights.
//
// Training a step (per rank):
//   model.zero_grad(); loss = model.forward(tokens, targets, {.fuse_backward = true});
//   model.backward(); model.finish_gradients();      // sums over cp, sp-partial sums over tp
//   [data parallel: average every parameter's gradient over the dp group]
//   opt.step_with_norm(model.grad_norm());           // global norm, collective over tp
// with opt = optim::AdamW(model.parameters(), ...): each rank updates its own shards.
#pragma once
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "comm/comm.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "model/config.h"
#include "model/gpt.h"
#include "model/param.h"

namespace loom::model {

struct ParallelGroups {
  comm::Comm* tp = nullptr;  // tensor (and sequence) parallel group; null: tp = 1
  comm::Comm* cp = nullptr;  // context parallel group; null: cp = 1
};

struct ParallelOptions {
  bool sp = false;                // sequence parallel within the tp group
  int64_t activation_budget = 0;  // saved-activation bytes allowed per rank (0: unlimited); a
                                  // forward that would need more throws before allocating
};

// Elements [local, local + n) of a shard are elements [global, global + n) of the full tensor.
struct ShardSegment {
  int64_t local = 0, global = 0, n = 0;
};

struct ShardedParameter {
  ParamSpec global;                    // the full tensor (name, logical shape, initialisation)
  Parameter shard;                     // this rank's part: spec.shape is the shard's shape
  std::vector<ShardSegment> segments;  // where the shard lies in the full tensor
  bool replicated = false;             // the same full tensor on every tp rank
  bool sp_partial = false;             // under sp its gradient is a partial sum over the tp group
};

class ParallelGPT {
 public:
  ParallelGPT(const GPTConfig& cfg, ParallelGroups groups, ParallelOptions opts, MemoryPool& pool,
              uint64_t seed = 1337);
  ~ParallelGPT();
  ParallelGPT(const ParallelGPT&) = delete;
  ParallelGPT& operator=(const ParallelGPT&) = delete;

  const GPTConfig& config() const { return cfg_; }
  int tp() const { return tp_; }
  int cp() const { return cp_; }
  bool sp() const { return opts_.sp; }
  int64_t vocab_shard_rows() const { return Vs_; }

  // This rank's shards, in Hugging Face order; feed them to optim::AdamW.
  const std::vector<Parameter*>& parameters() const { return params_; }
  const std::vector<std::unique_ptr<ShardedParameter>>& sharded() const { return sharded_; }
  ShardedParameter& sharded(std::string_view name) const;  // throws naming the parameter
  void init_weights(uint64_t seed);

  // tokens, targets i32 [B, T] (the full sequences; T divisible by 2 cp when cp > 1). Returns the
  // mean loss over the counted targets of the whole tp x cp group (the same on every rank).
  float forward(const Tensor& tokens, const Tensor& targets, const ForwardOptions& opt = {});
  void backward();
  // After the last backward of a step: sums every gradient over cp and the sp-partial ones
  // (LayerNorm weights, wpe) over tp, so each rank holds the gradient of its shards.
  void finish_gradients();
  // Global L2 norm of all gradients (replicated parameters counted once); collective over tp.
  double grad_norm() const;
  void zero_grad();
  void release_activations();

  // f32 [B, T / cp] losses of this rank's positions after forward (global positions by
  // parallel::cp::global_position).
  const Tensor& losses() const;

  // Bytes of the activations saved between forward and backward on this rank at micro-batch
  // [B, T] (T global), and its parts: embedding, one transformer block, head.
  int64_t saved_activation_bytes(int64_t B, int64_t T) const;
  int64_t embedding_saved_bytes(int64_t B, int64_t T) const;
  int64_t block_saved_bytes(int64_t B, int64_t T) const;
  int64_t head_saved_bytes(int64_t B, int64_t T) const;

 private:
  struct Impl;
  GPTConfig cfg_;
  ParallelGroups g_;
  ParallelOptions opts_;
  MemoryPool& pool_;
  int tp_ = 1, tpr_ = 0, cp_ = 1, cpr_ = 0;
  int64_t Vs_ = 0;
  std::vector<std::unique_ptr<ShardedParameter>> sharded_;
  std::vector<Parameter*> params_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::model

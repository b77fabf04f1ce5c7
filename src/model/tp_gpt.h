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
// Pipeline stages: with ParallelOptions::first / last the object holds only the chain elements
// [first, last) (0 = embedding, 1..n_layer = blocks, n_layer + 1 = head) and their parameters; a
// stage with the head but not the embedding keeps its own copy of the wte shard for a tied
// lm_head (ShardedParameter::tied_copy, initialised like wte; the pipeline adds the two copies'
// gradients). forward_stage takes the previous stage's output rows and backward_stage the
// gradient of its own output; replica() makes another object over the same parameters with its
// own activations, one per micro-batch in flight. backward_stage(..., input_only = true) defers
// the linear layers' weight gradients (and the embedding's) to backward_weight(), for zero-bubble
// schedules; the two together add exactly what backward_stage adds.
//
// Training a step (per rank):
//   model.zero_grad(); loss = model.forward(tokens, targets, {.fuse_backward = true});
//   model.backward(); model.finish_gradients();      // sp-partial sums over tp
//   double sq = opt.reduce_gradients();              // sums over cp, mean over dp
//   opt.step(std::sqrt(sum_over_ranks(tp, sq)));     // global norm
// with opt = parallel::ReplicaOptimizer(model.parameters(), &dp_cp_group, {.replicas = dp,
// .in_norm = replicated parameters on tp rank 0 only}, ...): each rank updates its own shards.
#pragma once
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "comm/comm.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "kernels/cpu/attention.h"
#include "model/config.h"
#include "model/gpt.h"
#include "model/param.h"

namespace loom::parallel::cp {
class RingAttention;
}

namespace loom::model {

struct ParallelGroups {
  comm::Comm* tp = nullptr;  // tensor (and sequence) parallel group; null: tp = 1
  comm::Comm* cp = nullptr;  // context parallel group; null: cp = 1
  comm::Comm* dp_cp = nullptr;  // dp x cp: a pipeline stage's data-parallel reduction (needed when dp, cp > 1)
};

struct ParallelOptions {
  bool sp = false;                // sequence parallel within the tp group
  int64_t activation_budget = 0;  // saved-activation bytes allowed per rank (0: unlimited); a
                                  // forward that would need more throws before allocating
  int64_t first = 0, last = -1;   // chain elements [first, last) of a pipeline stage (last < 0: all)
  // The attention kernel's scratch, kept by the caller (a pipeline rank's, shared by all its
  // stages and replicas; it must outlive the model); null: the model keeps its own, which its
  // replicas share and its release_activations frees together with the other scratch buffers.
  // With a caller's, those buffers (shared with the replicas) stay allocated across
  // release_activations: the caller runs micro-batch after micro-batch.
  cpu::AttnWorkspace* attention_workspace = nullptr;
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
  bool tied_copy = false;              // a pipeline stage's copy of wte for its tied lm_head
};

class ParallelGPT {
 public:
  ParallelGPT(const GPTConfig& cfg, ParallelGroups groups, ParallelOptions opts, MemoryPool& pool,
              uint64_t seed = 1337);
  ~ParallelGPT();
  ParallelGPT(const ParallelGPT&) = delete;
  ParallelGPT& operator=(const ParallelGPT&) = delete;

  // Another model over the same parameters, with its own activations (a pipeline stage's
  // micro-batch in flight); it shares this one's scratch buffers, ring attention (cp) and
  // attention scratch: one of them computes at a time.
  // The parameters belong to this object, which must outlive it.
  std::unique_ptr<ParallelGPT> replica() const;
  // From now on this model (and replicas made after) uses `other`'s scratch buffers and ring
  // attention, e.g. another model chunk of the same pipeline rank: a rank runs one compute at a
  // time. Both must keep the caller's attention scratch (ParallelOptions::attention_workspace)
  // and the same groups and sp; call it before the first forward.
  void share_scratch_with(const ParallelGPT& other);

  const GPTConfig& config() const { return cfg_; }
  int tp() const { return tp_; }
  int cp() const { return cp_; }
  bool sp() const { return opts_.sp; }
  int64_t vocab_shard_rows() const { return Vs_; }
  int64_t first() const { return first_; }
  int64_t last() const { return last_; }
  bool has_embedding() const { return first_ == 0; }
  bool has_head() const { return last_ == cfg_.n_layer + 2; }
  // Residual-stream rows this rank holds for a micro-batch [B, T]: B T / cp, or its sp share.
  int64_t stream_rows(int64_t B, int64_t T) const;

  // This rank's shards, in Hugging Face order; feed them to optim::AdamW.
  const std::vector<Parameter*>& parameters() const;
  const std::vector<std::unique_ptr<ShardedParameter>>& sharded() const;
  ShardedParameter& sharded(std::string_view name) const;  // throws naming the parameter
  // The wte shard this stage adds gradients to for the embedding or a tied lm_head (its copy on
  // a stage with the head only); null when the stage has neither or embeddings are untied.
  ShardedParameter* tied_wte() const;
  void init_weights(uint64_t seed);

  // tokens, targets i32 [B, T] (the full sequences; T divisible by 2 cp when cp > 1). Returns the
  // mean loss over the counted targets of the whole tp x cp group (the same on every rank).
  // The whole model only (first = 0 and last = n_layer + 2).
  float forward(const Tensor& tokens, const Tensor& targets, const ForwardOptions& opt = {});
  void backward();
  // A pipeline stage's forward: input f32 [stream_rows, C] is the previous stage's output (null
  // on the first stage; it must stay valid until the backward ends). tokens are read by the
  // embedding, targets by the head. Returns the loss on a stage with the head, else 0.
  float forward_stage(const Tensor& tokens, const Tensor& targets, const float* input, const ForwardOptions& opt = {});
  // f32 [stream_rows, C] output of a stage without the head, after forward_stage.
  const float* stage_output() const;
  // grad_output f32 [stream_rows, C]: gradient of the stage's output (null on the head's stage).
  // input_only: the weight gradients of the linear layers and of the embedding are deferred to
  // backward_weight() (zero-bubble schedules); LayerNorm gradients are added here.
  void backward_stage(const float* grad_output, bool input_only = false);
  void backward_weight();
  // f32 [stream_rows, C] gradient of the stage's input after backward_stage (stages without the
  // embedding); valid until the next backward of this model or of a replica, or the release.
  const float* input_grad() const;
  // After the last backward of a step: sums the sp-partial gradients (LayerNorm weights, wpe)
  // over tp. The cp ranks then hold partial sums of their shards' gradients: the data-parallel
  // reduction over dp x cp adds them (parallel::ReplicaOptimizer), one collective for both.
  void finish_gradients();
  void zero_grad();
  void release_activations();

  // f32 [B, T / cp] losses of this rank's positions after forward (global positions by
  // parallel::cp::global_position).
  const Tensor& losses() const;

  // Bytes of the activations saved between forward and backward on this rank at micro-batch
  // [B, T] (T global) by the stage's elements, and the parts: embedding, one transformer block,
  // head. A stage's input (the previous stage's output) is not counted: its owner counts it.
  int64_t saved_activation_bytes(int64_t B, int64_t T) const;
  int64_t embedding_saved_bytes(int64_t B, int64_t T) const;
  int64_t block_saved_bytes(int64_t B, int64_t T) const;
  int64_t head_saved_bytes(int64_t B, int64_t T) const;
  // The attention kernel's scratch (tag workspace) for micro-batch [B, T] on `threads` OpenMP
  // threads: the larger of its forward and backward call (cp > 1: one chunk pair of the ring).
  // forward_stage reserves it in the attention workspace, which then serves every layer's calls.
  int64_t attention_workspace_bytes(int64_t B, int64_t T, int threads) const;

 private:
  // The attention kernel's arguments at [B, T] on this rank's heads (packed qkv rows).
  cpu::AttnArgs attention_args(int64_t B, int64_t T) const;
  struct Weights;
  struct Scratch;
  struct Impl;
  struct ReplicaOf {};
  ParallelGPT(const ParallelGPT& primary, ReplicaOf);
  // wpe += own-row gradients dres [Ns, C]; wte shard += lookups of dfull [N, C].
  void embedding_weight_grads(const float* dres, const float* dfull);
  GPTConfig cfg_;
  ParallelGroups g_;
  ParallelOptions opts_;
  MemoryPool& pool_;
  int tp_ = 1, tpr_ = 0, cp_ = 1, cpr_ = 0;
  int64_t Vs_ = 0, first_ = 0, last_ = 0;
  std::shared_ptr<Weights> w_;
  std::shared_ptr<Scratch> scratch_;              // shared with the replicas
  std::unique_ptr<cpu::AttnWorkspace> own_attn_;  // without ParallelOptions::attention_workspace
  cpu::AttnWorkspace* attn_ = nullptr;            // the one in use: the caller's, own_attn_ or the primary's
  std::shared_ptr<parallel::cp::RingAttention> ring_;  // cp > 1: its K/V blocks, shared with the replicas
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::model

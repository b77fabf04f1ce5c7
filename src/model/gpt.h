// GPT-2: the chain Embedding -> n_layer x TransformerBlock -> Head with explicit forward and
// backward, parameters named as Hugging Face GPT-2, and an exact declaration of its memory:
// params, grads, saved activations (per block) and backward workspace, each under its pool tag.
//
// On one device, or one rank's part over tensor / sequence / context parallel groups
// (model/parallel.h): every rank of a tp x cp group passes the same full micro-batch and gets the
// same loss. Training a step there (per rank), with data parallelism over the dp x cp group
// (parallel::DataParallel: it takes over the parameters and runs as this model's ChainHooks):
//   ddp.zero_grad();
//   loss = model.forward(tokens, targets, {.fuse_backward = true, .dloss_scale = 1.0f / dp});
//   model.backward();   // buckets reduced over dp x cp as backward goes: sums over cp, over dp
//   ddp.step(lr);       // sp-partial sums over tp, the global norm over dp x cp and tp, AdamW
// where each rank updates its own parts.
#pragma once
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "core/backend.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "model/blocks.h"
#include "model/config.h"
#include "model/param.h"
#include "model/recompute.h"

namespace loom::model {

// Checks a micro-batch for a model of `cfg`: tokens i32 [B, T] with B, T > 0 and T <= block_size;
// targets, when given (always, with need_targets), i32 of the same shape. Errors name the model.
void check_batch(const GPTConfig& cfg, const Tensor& tokens, const Tensor& targets, bool need_targets);

struct ForwardOptions {
  // Turn the logits buffer into dlogits during forward (one softmax pass, as in training);
  // logits() is then unavailable. backward() works either way.
  bool fuse_backward = false;
  // The gradient of the objective with respect to the mean loss of this call (1 / k for a
  // mean over k accumulated micro-batches).
  float dloss_scale = 1.0f;
  // A device batch, when loss_out is set: tokens and targets (both required) are in the backend's
  // memory and nothing is read, checked or counted on the host, so the call can be captured in a
  // graph. counted is the number of targets that are not -1 (the caller counted them), loss_out
  // where the mean loss goes (f32 [1] in the backend's memory); forward then returns NaN without
  // waiting for the device.
  int64_t counted = -1;
  float* loss_out = nullptr;
};

// Called around each chain block's forward and backward; i indexes chain(): 0 = embedding,
// 1..n_layer = transformer blocks, n_layer + 1 = head. Data parallelism uses them to gather ZeRO-3
// parameters just before a block runs (and free them after) and to launch a gradient bucket's
// reduction as soon as backward has finished writing it.
// The layout a model runs in on this rank.
struct ModelLayout {
  ParallelGroups groups;          // tp and cp groups (null: size 1)
  bool sp = false;                // sequence parallel within tp
  int64_t activation_budget = 0;  // saved-activation bytes allowed per rank (0: unlimited); a
                                  // forward that would need more throws before allocating
  // The parameters are declared (spec, sharding) but neither allocated nor initialised: whoever
  // takes them over (parallel::DataParallel) places them, draws their values
  // (Parameter::initialise_part with seed()) and, on a device, makes their compute copies, so no
  // rank ever holds a full copy it then drops.
  bool defer_parameters = false;
  // The CPU backend's matmul inputs when the model makes its own backend (the pool constructor):
  // f32, or bf16 with f32 accumulation (BackendOptions::matmul).
  DType matmul = DType::f32;
};

struct ChainHooks {
  virtual ~ChainHooks() = default;
  virtual void before_forward(int64_t i) {}
  virtual void after_forward(int64_t i) {}
  virtual void before_backward(int64_t i) {}
  virtual void after_backward(int64_t i) {}
};

class GPT {
 public:
  // Allocates parameters (tag params, with their compute copies where the backend computes in
  // another dtype) and zeroed gradients (tag grads) from the backend's pool and initialises them
  // from seed as nanoGPT does: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 L)), biases 0,
  // LayerNorm weights 1. The backend (not owned) must outlive the model.
  GPT(const GPTConfig& cfg, Backend& be, uint64_t seed = 1337, const ModelLayout& layout = {});
  // The same on a backend of its own over `pool` (for the pool's device: the CPU's, or GPU 0).
  GPT(const GPTConfig& cfg, MemoryPool& pool, uint64_t seed = 1337, const ModelLayout& layout = {});
  GPT(const GPT&) = delete;
  GPT& operator=(const GPT&) = delete;

  const GPTConfig& config() const { return cfg_; }
  MemoryPool& pool() const { return pool_; }
  Backend& backend() const { return be_; }
  ChainParallel& parallel() const { return *par_; }

  // Every parameter once, in Hugging Face order (wte, wpe, h.0..., ln_f[, lm_head]).
  const std::vector<Parameter*>& parameters() const { return params_; }
  Parameter& parameter(std::string_view name) const;  // throws naming the parameter
  void init_weights(uint64_t seed);
  // The seed the parameters are drawn from.
  uint64_t seed() const { return seed_; }
  int64_t num_parameters() const;               // logical elements (no vocabulary padding)
  int64_t num_nonembedding_parameters() const;  // all but wte, wpe (and an untied lm_head)

  // tokens i32 [B, T] and targets i32 [B, T] (or an undefined Tensor: no loss) in host memory,
  // or, both, in the backend's memory (see ForwardOptions::counted). Returns the mean loss over
  // the targets that are not -1 (NaN without targets). T <= block_size.
  float forward(const Tensor& tokens, const Tensor& targets, const ForwardOptions& opt = {});
  // Accumulates parameter gradients of the last forward (which needs targets).
  void backward();
  // Zeroes every allocated gradient (those a ZeRO layout has detached are skipped).
  void zero_grad();
  // On a device: the one f32 buffer every parameter's gradient is a slice of (padding between them
  // zero), for summing replicas' gradients in one collective. Undefined on the CPU.
  const Tensor& flat_gradients() const { return grads_; }
  // Drops that buffer once data parallelism has taken the gradients over (parallel::DataParallel
  // points them into its own); flat_gradients() is then undefined.
  void release_flat_gradients() { grads_ = Tensor(); }
  // Copies the master weights into the compute copies the ops read, after the master weights were
  // changed outside the backend's optimizer (loading, an update on the host). Nothing where the
  // backend computes in f32.
  void refresh_compute();
  // Hooks around each chain block (nullptr: none); not owned.
  void set_hooks(ChainHooks* hooks) { hooks_ = hooks; }
  // Activation recomputation (model/recompute.h): from the next forward on, the plan's segments
  // keep only their inputs and run forward again in backward (bit-identical results).
  void set_recompute(const RecomputePlan& plan);
  const RecomputePlan& recompute() const { return plan_; }
  // The chain's declared activation bytes at [B, T] for the planner (each transformer block's
  // saved bytes, its output's, its relative forward cost; the embedding's and head's).
  ChainMemory chain_memory(int64_t B, int64_t T) const;
  // The peak saved-activation bytes of a training step at [B, T] under the recompute plan (the
  // sum over the chain without one): what the activations pool reaches.
  int64_t activation_peak_bytes(int64_t B, int64_t T) const;
  // [B, T, Vp] in the compute dtype (f32 on the CPU) of the last forward without fuse_backward
  // (columns >= vocab_size are padding).
  const Tensor& logits() const { return head_->logits(); }
  const Tensor& losses() const { return head_->losses(); }  // f32 [B, T] (under cp [B, T / cp])

  // Drops saved activations and the backward and attention workspace (reallocated when needed).
  void release_activations();
  // Counts release_activations calls (and so the new shapes forward was given): graphs captured
  // over the activations of another count point at freed memory.
  uint64_t activation_epoch() const { return activation_epoch_; }

  // The chain, for schedules, checkpointing and tests.
  Embedding& embedding() { return *embedding_; }
  TransformerBlock& block(int64_t i) { return *blocks_.at(size_t(i)); }
  Head& head() { return *head_; }
  std::vector<ChainBlock*> chain() const;

  // Memory this model declares, in bytes, per pool tag.
  int64_t param_bytes() const;  // including the zero padding rows of wte / lm_head
  int64_t grad_bytes() const { return param_bytes(); }
  int64_t saved_activation_bytes(int64_t B, int64_t T) const;  // sum over the chain
  // Peak workspace of a training step at [B, T] when the attention kernel runs on `threads`
  // OpenMP threads (omp_get_max_threads() of the calling thread):
  //   B * T * (2 C + wide) * e             backward scratch: dres [B, T, C], bufC [B, T, C],
  //                                        buf4C [B, T, wide] (wide_columns: 4C for GPT-2, so 24 B T C
  //                                        bytes on the CPU) in the compute dtype (e bytes), kept
  //                                        from the first backward on
  //   + the backend's attention scratch    one buffer kept from the first forward with targets on
  //                                        and shared by every block's calls: the larger of the
  //                                        forward and backward call's
  //                                        (Backend::attention_workspace_bytes)
  //   + the backend's linear scratch        the CPU's bf16 matmuls: bf16 copies of the largest
  //                                        input, of a block of at most 4096 of a weight's rows
  //                                        and of an output gradient's columns, and oneDNN's
  //                                        scratch (Backend::linear_workspace_bytes; 0 in f32).
  // Every step reaches it, the first included. A forward without targets keeps only the forward
  // call's attention scratch. (On CUDA the backend instance also keeps the LayerNorm and
  // bias-gradient reductions' scratch and its BLAS handles' workspaces, 32 MiB each.)
  // Under tp / sp / cp the backward scratch holds the rank's rows (model/blocks.h), and the chain's
  // shared buffers (ChainParallel: gathers and partial sums under sp, the vocabulary-parallel
  // loss's statistics, ring attention's blocks) come on top.
  int64_t workspace_bytes(int64_t B, int64_t T, int threads) const;
  // Its linear scratch term: the backend's for this rank's blocks' linear calls at [B, T].
  int64_t linear_workspace_bytes(int64_t B, int64_t T) const;

 private:
  void build(uint64_t seed);
  int64_t arena_elements() const;  // a device's gradient arena: this rank's parameters
  uint64_t seed_ = 0;
  GPTConfig cfg_;
  ModelLayout layout_;
  std::unique_ptr<Backend> own_be_;  // the pool constructor's
  Backend& be_;
  MemoryPool& pool_;
  std::shared_ptr<ChainParallel> par_;
  std::unique_ptr<Embedding> embedding_;
  std::vector<std::unique_ptr<TransformerBlock>> blocks_;
  std::unique_ptr<Head> head_;
  std::vector<Parameter*> params_;
  int64_t B_ = 0, T_ = 0;
  float dloss_scale_ = 1.0f;
  bool can_backward_ = false;
  ChainHooks* hooks_ = nullptr;
  RecomputePlan plan_;
  Tensor ws_dres_, ws_bufC_, ws_buf4C_;  // [B, T, C], [B, T, C], [B, T, wide] (tag workspace)
  Tensor grads_;  // f32: every gradient, on devices (flat_gradients)
  uint64_t activation_epoch_ = 0;
};

}  // namespace loom::model

// The model's chain: Embedding -> n_layer x TransformerBlock -> Head, written once for every
// device: each block calls a backend (core/backend.h), never a kernel, and keeps its activations
// in the backend's compute dtype (f32 on the CPU, bf16 or f16 on CUDA; statistics, log-sum-exps and
// losses in f32, token ids in i32). Each block has explicit forward and backward, owns its
// parameters (f32 master weights and gradients, and their compute copies), and declares the
// activations it saves between them (saved_activation_bytes) so memory can be predicted exactly;
// the model checks the declaration against the pool. A block's input is the previous block's
// saved output, so nothing is stored twice. Backward passes the residual-stream gradient through
// one shared buffer. replica() makes another block over the same parameters with activations of
// its own (a pipeline's micro-batches in flight, a decoder). The GPT-2 and Llama families are
// options of these blocks (model/config.h): LayerNorm or RMSNorm, learned positions or rotary
// embeddings on the queries and keys, GELU MLP or SwiGLU, grouped-query attention, biases or none.
//
// Every block is parallel-aware (model/parallel.h): over a ChainParallel with tp, sp or cp > 1 it
// holds its part of each parameter, runs column- and row-parallel linears, the vocabulary-parallel
// embedding and loss, sequence-parallel LayerNorms and ring attention; at size 1 those are the
// single-device ops. Token rows: a block's input and output are this rank's rows of the residual
// stream ([B, T, C] on one device; own(B, T) of the B T / cp rows under sp); B and T passed to
// forward are the micro-batch's (T the full sequence length).
#pragma once
#include <algorithm>
#include <iterator>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/backend.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "model/config.h"
#include "model/param.h"
#include "model/param_specs.h"
#include "model/parallel.h"
#include "model/recompute.h"
#include "parallel/context/ring_attention.h"

namespace loom::model {

// Scratch of backward, shared by all blocks (tag workspace), in the backend's compute dtype; see
// GPT::workspace_bytes. Under tp / cp: dres holds the rank's stream rows, bufC and buf4C its N = B
// T / cp token rows ([N, C] and [N, wide_columns]).
struct BackwardScratch {
  void* dres = nullptr;   // [B, T, C]: gradient of the residual stream, updated in place
  void* bufC = nullptr;   // [B, T, C]
  void* buf4C = nullptr;  // [B, T, wide_columns(cfg, tp)]: dqkv, and the MLP's gradients
};
// Columns of BackwardScratch::buf4C per token row on a rank of a tp group: the widest of dqkv
// (qkv_rows / tp) and the MLP's backward (c_fc's output gradient, fc_rows / tp, and under SwiGLU
// the gradient of its F / tp outputs beside it). 4C / tp for GPT-2.
int64_t wide_columns(const GPTConfig& cfg, int tp);
// Key/value heads on a rank of a tp group (n_kv_head / tp, or 1 where they are replicated) and its
// rows of c_attn (its query heads', then those keys' and values').
int64_t local_kv_heads(const GPTConfig& cfg, int tp);
int64_t local_qkv_rows(const GPTConfig& cfg, int tp);


// The head's targets in the backend's memory (a device batch): counted on the host by the caller,
// the mean loss written to loss_out (f32 [1] in the backend's memory) instead of returned.
struct DeviceTargets {
  int64_t counted = 0;
  float* loss_out = nullptr;
};

// One f32 buffer that a model's gradients are slices of (tag grads): zeroed by one fill and summed
// over replicas by one collective. Blocks take their parameters' gradients from it in order.
struct GradArena {
  Tensor flat;         // f32 [total]
  int64_t offset = 0;  // elements handed out so far
  // The next n elements (starting on a 256-byte boundary).
  Tensor take(int64_t n);
  // Elements an arena needs for parameters `specs` taken in order.
  static int64_t elements(const std::vector<ParamSpec>& specs);

 private:
  static constexpr int64_t kAlign = 64;  // f32 elements: 256 bytes
  static int64_t aligned(int64_t n);
};

// How a block is built: where its gradients live and the layout it runs in.
struct BlockOptions {
  GradArena* arena = nullptr;  // the model's gradient arena (null: gradients of their own)
  std::shared_ptr<ChainParallel> parallel;  // null: the single device
  bool defer_parameters = false;  // declare the parameters only (ModelLayout::defer_parameters)
};

// Incremental decoding with a key/value cache (model/kv_cache.h): a forward of T new tokens at
// positions [pos, pos + T) of each of B sequences appends their keys and values to the layer's
// cache rows and attends over every cached position.
struct KVStep {
  void* k = nullptr;  // the layer's keys [B, t_max, C] in the compute dtype
  void* v = nullptr;  // the layer's values [B, t_max, C]
  int64_t t_max = 0;  // cache rows per sequence
  int64_t pos = 0;    // position of the first new token
};

// One tensor a block's forward saves for its backward.
struct SavedActivation {
  std::string name;  // e.g. "h.3.fch_gelu"
  DType dtype;
  Shape shape;
  int64_t bytes() const { return shape_numel(shape) * int64_t(dtype_size(dtype)); }
};

class ChainBlock {
 public:
  virtual ~ChainBlock() = default;
  virtual std::string name() const = 0;
  // The tensors forward saves for backward at batch B and sequence length T, by name (what a
  // checkpointing policy may drop and recompute).
  virtual std::vector<SavedActivation> saved_activations(int64_t B, int64_t T) const = 0;
  // Their bytes: exactly what forward allocates under the activations tag.
  int64_t saved_activation_bytes(int64_t B, int64_t T) const;
  // The linear layers' calls a training step makes at [B, T], as this rank makes them (for the
  // backend's scratch: Backend::linear_workspace_bytes).
  virtual void linear_shapes(int64_t B, int64_t T, std::vector<LinearShape>& out) const { (void)B, (void)T, (void)out; }
  // Parameters this block owns (a tied weight belongs to the block that declares it first).
  std::vector<Parameter*> parameters();
  // Frees the saved activations (they are reallocated at the next forward).
  virtual void release_activations() = 0;
  // Split backward (zero-bubble pipelines): bytes that backward_input keeps for backward_weight
  // (the gradients feeding the deferred weight GEMMs; tag workspace, freed by backward_weight).
  virtual int64_t deferred_gradient_bytes(int64_t B, int64_t T) const { (void)B, (void)T; return 0; }
  // The parameters whose gradients backward_input writes (the norms': cheap, computed with the
  // input gradient); backward_weight writes the others.
  virtual std::vector<Parameter*> input_pass_parameters() { return {}; }
  // Another block of the same kind over the same parameters (shared tensors), with no activations
  // yet; its activations are allocated under `tag` (activations, or workspace for inference).
  virtual std::unique_ptr<ChainBlock> replica(MemTag tag = MemTag::activations) const = 0;
  Backend& backend() const { return *be_; }
  ChainParallel& parallel() const { return *par_; }

 protected:
  ChainBlock(Backend& be, const BlockOptions& o);
  // Allocates p (ChainBlock's parameters, with their gradients from the arena when there is one).
  void allocate_param(Parameter& p);
  ChainBlock(const ChainBlock& primary, MemTag tag);  // replica(): the primary's parameters
  // The block's parameters: one list shared by the primary and its replicas, so that whoever
  // places them (data parallelism re-points a ZeRO-2 bucket's gradients or a ZeRO-3 gather's
  // weights before each block runs) places them for every micro-batch's replica at once.
  std::shared_ptr<std::vector<Parameter>> shared_params_ = std::make_shared<std::vector<Parameter>>();
  std::vector<Parameter>& params() const { return *shared_params_; }
  Parameter& add_param(Parameter p);
  Tensor act(const Shape& s, DType t) const { return Tensor::empty(s, t, act_tag_, *pool_); }
  Tensor work(const Shape& s) const { return Tensor::empty(s, dt_, MemTag::workspace, *pool_); }
  size_t esize() const { return dtype_size(dt_); }
  Backend* be_;
  MemoryPool* pool_;
  DType dt_;  // the compute dtype: activations and compute copies
  MemTag act_tag_ = MemTag::activations;
  GradArena* arena_ = nullptr;  // the model's, while it builds its blocks (null: gradients of their own)
  bool defer_ = false;          // parameters declared only, placed by whoever takes them over
  std::shared_ptr<ChainParallel> par_;  // shared by the chain's blocks and their replicas
};

// Token and position embeddings: out = wte[token] + wpe[position] (wte[token] with rotary
// positions, which the blocks apply).
class Embedding final : public ChainBlock {
 public:
  Embedding(const GPTConfig& cfg, Backend& be, const BlockOptions& o = {});
  // wte as `par` holds it (its vocabulary rows under tp), not allocated: the embedding's, or a
  // pipeline stage's copy for a tied lm_head.
  static Parameter wte_param(const GPTConfig& cfg, const ChainParallel& par);
  std::string name() const override { return "embedding"; }
  std::vector<SavedActivation> saved_activations(int64_t B, int64_t T) const override;
  void release_activations() override;
  std::unique_ptr<ChainBlock> replica(MemTag tag = MemTag::activations) const override;

  // tokens i32 [B, T] in host memory (validated, copied to the backend's memory and saved for
  // backward; under cp the rank's positions), or with on_device in the backend's memory (copied as
  // they are; one device only), at positions [pos0, pos0 + T); the output is out().
  void forward(const int32_t* tokens, int64_t B, int64_t T, int64_t pos0 = 0, bool on_device = false);
  // dout [B, T, C]: accumulates into the wte and wpe gradients.
  void backward(const void* dout);
  // Split backward: the embedding has no input gradient, so backward_input only keeps dout and
  // backward_weight does the whole of backward (bit-identical to it).
  void backward_input(const void* dout);
  void backward_weight();
  int64_t deferred_gradient_bytes(int64_t B, int64_t T) const override;
  const Tensor& out() const { return out_; }  // [B, T, C]
  Parameter& wte() { return params()[0]; }
  Parameter* wpe() { return params().size() > 1 ? &params()[1] : nullptr; }  // null with rotary positions

 private:
  Embedding(const Embedding& primary, MemTag tag)
      : ChainBlock(primary, tag), cfg_(primary.cfg_), row_of_(primary.row_of_) {}
  GPTConfig cfg_;
  // With a pruned embedding (GPTConfig::kept_tokens): each token id's row of wte, -1 for the
  // pruned ones; the remapped ids of the batch.
  std::shared_ptr<const std::vector<int32_t>> row_of_;
  std::vector<int32_t> rows_;
  int64_t B_ = 0, T_ = 0, pos0_ = 0;
  Tensor tokens_;     // i32 [B, T / cp]
  Tensor out_;        // [B, T, C] (the rank's stream rows)
  Tensor dout_;       // [B, T, C] between backward_input and backward_weight (tag workspace)
};

// Pre-norm block: x + attn(ln_1(x)), then + mlp(ln_2(.)). GPT-2: LayerNorms, tanh-GELU MLP of
// width F = 4C, biases. Llama: RMSNorms, rotary embeddings on q and k after c_attn (saved rotated;
// backward rotates dq and dk back), grouped-query attention, SwiGLU MLP (c_fc -> [gate | up],
// silu(gate) * up), no biases.
class TransformerBlock final : public ChainBlock {
 public:
  TransformerBlock(const GPTConfig& cfg, int64_t layer, Backend& be, const BlockOptions& o = {});
  std::string name() const override { return "h." + std::to_string(layer_); }
  std::vector<SavedActivation> saved_activations(int64_t B, int64_t T) const override;
  void linear_shapes(int64_t B, int64_t T, std::vector<LinearShape>& out) const override;
  void release_activations() override;
  // Frees what forward saved for backward except the output (activation recomputation: the next
  // block still reads it); the next forward at the same shape allocates them again.
  void drop_saved();
  // Selective recomputation (Korthikanti et al. 2022): the attention's output and log-sum-exps
  // are not saved but computed again from the saved qkv in backward (bit-identical).
  void set_selective(bool on);
  std::unique_ptr<ChainBlock> replica(MemTag tag = MemTag::activations) const override;

  // x [B, T, C] (must stay valid until backward: it is the previous block's output). With kv,
  // the tokens are new positions of a cached decode (no backward follows).
  void forward(const void* x, int64_t B, int64_t T, const KVStep* kv = nullptr);
  // s.dres holds d(out) on entry and d(x) on return; parameter gradients accumulate.
  void backward(const void* x, const BackwardScratch& s);
  // Split backward, together bit-identical to backward. backward_input: s.dres as in backward
  // (d(out) in, d(x) out) and the LayerNorm gradients; it keeps the output gradients of the four
  // linear layers (deferred(), tag workspace). backward_weight: their weight and bias gradients
  // from those and the saved activations, then frees the deferred tensors.
  void backward_input(const void* x, const BackwardScratch& s);
  void backward_weight();
  std::vector<Parameter*> input_pass_parameters() override;
  int64_t deferred_gradient_bytes(int64_t B, int64_t T) const override;
  const Tensor& out() const { return out_; }  // [B, T, C]
  // From now on this block computes with `other`'s parameters (shared tensors) and name: a
  // decoder runs every layer through one block and one set of buffers.
  void use_parameters_of(const TransformerBlock& other);
  // The attention call of a training step at [B, T] (packed qkv, this rank's heads; one chunk
  // pair of the ring under cp).
  AttnShape attention_shape(int64_t B, int64_t T) const;
  // Under cp: the ring's geometry of a micro-batch [B, T] (this rank's heads).
  parallel::cp::RingShape ring_shape(int64_t B, int64_t T) const;
  // The attention kernel's scratch (tag workspace, kept by the backend): the larger of its forward
  // and backward call at [B, T] on `threads` OpenMP threads (0: the calling thread's); under cp of
  // the ring's two kinds of chunk pair.
  int64_t attention_workspace_bytes(int64_t B, int64_t T, int threads = 0) const;

  // Output gradients of the linear layers, held between backward_input and backward_weight.
  struct Deferred {
    Tensor dout;   // [B, T, C]  d(mlp.c_proj output) = d(out)
    Tensor dfch;   // [B, T, fc_rows] d(mlp.c_fc output), before the GELU or SwiGLU
    Tensor dres2;  // [B, T, C]  d(attn.c_proj output) = d(res2)
    Tensor dqkv;   // [B, T, qkv_rows] d(attn.c_attn output) (before the rotation)
    Tensor atty;   // [B, T, C] the recomputed attention output (selective recomputation)
  };
  const Deferred& deferred() const { return d_; }

  // Named intermediates of the last forward (for dumps and tests).
  struct Saved {
    Tensor ln1, ln1_mean, ln1_rstd;  // [B, T, C], f32 [B, T], f32 [B, T] (no mean for RMSNorm)
    Tensor qkv;                      // [B, T, qkv_rows] (q and k rotated with rotary positions)
    Tensor atty;                     // [B, T, C] attention output before c_proj
    Tensor lse;                      // f32 [B, NH, T] attention log-sum-exp
    Tensor probs;                    // [B, NH, T, T] attention probabilities (GEMM attention only)
    Tensor res2;                     // [B, T, C] x + attention branch
    Tensor ln2, ln2_mean, ln2_rstd;  // [B, T, C], f32 [B, T], f32 [B, T]
    Tensor fch;                      // [B, T, fc_rows] c_fc output (GELU or SwiGLU input)
    Tensor fch_gelu;                 // [B, T, F] the activation's output (c_proj's input)
  };
  const Saved& saved() const { return a_; }

 private:
  enum : int {  // positions in params() (model/param_specs.h)
    LN1_W = kLn1W, LN1_B = kLn1B, QKV_W = kQkvW, QKV_B = kQkvB, ATTN_PROJ_W = kAttnProjW, ATTN_PROJ_B = kAttnProjB,
    LN2_W = kLn2W, LN2_B = kLn2B, FC_W = kFcW, FC_B = kFcB, MLP_PROJ_W = kMlpProjW, MLP_PROJ_B = kMlpProjB
  };
  TransformerBlock(const TransformerBlock& primary, MemTag tag)
      : ChainBlock(primary, tag), cfg_(primary.cfg_), layer_(primary.layer_), inv_freq_(primary.inv_freq_) {
    selective_ = primary.selective_;
    std::copy(std::begin(primary.idx_), std::end(primary.idx_), std::begin(idx_));
  }
  void allocate(int64_t B, int64_t T, bool probs);
  // backward, or with defer backward_input (the weight GEMMs kept for backward_weight).
  void run_backward(const void* x, const BackwardScratch& s, bool defer);
  // The training step's attention from the saved qkv into out [B, T, C] and lse.
  void attend(const Tensor& out, const Tensor& lse, int64_t B, int64_t T);
  bool selective_ = false;
  // The decode branch of forward's attention: append the new keys and values, attend over the cache.
  void attend_cached(const KVStep& kv);
  GPTConfig cfg_;
  int64_t layer_;
  int64_t B_ = 0, T_ = 0;
  Saved a_;
  Deferred d_;
  Tensor out_;  // [B, T, C] x + attention branch + MLP branch
  int idx_[kBlockParams];         // BlockParam -> position in params() (-1: the config has none)
  std::vector<double> inv_freq_;  // rotary frequencies [HS / 2] (rotary positions only)
  // Rotates this rank's q and k heads of qkv [B, T / cp, qkv_rows / tp] (inverse: back, for
  // their gradients) at positions pos0 + t (or the rank's positions under cp).
  void rotate(void* qkv, int64_t B, int64_t T, int64_t pos0, bool inverse);
  bool rms() const { return cfg_.norm == Norm::rmsnorm; }
  const void* w(int i) const { return idx_[i] < 0 ? nullptr : params()[size_t(idx_[i])].weights().raw(); }
  float* g(int i) { return idx_[i] < 0 ? nullptr : params()[size_t(idx_[i])].grad.f32(); }
};

// Final LayerNorm, lm_head (tied to wte unless configured otherwise) and the fused
// softmax + cross-entropy over the padded vocabulary. The logits buffer is reused in place for
// dlogits, so the head saves one [B, T, Vp] buffer.
class Head final : public ChainBlock {
 public:
  // lm_head is `tied` (wte's value and gradient, [Vp, C]) when the config ties embeddings. The
  // final norm is the blocks' kind (LayerNorm, or RMSNorm without a bias).
  Head(const GPTConfig& cfg, Parameter* tied, Backend& be, const BlockOptions& o = {});
  std::string name() const override { return "head"; }
  std::vector<SavedActivation> saved_activations(int64_t B, int64_t T) const override;
  void linear_shapes(int64_t B, int64_t T, std::vector<LinearShape>& out) const override;
  std::vector<Parameter*> input_pass_parameters() override;
  void release_activations() override;
  // A replica ties to the primary's lm_head (the same wte tensors).
  std::unique_ptr<ChainBlock> replica(MemTag tag = MemTag::activations) const override;

  // x [B, T, C]. With targets (host i32 [B, T], -1 ignored), computes the per-position losses and
  // returns their mean over counted positions (of the whole sequence under cp; collective over the
  // tp and cp groups); with `fuse_backward` the logits buffer is turned
  // into dlogits in the same pass (scaled by dloss_scale / count), so backward needs no second
  // softmax and logits() is no longer available. Without targets returns NaN. With `dev`, the
  // targets are in the backend's memory: the mean goes to dev->loss_out and NaN is returned.
  double forward(const void* x, const int32_t* targets, int64_t B, int64_t T, bool fuse_backward,
                 float dloss_scale, const DeviceTargets* dev = nullptr);
  // Writes d(x) into s.dres; accumulates into the ln_f and lm_head gradients.
  void backward(const void* x, const BackwardScratch& s, float dloss_scale);
  // Split backward, together bit-identical to backward: backward_input writes d(x) into s.dres
  // and the ln_f gradients; backward_weight adds the lm_head gradient from the dlogits kept in
  // the logits buffer (nothing extra is held).
  void backward_input(const void* x, const BackwardScratch& s, float dloss_scale);
  void backward_weight();
  // [B, T, Vp] in the compute dtype: logits after a forward without fuse_backward (columns >= V
  // are padding); under tp the rank's vocabulary columns [B, T / cp, Vp / tp].
  const Tensor& logits() const;
  const Tensor& losses() const { return losses_; }  // f32 [B, T] (under cp the rank's positions)
  bool holds_dlogits() const { return holds_dlogits_; }
  int64_t counted() const { return counted_; }

 private:
  Head(const Head& primary, MemTag tag)
      : ChainBlock(primary, tag), cfg_(primary.cfg_), lm_head_(primary.lm_head_) {
    if (!cfg_.tied_embeddings) lm_head_ = &params().back();
  }
  GPTConfig cfg_;
  Parameter* lm_head_;  // wte when tied, else params().back()
  const void* norm_bias() const { return cfg_.norm == Norm::layernorm ? params()[1].weights().raw() : nullptr; }
  float* norm_bias_grad() { return cfg_.norm == Norm::layernorm ? params()[1].grad.f32() : nullptr; }
  int64_t B_ = 0, T_ = 0;
  Tensor lnf_, lnf_mean_, lnf_rstd_;  // [B, T, C], f32 [B, T], f32 [B, T]
  Tensor logits_;                     // [B, T, Vp], or dlogits after fuse_backward / backward
  Tensor losses_;                     // f32 [B, T]
  Tensor targets_;                    // i32 [B, T]
  bool has_targets_ = false, holds_dlogits_ = false, weight_pending_ = false;
  int64_t counted_ = 0;  // of the whole sequence (all cp ranks)
  // The loss over tp > 1 (the vocabulary-parallel cross-entropy), or the fused one.
  void loss(bool with_dlogits, float dloss);
};

// What recomputation plans over at [B, T] (model/recompute.h), for a run of chain blocks in order
// (a whole model's, or a pipeline chunk's): each transformer block's saved bytes, its output's
// bytes and a unit forward cost (a GPT's blocks are identical); every other block's saved bytes in
// `fixed`.
ChainMemory chain_memory(const std::vector<ChainBlock*>& blocks, int64_t B, int64_t T);

}  // namespace loom::model

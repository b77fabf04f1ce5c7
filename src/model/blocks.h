// The GPT-2 chain: Embedding -> n_layer x TransformerBlock -> Head. Each block has explicit
// forward and backward, owns its parameters, and declares the activations it saves between them
// (saved_activation_bytes) so memory can be predicted exactly; the model checks the declaration
// against the pool. A block's input is the previous block's saved output, so nothing is stored
// twice. Backward passes the residual-stream gradient through one shared buffer.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/memory.h"
#include "core/tensor.h"
#include "kernels/cpu/attention.h"
#include "model/config.h"
#include "model/param.h"
#include "model/param_specs.h"

namespace loom::model {

// Scratch of backward, shared by all blocks (tag workspace); see GPT::workspace_bytes.
struct BackwardScratch {
  float* dres = nullptr;  // f32 [B, T, C]: gradient of the residual stream, updated in place
  float* bufC = nullptr;  // f32 [B, T, C]
  float* buf4C = nullptr; // f32 [B, T, 4C] (also holds dqkv [B, T, 3C])
  // The attention kernel's scratch, kept by the caller across blocks and steps (grown to the
  // call's size if smaller); null: each attention call allocates its own.
  cpu::AttnWorkspace* attn = nullptr;
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
  // Parameters this block owns (a tied weight belongs to the block that declares it first).
  std::vector<Parameter*> parameters();
  // Frees the saved activations (they are reallocated at the next forward).
  virtual void release_activations() = 0;
  // Split backward (zero-bubble pipelines): bytes that backward_input keeps for backward_weight
  // (the gradients feeding the deferred weight GEMMs; tag workspace, freed by backward_weight).
  virtual int64_t deferred_gradient_bytes(int64_t B, int64_t T) const { (void)B, (void)T; return 0; }

 protected:
  std::vector<Parameter> params_;
  Parameter& add_param(ParamSpec spec);
};

// Token and position embeddings: out = wte[token] + wpe[position].
class Embedding final : public ChainBlock {
 public:
  Embedding(const GPTConfig& cfg, MemoryPool& pool);
  std::string name() const override { return "embedding"; }
  std::vector<SavedActivation> saved_activations(int64_t B, int64_t T) const override;
  void release_activations() override;

  // tokens i32 [B, T] (copied and saved for backward); the output is out().
  void forward(const int32_t* tokens, int64_t B, int64_t T);
  // dout f32 [B, T, C]: accumulates into the wte and wpe gradients.
  void backward(const float* dout);
  // Split backward: the embedding has no input gradient, so backward_input only keeps dout and
  // backward_weight does the whole of backward (bit-identical to it).
  void backward_input(const float* dout);
  void backward_weight();
  int64_t deferred_gradient_bytes(int64_t B, int64_t T) const override;
  const Tensor& out() const { return out_; }  // f32 [B, T, C]
  Parameter& wte() { return params_[0]; }
  Parameter& wpe() { return params_[1]; }

 private:
  GPTConfig cfg_;
  MemoryPool& pool_;
  int64_t B_ = 0, T_ = 0;
  Tensor tokens_;  // i32 [B, T]
  Tensor out_;     // f32 [B, T, C]
  Tensor dout_;    // f32 [B, T, C] between backward_input and backward_weight (tag workspace)
};

// Pre-LayerNorm GPT-2 block: x + attn(ln_1(x)), then + mlp(ln_2(.)), tanh-GELU MLP of width 4C.
class TransformerBlock final : public ChainBlock {
 public:
  TransformerBlock(const GPTConfig& cfg, int64_t layer, MemoryPool& pool);
  std::string name() const override { return "h." + std::to_string(layer_); }
  std::vector<SavedActivation> saved_activations(int64_t B, int64_t T) const override;
  void release_activations() override;

  // x f32 [B, T, C] (must stay valid until backward: it is the previous block's output). attn: the
  // attention kernel's scratch, kept by the caller (grown to the call's size if smaller); null:
  // the call allocates its own.
  void forward(const float* x, int64_t B, int64_t T, cpu::AttnWorkspace* attn = nullptr);
  // s.dres holds d(out) on entry and d(x) on return; parameter gradients accumulate.
  void backward(const float* x, const BackwardScratch& s);
  // Split backward, together bit-identical to backward. backward_input: s.dres as in backward
  // (d(out) in, d(x) out) and the LayerNorm gradients; it keeps the output gradients of the four
  // linear layers (deferred(), tag workspace). backward_weight: their weight and bias gradients
  // from those and the saved activations, then frees the deferred tensors.
  void backward_input(const float* x, const BackwardScratch& s);
  void backward_weight();
  int64_t deferred_gradient_bytes(int64_t B, int64_t T) const override;
  const Tensor& out() const { return out_; }  // f32 [B, T, C]
  // The attention kernel's arguments at [B, T]: packed qkv; without a caller's workspace the
  // scratch comes from this block's pool.
  cpu::AttnArgs attention_args(int64_t B, int64_t T) const;
  // The attention kernel's scratch (tag workspace): the larger of its forward and backward call at
  // [B, T] on `threads` OpenMP threads (cpu::attention_workspace_bytes), what a caller's
  // cpu::AttnWorkspace needs to hold for a training step.
  int64_t attention_workspace_bytes(int64_t B, int64_t T, int threads) const;

  // Output gradients of the linear layers, held between backward_input and backward_weight.
  struct Deferred {
    Tensor dout;   // f32 [B, T, C]  d(mlp.c_proj output) = d(out)
    Tensor dfch;   // f32 [B, T, 4C] d(mlp.c_fc output), before the GELU
    Tensor dres2;  // f32 [B, T, C]  d(attn.c_proj output) = d(res2)
    Tensor dqkv;   // f32 [B, T, 3C] d(attn.c_attn output)
  };
  const Deferred& deferred() const { return d_; }

  // Named intermediates of the last forward (for dumps and tests).
  struct Saved {
    Tensor ln1, ln1_mean, ln1_rstd;  // f32 [B, T, C], [B, T], [B, T]
    Tensor qkv;                      // f32 [B, T, 3C]
    Tensor atty;                     // f32 [B, T, C] attention output before c_proj
    Tensor lse;                      // f32 [B, NH, T] attention log-sum-exp
    Tensor res2;                     // f32 [B, T, C] x + attention branch
    Tensor ln2, ln2_mean, ln2_rstd;  // f32 [B, T, C], [B, T], [B, T]
    Tensor fch;                      // f32 [B, T, 4C] c_fc output (GELU input)
    Tensor fch_gelu;                 // f32 [B, T, 4C]
  };
  const Saved& saved() const { return a_; }

 private:
  enum : int {  // positions in params_ (model/param_specs.h)
    LN1_W = kLn1W, LN1_B = kLn1B, QKV_W = kQkvW, QKV_B = kQkvB, ATTN_PROJ_W = kAttnProjW, ATTN_PROJ_B = kAttnProjB,
    LN2_W = kLn2W, LN2_B = kLn2B, FC_W = kFcW, FC_B = kFcB, MLP_PROJ_W = kMlpProjW, MLP_PROJ_B = kMlpProjB
  };
  GPTConfig cfg_;
  int64_t layer_;
  MemoryPool& pool_;
  int64_t B_ = 0, T_ = 0;
  Saved a_;
  Deferred d_;
  Tensor out_;  // f32 [B, T, C] x + attention branch + MLP branch
  float* w(int i) { return params_[size_t(i)].value.f32(); }
  float* g(int i) { return params_[size_t(i)].grad.f32(); }
};

// Final LayerNorm, lm_head (tied to wte unless configured otherwise) and the fused
// softmax + cross-entropy over the padded vocabulary. The logits buffer is reused in place for
// dlogits, so the head saves one [B, T, Vp] buffer.
class Head final : public ChainBlock {
 public:
  // lm_head is `tied` (wte's value and gradient, [Vp, C]) when the config ties embeddings.
  Head(const GPTConfig& cfg, Parameter* tied, MemoryPool& pool);
  std::string name() const override { return "head"; }
  std::vector<SavedActivation> saved_activations(int64_t B, int64_t T) const override;
  void release_activations() override;

  // x f32 [B, T, C]. With targets (i32 [B, T], -1 ignored), computes the per-position losses and
  // returns their mean over counted positions; with `fuse_backward` the logits buffer is turned
  // into dlogits in the same pass (scaled by dloss_scale / count), so backward needs no second
  // softmax and logits() is no longer available. Without targets returns NaN.
  double forward(const float* x, const int32_t* targets, int64_t B, int64_t T, bool fuse_backward,
                 float dloss_scale);
  // Writes d(x) into s.dres; accumulates into the ln_f and lm_head gradients.
  void backward(const float* x, const BackwardScratch& s, float dloss_scale);
  // Split backward, together bit-identical to backward: backward_input writes d(x) into s.dres
  // and the ln_f gradients; backward_weight adds the lm_head gradient from the dlogits kept in
  // the logits buffer (nothing extra is held).
  void backward_input(const float* x, const BackwardScratch& s, float dloss_scale);
  void backward_weight();
  // f32 [B, T, Vp]: logits after a forward without fuse_backward (columns >= V are padding).
  const Tensor& logits() const;
  const Tensor& losses() const { return losses_; }  // f32 [B, T]
  bool holds_dlogits() const { return holds_dlogits_; }
  int64_t counted() const { return counted_; }

 private:
  GPTConfig cfg_;
  MemoryPool& pool_;
  Parameter* lm_head_;  // wte when tied, else params_[2]
  int64_t B_ = 0, T_ = 0;
  Tensor lnf_, lnf_mean_, lnf_rstd_;  // f32 [B, T, C], [B, T], [B, T]
  Tensor logits_;                     // f32 [B, T, Vp], or dlogits after fuse_backward / backward
  Tensor losses_;                     // f32 [B, T]
  Tensor targets_;                    // i32 [B, T]
  bool has_targets_ = false, holds_dlogits_ = false, weight_pending_ = false;
  int64_t counted_ = 0;
};

}  // namespace loom::model

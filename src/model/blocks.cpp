#include "model/blocks.h"
#include "model/param_specs.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/crossentropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/residual.h"

namespace loom::model {

namespace {
constexpr int64_t I = sizeof(int32_t);

Tensor act(const Shape& s, DType t, MemoryPool& pool) { return Tensor::empty(s, t, MemTag::activations, pool); }
}  // namespace

int64_t ChainBlock::saved_activation_bytes(int64_t B, int64_t T) const {
  int64_t n = 0;
  for (const SavedActivation& a : saved_activations(B, T)) n += a.bytes();
  return n;
}

std::vector<Parameter*> ChainBlock::parameters() {
  std::vector<Parameter*> out;
  for (auto& p : params_) out.push_back(&p);
  return out;
}

Parameter& ChainBlock::add_param(ParamSpec spec) {
  LOOM_CHECK(params_.size() < params_.capacity(), "parameter '{}' added past the reserved count", spec.name);
  params_.push_back(Parameter{std::move(spec), {}, {}, {}, {}});
  return params_.back();
}

// ---------------------------------------------------------------------------------------------
// Embedding

Embedding::Embedding(const GPTConfig& cfg, MemoryPool& pool) : cfg_(cfg), pool_(pool) {
  const std::vector<ParamSpec> specs = embedding_param_specs(cfg);
  params_.reserve(specs.size());
  for (const ParamSpec& spec : specs) add_param(spec).allocate(pool);
}

std::vector<SavedActivation> Embedding::saved_activations(int64_t B, int64_t T) const {
  return {{"embedding.tokens", DType::i32, {B, T}}, {"embedding.out", DType::f32, {B, T, cfg_.n_embd}}};
}

void Embedding::release_activations() {
  tokens_ = Tensor();
  out_ = Tensor();
  dout_ = Tensor();
  B_ = T_ = 0;
}

void Embedding::forward(const int32_t* tokens, int64_t B, int64_t T) {
  const int64_t C = cfg_.n_embd;
  if (B != B_ || T != T_) {
    release_activations();
    tokens_ = act({B, T}, DType::i32, pool_);
    out_ = act({B, T, C}, DType::f32, pool_);
    B_ = B;
    T_ = T;
  }
  std::memcpy(tokens_.raw(), tokens, size_t(B * T) * I);
  cpu::embedding_forward(out_.f32(), tokens_.i32(), wte().value.f32(), wpe().value.f32(), B, T, C, cfg_.vocab_size);
}

void Embedding::backward(const float* dout) {
  LOOM_CHECK(out_.defined(), "embedding: backward before forward");
  cpu::embedding_backward(wte().grad.f32(), wpe().grad.f32(), dout, tokens_.i32(), B_, T_, cfg_.n_embd,
                          cfg_.vocab_size);
}

int64_t Embedding::deferred_gradient_bytes(int64_t B, int64_t T) const {
  return B * T * cfg_.n_embd * int64_t(sizeof(float));
}

void Embedding::backward_input(const float* dout) {
  LOOM_CHECK(out_.defined(), "embedding: backward_input before forward");
  dout_ = Tensor::empty({B_, T_, cfg_.n_embd}, DType::f32, MemTag::workspace, pool_);
  std::memcpy(dout_.raw(), dout, size_t(dout_.numel()) * sizeof(float));
}

void Embedding::backward_weight() {
  LOOM_CHECK(dout_.defined(), "embedding: backward_weight without backward_input");
  backward(dout_.f32());
  dout_ = Tensor();
}

// ---------------------------------------------------------------------------------------------
// TransformerBlock

TransformerBlock::TransformerBlock(const GPTConfig& cfg, int64_t layer, MemoryPool& pool)
    : cfg_(cfg), layer_(layer), pool_(pool) {
  // Order and names as Hugging Face GPT-2 (weights here in Linear layout [out, in]); the
  // LN1_W ... MLP_PROJ_B indices are model::BlockParam's.
  const std::vector<ParamSpec> specs = block_param_specs(cfg, layer);
  params_.reserve(specs.size());
  for (const ParamSpec& spec : specs) add_param(spec);
  for (auto& q : params_) q.allocate(pool);
}

std::vector<SavedActivation> TransformerBlock::saved_activations(int64_t B, int64_t T) const {
  const int64_t C = cfg_.n_embd;
  const std::string p = name() + ".";
  const DType f = DType::f32;
  // Per token: 16 C + 4 floats, plus n_head log-sum-exps; no T x T attention matrix.
  return {{p + "ln1", f, {B, T, C}},       {p + "ln1_mean", f, {B, T}},       {p + "ln1_rstd", f, {B, T}},
          {p + "qkv", f, {B, T, 3 * C}},   {p + "atty", f, {B, T, C}},        {p + "lse", f, {B, cfg_.n_head, T}},
          {p + "res2", f, {B, T, C}},      {p + "ln2", f, {B, T, C}},         {p + "ln2_mean", f, {B, T}},
          {p + "ln2_rstd", f, {B, T}},     {p + "fch", f, {B, T, 4 * C}},     {p + "fch_gelu", f, {B, T, 4 * C}},
          {p + "out", f, {B, T, C}}};
}

void TransformerBlock::release_activations() {
  a_ = Saved{};
  d_ = Deferred{};
  out_ = Tensor();
  B_ = T_ = 0;
}

cpu::AttnArgs TransformerBlock::attention_args(int64_t B, int64_t T) const {
  const int64_t C = cfg_.n_embd;
  cpu::AttnArgs aa;
  aa.B = B;
  aa.NH = cfg_.n_head;
  aa.HS = C / cfg_.n_head;
  aa.Tq = aa.Tkv = T;
  aa.q_stride = aa.kv_stride = 3 * C;
  aa.o_stride = C;
  aa.pool = &pool_;
  return aa;
}

int64_t TransformerBlock::attention_workspace_bytes(int64_t B, int64_t T, int threads) const {
  const cpu::AttnArgs aa = attention_args(B, T);
  return cpu::attention_training_workspace_bytes(aa, threads);
}

void TransformerBlock::forward(const float* x, int64_t B, int64_t T, cpu::AttnWorkspace* attn) {
  const int64_t C = cfg_.n_embd, NH = cfg_.n_head, BT = B * T;
  if (B != B_ || T != T_) {
    release_activations();
    a_.ln1 = act({B, T, C}, DType::f32, pool_);
    a_.ln1_mean = act({B, T}, DType::f32, pool_);
    a_.ln1_rstd = act({B, T}, DType::f32, pool_);
    a_.qkv = act({B, T, 3 * C}, DType::f32, pool_);
    a_.atty = act({B, T, C}, DType::f32, pool_);
    a_.lse = act({B, NH, T}, DType::f32, pool_);
    a_.res2 = act({B, T, C}, DType::f32, pool_);
    a_.ln2 = act({B, T, C}, DType::f32, pool_);
    a_.ln2_mean = act({B, T}, DType::f32, pool_);
    a_.ln2_rstd = act({B, T}, DType::f32, pool_);
    a_.fch = act({B, T, 4 * C}, DType::f32, pool_);
    a_.fch_gelu = act({B, T, 4 * C}, DType::f32, pool_);
    out_ = act({B, T, C}, DType::f32, pool_);
    B_ = B;
    T_ = T;
  }
  float* qkv = a_.qkv.f32();
  const cpu::AttnArgs aa = attn ? attn->use(attention_args(B, T), false) : attention_args(B, T);

  cpu::layernorm_forward(a_.ln1.f32(), a_.ln1_mean.f32(), a_.ln1_rstd.f32(), x, w(LN1_W), w(LN1_B), BT, C,
                         cfg_.ln_eps);
  cpu::matmul_forward(qkv, a_.ln1.f32(), w(QKV_W), w(QKV_B), BT, C, 3 * C);
  cpu::attention_forward(a_.atty.f32(), a_.lse.f32(), qkv, qkv + C, qkv + 2 * C, aa);
  cpu::matmul_forward(a_.res2.f32(), a_.atty.f32(), w(ATTN_PROJ_W), w(ATTN_PROJ_B), BT, C, C);
  cpu::residual_forward(a_.res2.f32(), a_.res2.f32(), x, BT * C);
  cpu::layernorm_forward(a_.ln2.f32(), a_.ln2_mean.f32(), a_.ln2_rstd.f32(), a_.res2.f32(), w(LN2_W), w(LN2_B),
                         BT, C, cfg_.ln_eps);
  cpu::matmul_forward(a_.fch.f32(), a_.ln2.f32(), w(FC_W), w(FC_B), BT, C, 4 * C);
  cpu::gelu_forward(a_.fch_gelu.f32(), a_.fch.f32(), BT * 4 * C);
  cpu::matmul_forward(out_.f32(), a_.fch_gelu.f32(), w(MLP_PROJ_W), w(MLP_PROJ_B), BT, 4 * C, C);
  cpu::residual_forward(out_.f32(), out_.f32(), a_.res2.f32(), BT * C);
}

void TransformerBlock::backward(const float* x, const BackwardScratch& s) {
  LOOM_CHECK(out_.defined(), "{}: backward before forward", name());
  const int64_t C = cfg_.n_embd, B = B_, T = T_, BT = B * T;
  const float* qkv = a_.qkv.f32();
  float* dqkv = s.buf4C;  // f32 [B, T, 3C] in the [B, T, 4C] buffer
  const cpu::AttnArgs aa = s.attn ? s.attn->use(attention_args(B, T), true) : attention_args(B, T);

  // MLP branch; s.dres = d(out) = d(res2) through the residual.
  cpu::matmul_backward(s.buf4C, g(MLP_PROJ_W), g(MLP_PROJ_B), s.dres, a_.fch_gelu.f32(), w(MLP_PROJ_W), BT, 4 * C, C);
  cpu::gelu_backward(s.buf4C, a_.fch.f32(), s.buf4C, BT * 4 * C);
  cpu::matmul_backward(s.bufC, g(FC_W), g(FC_B), s.buf4C, a_.ln2.f32(), w(FC_W), BT, C, 4 * C);
  cpu::layernorm_backward(s.dres, g(LN2_W), g(LN2_B), s.bufC, a_.res2.f32(), w(LN2_W), a_.ln2_mean.f32(),
                          a_.ln2_rstd.f32(), BT, C, /*accumulate_dinp=*/true);
  // Attention branch; s.dres = d(res2) = d(x) through the residual.
  cpu::matmul_backward(s.bufC, g(ATTN_PROJ_W), g(ATTN_PROJ_B), s.dres, a_.atty.f32(), w(ATTN_PROJ_W), BT, C, C);
  cpu::attention_backward(dqkv, dqkv + C, dqkv + 2 * C, s.bufC, qkv, qkv + C, qkv + 2 * C, a_.atty.f32(),
                          a_.lse.f32(), aa);
  cpu::matmul_backward(s.bufC, g(QKV_W), g(QKV_B), dqkv, a_.ln1.f32(), w(QKV_W), BT, C, 3 * C);
  cpu::layernorm_backward(s.dres, g(LN1_W), g(LN1_B), s.bufC, x, w(LN1_W), a_.ln1_mean.f32(), a_.ln1_rstd.f32(), BT,
                          C, /*accumulate_dinp=*/true);
}

int64_t TransformerBlock::deferred_gradient_bytes(int64_t B, int64_t T) const {
  return B * T * 9 * cfg_.n_embd * int64_t(sizeof(float));  // dout C + dfch 4C + dres2 C + dqkv 3C
}

// The same kernel calls as backward with the weight GEMMs and bias sums moved to
// backward_weight: each gradient is produced by the same operations on the same values.
void TransformerBlock::backward_input(const float* x, const BackwardScratch& s) {
  LOOM_CHECK(out_.defined(), "{}: backward_input before forward", name());
  LOOM_CHECK(!d_.dout.defined(), "{}: backward_input twice without backward_weight", name());
  const int64_t C = cfg_.n_embd, B = B_, T = T_, BT = B * T;
  auto ws = [&](const Shape& sh) { return Tensor::empty(sh, DType::f32, MemTag::workspace, pool_); };
  d_.dout = ws({B, T, C});
  d_.dfch = ws({B, T, 4 * C});
  d_.dres2 = ws({B, T, C});
  d_.dqkv = ws({B, T, 3 * C});
  const float* qkv = a_.qkv.f32();
  float* dqkv = d_.dqkv.f32();
  const cpu::AttnArgs aa = s.attn ? s.attn->use(attention_args(B, T), true) : attention_args(B, T);

  // MLP branch; s.dres = d(out) = d(res2) through the residual.
  std::memcpy(d_.dout.raw(), s.dres, size_t(BT * C) * sizeof(float));
  cpu::matmul_backward(s.buf4C, nullptr, nullptr, s.dres, a_.fch_gelu.f32(), w(MLP_PROJ_W), BT, 4 * C, C);
  cpu::gelu_backward(d_.dfch.f32(), a_.fch.f32(), s.buf4C, BT * 4 * C);
  cpu::matmul_backward(s.bufC, nullptr, nullptr, d_.dfch.f32(), a_.ln2.f32(), w(FC_W), BT, C, 4 * C);
  cpu::layernorm_backward(s.dres, g(LN2_W), g(LN2_B), s.bufC, a_.res2.f32(), w(LN2_W), a_.ln2_mean.f32(),
                          a_.ln2_rstd.f32(), BT, C, /*accumulate_dinp=*/true);
  // Attention branch; s.dres = d(res2) = d(x) through the residual.
  std::memcpy(d_.dres2.raw(), s.dres, size_t(BT * C) * sizeof(float));
  cpu::matmul_backward(s.bufC, nullptr, nullptr, s.dres, a_.atty.f32(), w(ATTN_PROJ_W), BT, C, C);
  cpu::attention_backward(dqkv, dqkv + C, dqkv + 2 * C, s.bufC, qkv, qkv + C, qkv + 2 * C, a_.atty.f32(),
                          a_.lse.f32(), aa);
  cpu::matmul_backward(s.bufC, nullptr, nullptr, dqkv, a_.ln1.f32(), w(QKV_W), BT, C, 3 * C);
  cpu::layernorm_backward(s.dres, g(LN1_W), g(LN1_B), s.bufC, x, w(LN1_W), a_.ln1_mean.f32(), a_.ln1_rstd.f32(), BT,
                          C, /*accumulate_dinp=*/true);
}

void TransformerBlock::backward_weight() {
  LOOM_CHECK(d_.dout.defined(), "{}: backward_weight without backward_input", name());
  const int64_t C = cfg_.n_embd, BT = B_ * T_;
  cpu::matmul_backward(nullptr, g(MLP_PROJ_W), g(MLP_PROJ_B), d_.dout.f32(), a_.fch_gelu.f32(), w(MLP_PROJ_W), BT,
                       4 * C, C);
  cpu::matmul_backward(nullptr, g(FC_W), g(FC_B), d_.dfch.f32(), a_.ln2.f32(), w(FC_W), BT, C, 4 * C);
  cpu::matmul_backward(nullptr, g(ATTN_PROJ_W), g(ATTN_PROJ_B), d_.dres2.f32(), a_.atty.f32(), w(ATTN_PROJ_W), BT, C,
                       C);
  cpu::matmul_backward(nullptr, g(QKV_W), g(QKV_B), d_.dqkv.f32(), a_.ln1.f32(), w(QKV_W), BT, C, 3 * C);
  d_ = Deferred{};
}

// ---------------------------------------------------------------------------------------------
// Head

Head::Head(const GPTConfig& cfg, Parameter* tied, MemoryPool& pool) : cfg_(cfg), pool_(pool), lm_head_(tied) {
  const std::vector<ParamSpec> specs = head_param_specs(cfg);
  params_.reserve(specs.size());
  for (const ParamSpec& spec : specs) add_param(spec).allocate(pool);
  if (!cfg.tied_embeddings) lm_head_ = &params_.back();
  LOOM_CHECK(lm_head_ != nullptr, "head: tied embeddings need the wte parameter");
  LOOM_CHECK(lm_head_->value_full.size(0) == cfg.padded_vocab(), "head: lm_head has {} rows, expected {}",
             lm_head_->value_full.size(0), cfg.padded_vocab());
}

std::vector<SavedActivation> Head::saved_activations(int64_t B, int64_t T) const {
  const DType f = DType::f32;
  // The logits buffer holds dlogits after the fused loss, so there is one [B, T, Vp] buffer.
  return {{"head.lnf", f, {B, T, cfg_.n_embd}}, {"head.lnf_mean", f, {B, T}}, {"head.lnf_rstd", f, {B, T}},
          {"head.logits", f, {B, T, cfg_.padded_vocab()}}, {"head.losses", f, {B, T}},
          {"head.targets", DType::i32, {B, T}}};
}

void Head::release_activations() {
  lnf_ = lnf_mean_ = lnf_rstd_ = logits_ = losses_ = targets_ = Tensor();
  B_ = T_ = 0;
  has_targets_ = holds_dlogits_ = weight_pending_ = false;
}

double Head::forward(const float* x, const int32_t* targets, int64_t B, int64_t T, bool fuse_backward,
                     float dloss_scale) {
  const int64_t C = cfg_.n_embd, V = cfg_.vocab_size, Vp = cfg_.padded_vocab(), BT = B * T;
  if (B != B_ || T != T_) {
    release_activations();
    lnf_ = act({B, T, C}, DType::f32, pool_);
    lnf_mean_ = act({B, T}, DType::f32, pool_);
    lnf_rstd_ = act({B, T}, DType::f32, pool_);
    logits_ = act({B, T, Vp}, DType::f32, pool_);
    losses_ = act({B, T}, DType::f32, pool_);
    targets_ = act({B, T}, DType::i32, pool_);
    B_ = B;
    T_ = T;
  }
  cpu::layernorm_forward(lnf_.f32(), lnf_mean_.f32(), lnf_rstd_.f32(), x, params_[0].value.f32(),
                         params_[1].value.f32(), BT, C, cfg_.ln_eps);
  cpu::matmul_forward(logits_.f32(), lnf_.f32(), lm_head_->value_full.f32(), nullptr, BT, C, Vp);
  holds_dlogits_ = false;
  has_targets_ = targets != nullptr;
  counted_ = 0;
  if (!has_targets_) return std::numeric_limits<double>::quiet_NaN();

  std::memcpy(targets_.raw(), targets, size_t(BT) * I);
  const int32_t* tg = targets_.i32();
  for (int64_t i = 0; i < BT; ++i) counted_ += tg[i] >= 0;
  float* losses = losses_.f32();
  if (fuse_backward) {
    float dloss = counted_ ? dloss_scale / float(counted_) : 0.0f;
    cpu::crossentropy_forward_backward(losses, logits_.f32(), logits_.f32(), tg, dloss, BT, V, Vp);
    holds_dlogits_ = true;
  } else {
    cpu::crossentropy_forward(losses, logits_.f32(), tg, BT, V, Vp);
  }
  double sum = 0;
  for (int64_t i = 0; i < BT; ++i) sum += losses[i];
  return counted_ ? sum / double(counted_) : 0.0;
}

void Head::backward(const float* x, const BackwardScratch& s, float dloss_scale) {
  // The input gradient, then lm_head's weight gradient: separate GEMMs either way, so this is
  // the split backward run at once.
  backward_input(x, s, dloss_scale);
  backward_weight();
}

void Head::backward_input(const float* x, const BackwardScratch& s, float dloss_scale) {
  LOOM_CHECK(logits_.defined() && has_targets_, "head: backward_input needs a forward with targets");
  const int64_t C = cfg_.n_embd, V = cfg_.vocab_size, Vp = cfg_.padded_vocab(), BT = B_ * T_;
  if (!holds_dlogits_) {
    float dloss = counted_ ? dloss_scale / float(counted_) : 0.0f;
    cpu::crossentropy_forward_backward(losses_.f32(), logits_.f32(), logits_.f32(), targets_.i32(), dloss, BT, V,
                                       Vp);
    holds_dlogits_ = true;
  }
  cpu::matmul_backward(s.bufC, nullptr, nullptr, logits_.f32(), lnf_.f32(), lm_head_->value_full.f32(), BT, C, Vp);
  cpu::layernorm_backward(s.dres, params_[0].grad.f32(), params_[1].grad.f32(), s.bufC, x, params_[0].value.f32(),
                          lnf_mean_.f32(), lnf_rstd_.f32(), BT, C, /*accumulate_dinp=*/false);
  weight_pending_ = true;
}

void Head::backward_weight() {
  LOOM_CHECK(weight_pending_, "head: backward_weight without backward_input");
  const int64_t C = cfg_.n_embd, Vp = cfg_.padded_vocab(), BT = B_ * T_;
  cpu::matmul_backward(nullptr, lm_head_->grad_full.f32(), nullptr, logits_.f32(), lnf_.f32(),
                       lm_head_->value_full.f32(), BT, C, Vp);
  weight_pending_ = false;
}

const Tensor& Head::logits() const {
  LOOM_CHECK(logits_.defined() && !holds_dlogits_,
             "head: logits are not available (no forward yet, or the buffer now holds dlogits)");
  return logits_;
}

}  // namespace loom::model

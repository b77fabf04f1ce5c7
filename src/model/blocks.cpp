#include "model/blocks.h"
#include "model/param_specs.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace loom::model {

namespace {
constexpr int64_t I = sizeof(int32_t);

const char* at(const Tensor& t, int64_t elems) { return static_cast<const char*>(t.raw()) + elems * int64_t(dtype_size(t.dtype())); }
char* at(Tensor& t, int64_t elems) { return static_cast<char*>(t.raw()) + elems * int64_t(dtype_size(t.dtype())); }
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
  params_.push_back(Parameter{std::move(spec), {}, {}, {}, {}, {}, {}});
  return params_.back();
}

ChainBlock::ChainBlock(const ChainBlock& primary, MemTag tag)
    : params_(primary.params_), be_(primary.be_), pool_(primary.pool_), dt_(primary.dt_), act_tag_(tag) {}

void ChainBlock::allocate_param(Parameter& p) {
  p.allocate(*be_, arena_ ? arena_->take(p.spec.alloc_numel()) : Tensor());
}

int64_t GradArena::aligned(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

int64_t GradArena::elements(const std::vector<ParamSpec>& specs) {
  int64_t total = 0;
  for (const ParamSpec& s : specs) total = aligned(total) + s.alloc_numel();
  return total;
}

Tensor GradArena::take(int64_t n) {
  const int64_t start = aligned(offset);
  LOOM_CHECK(flat.defined() && start + n <= flat.numel(), "gradient arena: {} elements at {} of {}", n, start,
             flat.defined() ? flat.numel() : 0);
  offset = start + n;
  return flat.slice0(start, n);
}

// ---------------------------------------------------------------------------------------------
// Embedding

Embedding::Embedding(const GPTConfig& cfg, Backend& be, GradArena* arena) : ChainBlock(be, arena), cfg_(cfg) {
  const std::vector<ParamSpec> specs = embedding_param_specs(cfg);
  params_.reserve(specs.size());
  for (const ParamSpec& spec : specs) allocate_param(add_param(spec));
  arena_ = nullptr;
}

std::unique_ptr<ChainBlock> Embedding::replica(MemTag tag) const {
  return std::unique_ptr<ChainBlock>(new Embedding(*this, tag));
}

std::vector<SavedActivation> Embedding::saved_activations(int64_t B, int64_t T) const {
  return {{"embedding.tokens", DType::i32, {B, T}}, {"embedding.out", dt_, {B, T, cfg_.n_embd}}};
}

void Embedding::release_activations() {
  tokens_ = Tensor();
  out_ = Tensor();
  dout_ = Tensor();
  B_ = T_ = 0;
}

void Embedding::forward(const int32_t* tokens, int64_t B, int64_t T, int64_t pos0, bool on_device) {
  const int64_t C = cfg_.n_embd;
  LOOM_CHECK(pos0 >= 0 && pos0 + T <= cfg_.block_size, "embedding: positions [{}, {}) exceed block_size {}", pos0,
             pos0 + T, cfg_.block_size);
  if (!on_device)  // (a GPU's kernel reads the ids unchecked; a device batch was checked by its caller)
    for (int64_t i = 0; i < B * T; ++i)
      LOOM_CHECK(tokens[i] >= 0 && tokens[i] < cfg_.vocab_size,
                 "embedding: token id {} at index {} is outside the vocabulary [0, {})", tokens[i], i, cfg_.vocab_size);
  if (B != B_ || T != T_) {
    release_activations();
    tokens_ = act({B, T}, DType::i32);
    out_ = act({B, T, C}, dt_);
    B_ = B;
    T_ = T;
  }
  pos0_ = pos0;
  be_->copy({.dst = tokens_.raw(), .dst_dtype = DType::i32, .src = tokens, .src_dtype = DType::i32,
             .src_host = !on_device, .n = B * T});
  be_->embedding_forward({.dtype = dt_, .out = out_.raw(), .tokens = tokens_.i32(), .wte = wte().weights().raw(),
                          .wpe = wpe().weights().raw(), .B = B, .T = T, .C = C, .V = cfg_.vocab_size, .pos0 = pos0});
}

void Embedding::backward(const void* dout) {
  LOOM_CHECK(out_.defined(), "embedding: backward before forward");
  be_->embedding_backward({.dtype = dt_, .dwte = wte().grad.f32(), .dwpe = wpe().grad.f32(), .dout = dout,
                           .tokens = tokens_.i32(), .B = B_, .T = T_, .C = cfg_.n_embd, .V = cfg_.vocab_size,
                           .pos0 = pos0_});
}

int64_t Embedding::deferred_gradient_bytes(int64_t B, int64_t T) const {
  return B * T * cfg_.n_embd * int64_t(esize());
}

void Embedding::backward_input(const void* dout) {
  LOOM_CHECK(out_.defined(), "embedding: backward_input before forward");
  dout_ = work({B_, T_, cfg_.n_embd});
  be_->copy({.dst = dout_.raw(), .dst_dtype = dt_, .src = dout, .src_dtype = dt_, .n = dout_.numel()});
}

void Embedding::backward_weight() {
  LOOM_CHECK(dout_.defined(), "embedding: backward_weight without backward_input");
  backward(dout_.raw());
  dout_ = Tensor();
}

// ---------------------------------------------------------------------------------------------
// TransformerBlock

TransformerBlock::TransformerBlock(const GPTConfig& cfg, int64_t layer, Backend& be, GradArena* arena)
    : ChainBlock(be, arena), cfg_(cfg), layer_(layer) {
  // Order and names as Hugging Face GPT-2 (weights here in Linear layout [out, in]); the
  // LN1_W ... MLP_PROJ_B indices are model::BlockParam's.
  const std::vector<ParamSpec> specs = block_param_specs(cfg, layer);
  params_.reserve(specs.size());
  for (const ParamSpec& spec : specs) add_param(spec);
  for (auto& q : params_) allocate_param(q);
  arena_ = nullptr;
}

std::unique_ptr<ChainBlock> TransformerBlock::replica(MemTag tag) const {
  return std::unique_ptr<ChainBlock>(new TransformerBlock(*this, tag));
}

AttnShape TransformerBlock::attention_shape(int64_t B, int64_t T) const {
  const int64_t C = cfg_.n_embd;
  return {.B = B, .NH = cfg_.n_head, .HS = C / cfg_.n_head, .Tq = T, .Tkv = T, .q_stride = 3 * C,
          .kv_stride = 3 * C, .o_stride = C};
}

int64_t TransformerBlock::attention_workspace_bytes(int64_t B, int64_t T, int threads) const {
  return be_->attention_workspace_bytes(dt_, attention_shape(B, T), threads);
}

std::vector<SavedActivation> TransformerBlock::saved_activations(int64_t B, int64_t T) const {
  const int64_t C = cfg_.n_embd;
  const std::string p = name() + ".";
  const DType f = DType::f32, a = dt_;
  // Per token: 16 C activations + 4 f32 statistics, plus n_head log-sum-exps; a T x T attention
  // matrix only where the backend's attention keeps one (the GEMM kernels).
  std::vector<SavedActivation> v{{p + "ln1", a, {B, T, C}},      {p + "ln1_mean", f, {B, T}},   {p + "ln1_rstd", f, {B, T}},
                                 {p + "qkv", a, {B, T, 3 * C}},  {p + "atty", a, {B, T, C}},    {p + "lse", f, {B, cfg_.n_head, T}},
                                 {p + "res2", a, {B, T, C}},     {p + "ln2", a, {B, T, C}},     {p + "ln2_mean", f, {B, T}},
                                 {p + "ln2_rstd", f, {B, T}},    {p + "fch", a, {B, T, 4 * C}}, {p + "fch_gelu", a, {B, T, 4 * C}},
                                 {p + "out", a, {B, T, C}}};
  const int64_t probs = be_->attention_probs_bytes(dt_, attention_shape(B, T));
  if (probs > 0) v.push_back({p + "probs", a, {B, cfg_.n_head, T, T}});
  return v;
}

void TransformerBlock::release_activations() {
  a_ = Saved{};
  d_ = Deferred{};
  out_ = Tensor();
  B_ = T_ = 0;
}

void TransformerBlock::use_parameters_of(const TransformerBlock& other) {
  LOOM_CHECK(other.be_ == be_ && other.params_.size() == params_.size(), "{}: parameters of another model", name());
  params_ = other.params_;
  layer_ = other.layer_;
}

void TransformerBlock::allocate(int64_t B, int64_t T, bool probs) {
  if (B == B_ && T == T_) return;
  const int64_t C = cfg_.n_embd, NH = cfg_.n_head;
  release_activations();
  const DType f = DType::f32;
  a_.ln1 = act({B, T, C}, dt_);
  a_.ln1_mean = act({B, T}, f);
  a_.ln1_rstd = act({B, T}, f);
  a_.qkv = act({B, T, 3 * C}, dt_);
  a_.atty = act({B, T, C}, dt_);
  a_.lse = act({B, NH, T}, f);
  a_.res2 = act({B, T, C}, dt_);
  a_.ln2 = act({B, T, C}, dt_);
  a_.ln2_mean = act({B, T}, f);
  a_.ln2_rstd = act({B, T}, f);
  a_.fch = act({B, T, 4 * C}, dt_);
  a_.fch_gelu = act({B, T, 4 * C}, dt_);
  out_ = act({B, T, C}, dt_);
  if (probs && be_->attention_probs_bytes(dt_, attention_shape(B, T)) > 0) a_.probs = act({B, NH, T, T}, dt_);
  B_ = B;
  T_ = T;
}

void TransformerBlock::attend_cached(const KVStep& kv) {
  const int64_t B = B_, T = T_, C = cfg_.n_embd, pos = kv.pos;
  LOOM_CHECK(kv.k && kv.v && pos >= 0 && pos + T <= kv.t_max, "{}: cached positions [{}, {}) exceed the cache of {}",
             name(), pos, pos + T, kv.t_max);
  const size_t es = esize();
  auto* kc = static_cast<char*>(kv.k);
  auto* vc = static_cast<char*>(kv.v);
  // Append this call's keys and values at positions [pos, pos + T) of every sequence.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const char* row = at(a_.qkv, (b * T + t) * 3 * C);
      const int64_t dst = (b * kv.t_max + pos + t) * C;
      be_->copy({.dst = kc + dst * int64_t(es), .dst_dtype = dt_, .src = row + C * int64_t(es), .src_dtype = dt_, .n = C});
      be_->copy({.dst = vc + dst * int64_t(es), .dst_dtype = dt_, .src = row + 2 * C * int64_t(es), .src_dtype = dt_, .n = C});
    }
  // One sequence at a time: its T queries at positions [pos, pos + T) against its pos + T keys.
  const AttnShape s{.B = 1, .NH = cfg_.n_head, .HS = C / cfg_.n_head, .Tq = T, .Tkv = pos + T, .q_stride = 3 * C,
                    .kv_stride = C, .o_stride = C, .q_pos0 = pos, .kv_pos0 = 0};
  for (int64_t b = 0; b < B; ++b) {
    const char* q = at(a_.qkv, b * T * 3 * C);
    be_->attention_forward({.dtype = dt_, .shape = s, .out = at(a_.atty, b * T * C), .lse = a_.lse.f32() + b * cfg_.n_head * T,
                            .q = q, .k = kc + b * kv.t_max * C * int64_t(es), .v = vc + b * kv.t_max * C * int64_t(es)});
  }
}

// x may be out() itself (a decoder's residual stream in place): x is last read by the residual
// add before ln_2, and out is first written by the MLP's c_proj after it.
void TransformerBlock::forward(const void* x, int64_t B, int64_t T, const KVStep* kv) {
  const int64_t C = cfg_.n_embd, BT = B * T;
  allocate(B, T, /*probs=*/kv == nullptr);
  be_->layernorm_forward({.dtype = dt_, .out = a_.ln1.raw(), .mean = a_.ln1_mean.f32(), .rstd = a_.ln1_rstd.f32(),
                          .inp = x, .weight = w(LN1_W), .bias = w(LN1_B), .N = BT, .C = C, .eps = cfg_.ln_eps});
  be_->linear_forward({.dtype = dt_, .out = a_.qkv.raw(), .inp = a_.ln1.raw(), .weight = w(QKV_W), .bias = w(QKV_B),
                       .M = BT, .K = C, .N = 3 * C});
  if (kv) {
    attend_cached(*kv);
  } else {
    const char* qkv = at(a_.qkv, 0);
    const size_t es = esize();
    be_->attention_forward({.dtype = dt_, .shape = attention_shape(B, T), .out = a_.atty.raw(), .lse = a_.lse.f32(),
                            .probs = a_.probs.defined() ? a_.probs.raw() : nullptr, .q = qkv,
                            .k = qkv + C * int64_t(es), .v = qkv + 2 * C * int64_t(es)});
  }
  // res2 = x + c_proj(atty), then ln_2 of it: one pass where the backend fuses the residual add.
  be_->linear_forward({.dtype = dt_, .out = a_.res2.raw(), .inp = a_.atty.raw(), .weight = w(ATTN_PROJ_W),
                       .bias = w(ATTN_PROJ_B), .M = BT, .K = C, .N = C});
  be_->layernorm_forward({.dtype = dt_, .out = a_.ln2.raw(), .mean = a_.ln2_mean.f32(), .rstd = a_.ln2_rstd.f32(),
                          .inp = a_.res2.raw(), .residual_b = x, .residual_out = a_.res2.raw(), .weight = w(LN2_W),
                          .bias = w(LN2_B), .N = BT, .C = C, .eps = cfg_.ln_eps});
  be_->linear_forward({.dtype = dt_, .out = a_.fch_gelu.raw(), .pre_gelu = a_.fch.raw(), .inp = a_.ln2.raw(),
                       .weight = w(FC_W), .bias = w(FC_B), .M = BT, .K = C, .N = 4 * C, .gelu = true});
  // out = res2 + c_proj(fch_gelu): the residual add in the GEMM where the backend fuses it.
  be_->linear_forward({.dtype = dt_, .out = out_.raw(), .inp = a_.fch_gelu.raw(), .weight = w(MLP_PROJ_W),
                       .bias = w(MLP_PROJ_B), .M = BT, .K = 4 * C, .N = C, .residual = a_.res2.raw()});
}

void TransformerBlock::backward(const void* x, const BackwardScratch& s) {
  LOOM_CHECK(out_.defined(), "{}: backward before forward", name());
  const int64_t C = cfg_.n_embd, B = B_, T = T_, BT = B * T;
  const size_t es = esize();
  const char* qkv = at(a_.qkv, 0);
  char* dqkv = static_cast<char*>(s.buf4C);  // [B, T, 3C] in the [B, T, 4C] buffer

  // MLP branch; s.dres = d(out) = d(res2) through the residual. The c_proj backward also goes
  // back through the GELU (into d(fch)).
  be_->linear_backward({.dtype = dt_, .dinp = s.buf4C, .dweight = g(MLP_PROJ_W), .dbias = g(MLP_PROJ_B), .dout = s.dres,
                        .inp = a_.fch_gelu.raw(), .weight = w(MLP_PROJ_W), .gelu_pre = a_.fch.raw(), .M = BT,
                        .K = 4 * C, .N = C});
  be_->linear_backward({.dtype = dt_, .dinp = s.bufC, .dweight = g(FC_W), .dbias = g(FC_B), .dout = s.buf4C,
                        .inp = a_.ln2.raw(), .weight = w(FC_W), .M = BT, .K = C, .N = 4 * C});
  be_->layernorm_backward({.dtype = dt_, .dinp = s.dres, .accumulate = true, .dweight = g(LN2_W), .dbias = g(LN2_B),
                           .dout = s.bufC, .inp = a_.res2.raw(), .weight = w(LN2_W), .mean = a_.ln2_mean.f32(),
                           .rstd = a_.ln2_rstd.f32(), .N = BT, .C = C});
  // Attention branch; s.dres = d(res2) = d(x) through the residual.
  be_->linear_backward({.dtype = dt_, .dinp = s.bufC, .dweight = g(ATTN_PROJ_W), .dbias = g(ATTN_PROJ_B),
                        .dout = s.dres, .inp = a_.atty.raw(), .weight = w(ATTN_PROJ_W), .M = BT, .K = C, .N = C});
  be_->attention_backward({.dtype = dt_, .shape = attention_shape(B, T), .dq = dqkv, .dk = dqkv + C * int64_t(es),
                           .dv = dqkv + 2 * C * int64_t(es), .dout = s.bufC, .q = qkv, .k = qkv + C * int64_t(es),
                           .v = qkv + 2 * C * int64_t(es), .out = a_.atty.raw(), .lse = a_.lse.f32(),
                           .probs = a_.probs.defined() ? a_.probs.raw() : nullptr});
  be_->linear_backward({.dtype = dt_, .dinp = s.bufC, .dweight = g(QKV_W), .dbias = g(QKV_B), .dout = dqkv,
                        .inp = a_.ln1.raw(), .weight = w(QKV_W), .M = BT, .K = C, .N = 3 * C});
  be_->layernorm_backward({.dtype = dt_, .dinp = s.dres, .accumulate = true, .dweight = g(LN1_W), .dbias = g(LN1_B),
                           .dout = s.bufC, .inp = x, .weight = w(LN1_W), .mean = a_.ln1_mean.f32(),
                           .rstd = a_.ln1_rstd.f32(), .N = BT, .C = C});
}

int64_t TransformerBlock::deferred_gradient_bytes(int64_t B, int64_t T) const {
  return B * T * 9 * cfg_.n_embd * int64_t(esize());  // dout C + dfch 4C + dres2 C + dqkv 3C
}

// The same op calls as backward with the weight GEMMs and bias sums moved to backward_weight:
// each gradient is produced by the same operations on the same values.
void TransformerBlock::backward_input(const void* x, const BackwardScratch& s) {
  LOOM_CHECK(out_.defined(), "{}: backward_input before forward", name());
  LOOM_CHECK(!d_.dout.defined(), "{}: backward_input twice without backward_weight", name());
  const int64_t C = cfg_.n_embd, B = B_, T = T_, BT = B * T;
  const size_t es = esize();
  d_.dout = work({B, T, C});
  d_.dfch = work({B, T, 4 * C});
  d_.dres2 = work({B, T, C});
  d_.dqkv = work({B, T, 3 * C});
  const char* qkv = at(a_.qkv, 0);
  char* dqkv = at(d_.dqkv, 0);
  auto keep = [&](Tensor& dst, const void* src) {
    be_->copy({.dst = dst.raw(), .dst_dtype = dt_, .src = src, .src_dtype = dt_, .n = dst.numel()});
  };

  // MLP branch; s.dres = d(out) = d(res2) through the residual.
  keep(d_.dout, s.dres);
  be_->linear_backward({.dtype = dt_, .dinp = s.buf4C, .dout = s.dres, .weight = w(MLP_PROJ_W), .M = BT, .K = 4 * C, .N = C});
  be_->gelu_backward(dt_, d_.dfch.raw(), a_.fch.raw(), s.buf4C, BT * 4 * C);
  be_->linear_backward({.dtype = dt_, .dinp = s.bufC, .dout = d_.dfch.raw(), .weight = w(FC_W), .M = BT, .K = C, .N = 4 * C});
  be_->layernorm_backward({.dtype = dt_, .dinp = s.dres, .accumulate = true, .dweight = g(LN2_W), .dbias = g(LN2_B),
                           .dout = s.bufC, .inp = a_.res2.raw(), .weight = w(LN2_W), .mean = a_.ln2_mean.f32(),
                           .rstd = a_.ln2_rstd.f32(), .N = BT, .C = C});
  // Attention branch; s.dres = d(res2) = d(x) through the residual.
  keep(d_.dres2, s.dres);
  be_->linear_backward({.dtype = dt_, .dinp = s.bufC, .dout = s.dres, .weight = w(ATTN_PROJ_W), .M = BT, .K = C, .N = C});
  be_->attention_backward({.dtype = dt_, .shape = attention_shape(B, T), .dq = dqkv, .dk = dqkv + C * int64_t(es),
                           .dv = dqkv + 2 * C * int64_t(es), .dout = s.bufC, .q = qkv, .k = qkv + C * int64_t(es),
                           .v = qkv + 2 * C * int64_t(es), .out = a_.atty.raw(), .lse = a_.lse.f32(),
                           .probs = a_.probs.defined() ? a_.probs.raw() : nullptr});
  be_->linear_backward({.dtype = dt_, .dinp = s.bufC, .dout = dqkv, .weight = w(QKV_W), .M = BT, .K = C, .N = 3 * C});
  be_->layernorm_backward({.dtype = dt_, .dinp = s.dres, .accumulate = true, .dweight = g(LN1_W), .dbias = g(LN1_B),
                           .dout = s.bufC, .inp = x, .weight = w(LN1_W), .mean = a_.ln1_mean.f32(),
                           .rstd = a_.ln1_rstd.f32(), .N = BT, .C = C});
}

void TransformerBlock::backward_weight() {
  LOOM_CHECK(d_.dout.defined(), "{}: backward_weight without backward_input", name());
  const int64_t C = cfg_.n_embd, BT = B_ * T_;
  be_->linear_backward({.dtype = dt_, .dweight = g(MLP_PROJ_W), .dbias = g(MLP_PROJ_B), .dout = d_.dout.raw(),
                        .inp = a_.fch_gelu.raw(), .M = BT, .K = 4 * C, .N = C});
  be_->linear_backward({.dtype = dt_, .dweight = g(FC_W), .dbias = g(FC_B), .dout = d_.dfch.raw(), .inp = a_.ln2.raw(),
                        .M = BT, .K = C, .N = 4 * C});
  be_->linear_backward({.dtype = dt_, .dweight = g(ATTN_PROJ_W), .dbias = g(ATTN_PROJ_B), .dout = d_.dres2.raw(),
                        .inp = a_.atty.raw(), .M = BT, .K = C, .N = C});
  be_->linear_backward({.dtype = dt_, .dweight = g(QKV_W), .dbias = g(QKV_B), .dout = d_.dqkv.raw(), .inp = a_.ln1.raw(),
                        .M = BT, .K = C, .N = 3 * C});
  d_ = Deferred{};
}

// ---------------------------------------------------------------------------------------------
// Head

Head::Head(const GPTConfig& cfg, Parameter* tied, Backend& be, GradArena* arena)
    : ChainBlock(be, arena), cfg_(cfg), lm_head_(tied) {
  const std::vector<ParamSpec> specs = head_param_specs(cfg);
  params_.reserve(specs.size());
  for (const ParamSpec& spec : specs) allocate_param(add_param(spec));
  arena_ = nullptr;
  if (!cfg.tied_embeddings) lm_head_ = &params_.back();
  LOOM_CHECK(lm_head_ != nullptr, "head: tied embeddings need the wte parameter");
  LOOM_CHECK(lm_head_->value_full.size(0) == cfg.padded_vocab(), "head: lm_head has {} rows, expected {}",
             lm_head_->value_full.size(0), cfg.padded_vocab());
}

std::unique_ptr<ChainBlock> Head::replica(MemTag tag) const { return std::unique_ptr<ChainBlock>(new Head(*this, tag)); }

std::vector<SavedActivation> Head::saved_activations(int64_t B, int64_t T) const {
  const DType f = DType::f32;
  // The logits buffer holds dlogits after the fused loss, so there is one [B, T, Vp] buffer.
  return {{"head.lnf", dt_, {B, T, cfg_.n_embd}}, {"head.lnf_mean", f, {B, T}}, {"head.lnf_rstd", f, {B, T}},
          {"head.logits", dt_, {B, T, cfg_.padded_vocab()}}, {"head.losses", f, {B, T}},
          {"head.targets", DType::i32, {B, T}}};
}

void Head::release_activations() {
  lnf_ = lnf_mean_ = lnf_rstd_ = logits_ = losses_ = targets_ = Tensor();
  B_ = T_ = 0;
  has_targets_ = holds_dlogits_ = weight_pending_ = false;
}

double Head::forward(const void* x, const int32_t* targets, int64_t B, int64_t T, bool fuse_backward,
                     float dloss_scale, const DeviceTargets* dev) {
  const int64_t C = cfg_.n_embd, V = cfg_.vocab_size, Vp = cfg_.padded_vocab(), BT = B * T;
  if (B != B_ || T != T_) {
    release_activations();
    lnf_ = act({B, T, C}, dt_);
    lnf_mean_ = act({B, T}, DType::f32);
    lnf_rstd_ = act({B, T}, DType::f32);
    logits_ = act({B, T, Vp}, dt_);
    losses_ = act({B, T}, DType::f32);
    targets_ = act({B, T}, DType::i32);
    B_ = B;
    T_ = T;
  }
  be_->layernorm_forward({.dtype = dt_, .out = lnf_.raw(), .mean = lnf_mean_.f32(), .rstd = lnf_rstd_.f32(), .inp = x,
                          .weight = params_[0].weights().raw(), .bias = params_[1].weights().raw(), .N = BT, .C = C,
                          .eps = cfg_.ln_eps});
  be_->linear_forward({.dtype = dt_, .out = logits_.raw(), .inp = lnf_.raw(), .weight = lm_head_->weights_full().raw(),
                       .M = BT, .K = C, .N = Vp});
  holds_dlogits_ = false;
  has_targets_ = targets != nullptr;
  counted_ = 0;
  if (!has_targets_) return std::numeric_limits<double>::quiet_NaN();

  if (dev) {
    counted_ = dev->counted;
  } else {
    for (int64_t i = 0; i < BT; ++i) {
      LOOM_CHECK(targets[i] >= -1 && targets[i] < V, "head: target {} at index {} is outside [-1, {})", targets[i], i, V);
      counted_ += targets[i] >= 0;
    }
  }
  be_->copy({.dst = targets_.raw(), .dst_dtype = DType::i32, .src = targets, .src_dtype = DType::i32,
             .src_host = dev == nullptr, .n = BT});
  const float dloss = counted_ ? dloss_scale / float(counted_) : 0.0f;
  be_->crossentropy({.dtype = dt_, .losses = losses_.f32(), .dlogits = fuse_backward ? logits_.raw() : nullptr,
                     .logits = logits_.raw(), .targets = targets_.i32(), .dloss = dloss, .N = BT, .V = V, .Vp = Vp});
  holds_dlogits_ = fuse_backward;
  if (dev) {
    LOOM_CHECK(dev->loss_out, "head: a device batch needs loss_out");
    be_->sum(losses_.f32(), BT, counted_ ? 1.0f / float(counted_) : 0.0f, dev->loss_out);
    return std::numeric_limits<double>::quiet_NaN();
  }
  std::vector<float> host;
  const float* losses = losses_.f32();
  if (losses_.device() != Device::cpu) {
    host.resize(size_t(BT));
    be_->download(host.data(), losses_.raw(), DType::f32, BT);
    losses = host.data();
  }
  double sum = 0;
  for (int64_t i = 0; i < BT; ++i) sum += losses[i];
  return counted_ ? sum / double(counted_) : 0.0;
}

void Head::backward(const void* x, const BackwardScratch& s, float dloss_scale) {
  // The input gradient, then lm_head's weight gradient: separate GEMMs either way, so this is
  // the split backward run at once.
  backward_input(x, s, dloss_scale);
  backward_weight();
}

void Head::backward_input(const void* x, const BackwardScratch& s, float dloss_scale) {
  LOOM_CHECK(logits_.defined() && has_targets_, "head: backward_input needs a forward with targets");
  const int64_t C = cfg_.n_embd, V = cfg_.vocab_size, Vp = cfg_.padded_vocab(), BT = B_ * T_;
  if (!holds_dlogits_) {
    const float dloss = counted_ ? dloss_scale / float(counted_) : 0.0f;
    be_->crossentropy({.dtype = dt_, .losses = losses_.f32(), .dlogits = logits_.raw(), .logits = logits_.raw(),
                       .targets = targets_.i32(), .dloss = dloss, .N = BT, .V = V, .Vp = Vp});
    holds_dlogits_ = true;
  }
  be_->linear_backward({.dtype = dt_, .dinp = s.bufC, .dout = logits_.raw(), .weight = lm_head_->weights_full().raw(),
                        .M = BT, .K = C, .N = Vp});
  be_->layernorm_backward({.dtype = dt_, .dinp = s.dres, .dweight = params_[0].grad.f32(),
                           .dbias = params_[1].grad.f32(), .dout = s.bufC, .inp = x, .weight = params_[0].weights().raw(),
                           .mean = lnf_mean_.f32(), .rstd = lnf_rstd_.f32(), .N = BT, .C = C});
  weight_pending_ = true;
}

void Head::backward_weight() {
  LOOM_CHECK(weight_pending_, "head: backward_weight without backward_input");
  const int64_t C = cfg_.n_embd, Vp = cfg_.padded_vocab(), BT = B_ * T_;
  be_->linear_backward({.dtype = dt_, .dweight = lm_head_->grad_full.f32(), .dout = logits_.raw(), .inp = lnf_.raw(),
                        .M = BT, .K = C, .N = Vp});
  weight_pending_ = false;
}

const Tensor& Head::logits() const {
  LOOM_CHECK(logits_.defined() && !holds_dlogits_,
             "head: logits are not available (no forward yet, or the buffer now holds dlogits)");
  return logits_;
}

}  // namespace loom::model

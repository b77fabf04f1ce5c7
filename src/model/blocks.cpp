#include "model/blocks.h"
#include "model/param_specs.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "parallel/context/ring_attention.h"
#include "parallel/tensor/vocab_parallel.h"

namespace loom::model {

namespace {
constexpr int64_t I = sizeof(int32_t);

char* at(Tensor& t, int64_t elems) { return static_cast<char*>(t.raw()) + elems * int64_t(dtype_size(t.dtype())); }
}  // namespace

int64_t local_kv_heads(const GPTConfig& cfg, int tp) { return cfg.kv_heads() >= tp ? cfg.kv_heads() / tp : 1; }

int64_t local_qkv_rows(const GPTConfig& cfg, int tp) {
  return (cfg.n_head / tp + 2 * local_kv_heads(cfg, tp)) * cfg.head_size();
}

int64_t wide_columns(const GPTConfig& cfg, int tp) {
  const int64_t mlp = cfg.fc_rows() / tp + (cfg.mlp == Mlp::swiglu ? cfg.ffn() / tp : 0);
  return std::max(local_qkv_rows(cfg, tp), mlp);
}

int64_t ChainBlock::saved_activation_bytes(int64_t B, int64_t T) const {
  int64_t n = 0;
  for (const SavedActivation& a : saved_activations(B, T)) n += a.bytes();
  return n;
}

std::vector<Parameter*> ChainBlock::parameters() {
  std::vector<Parameter*> out;
  for (auto& p : params()) out.push_back(&p);
  return out;
}

Parameter& ChainBlock::add_param(Parameter p) {
  LOOM_CHECK(params().size() < params().capacity(), "parameter '{}' added past the reserved count", p.spec.name);
  params().push_back(std::move(p));
  return params().back();
}

ChainBlock::ChainBlock(Backend& be, const BlockOptions& o)
    : be_(&be), pool_(&be.pool()), dt_(be.compute_dtype()), arena_(o.arena), defer_(o.defer_parameters),
      par_(o.parallel ? o.parallel : std::make_shared<ChainParallel>(be)) {}

ChainBlock::ChainBlock(const ChainBlock& primary, MemTag tag)
    : shared_params_(primary.shared_params_), be_(primary.be_), pool_(primary.pool_), dt_(primary.dt_), act_tag_(tag),
      par_(primary.par_) {}

void ChainBlock::allocate_param(Parameter& p) {
  if (defer_) return;
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

Parameter Embedding::wte_param(const GPTConfig& cfg, const ChainParallel& par) {
  return par.vocab_split(embedding_param_specs(cfg)[0], cfg);
}

Embedding::Embedding(const GPTConfig& cfg, Backend& be, const BlockOptions& o) : ChainBlock(be, o), cfg_(cfg) {
  par_->check(cfg, "model config '" + cfg.name + "'");
  const std::vector<ParamSpec> specs = embedding_param_specs(cfg);
  params().reserve(specs.size());
  // wte by vocabulary rows; wpe (learned positions) whole on every tp rank: each computes its
  // whole gradient from the full output gradient, so it needs no reduction over tp.
  allocate_param(add_param(wte_param(cfg, *par_)));
  if (specs.size() > 1) allocate_param(add_param(par_->whole(specs[1], false)));
  arena_ = nullptr;
  if (cfg.kept_tokens) {
    LOOM_CHECK(!cfg.tied_embeddings, "embedding: a pruned input embedding needs untied embeddings (lm_head reads every "
                                     "row of a tied wte)");
    LOOM_CHECK(par_->tp() == 1, "embedding: a pruned input embedding runs without tensor parallelism");
    auto row_of = std::make_shared<std::vector<int32_t>>(size_t(cfg.vocab_size), -1);
    int32_t prev = -1, row = 0;
    for (int32_t id : *cfg.kept_tokens) {
      LOOM_CHECK(id > prev && id < cfg.vocab_size, "embedding: kept token ids must ascend within [0, {}), got {} after {}",
                 cfg.vocab_size, id, prev);
      (*row_of)[size_t(id)] = row++;
      prev = id;
    }
    row_of_ = std::move(row_of);
  }
}

std::unique_ptr<ChainBlock> Embedding::replica(MemTag tag) const {
  return std::unique_ptr<ChainBlock>(new Embedding(*this, tag));
}

std::vector<SavedActivation> Embedding::saved_activations(int64_t B, int64_t T) const {
  const ChainParallel& P = *par_;
  const int64_t Tl = T / P.cp(), C = cfg_.n_embd;
  const Shape out = P.sp_active() ? Shape{P.own_rows(B, T), C} : Shape{B, Tl, C};
  return {{"embedding.tokens", DType::i32, {B, Tl}}, {"embedding.out", dt_, out}};
}

void Embedding::release_activations() {
  tokens_ = Tensor();
  out_ = Tensor();
  dout_ = Tensor();
  B_ = T_ = 0;
}

void Embedding::forward(const int32_t* tokens, int64_t B, int64_t T, int64_t pos0, bool on_device) {
  ChainParallel& P = *par_;
  const int64_t C = cfg_.n_embd;
  LOOM_CHECK(pos0 >= 0 && pos0 + T <= cfg_.block_size, "embedding: positions [{}, {}) exceed block_size {}", pos0,
             pos0 + T, cfg_.block_size);
  LOOM_CHECK(!on_device || P.single(), "embedding: a device batch runs on one device (tp = cp = 1)");
  LOOM_CHECK(pos0 == 0 || P.cp() == 1, "embedding: positions from {} under context parallelism", pos0);
  P.check_sequence(T, "model '" + cfg_.name + "'");
  if (!on_device)  // (a GPU's kernel reads the ids unchecked; a device batch was checked by its caller)
    for (int64_t i = 0; i < B * T; ++i)
      LOOM_CHECK(tokens[i] >= 0 && tokens[i] < cfg_.vocab_size,
                 "embedding: token id {} at index {} is outside the vocabulary [0, {})", tokens[i], i, cfg_.vocab_size);
  if (row_of_) {  // ids become rows of the pruned table
    LOOM_CHECK(!on_device, "embedding: a pruned embedding takes its ids from host memory");
    rows_.resize(size_t(B * T));
    for (int64_t i = 0; i < B * T; ++i) {
      const int32_t r = (*row_of_)[size_t(tokens[i])];
      LOOM_CHECK(r >= 0,
                 "embedding: token id {} at index {} is not among the {} tokens the pruned input embedding keeps "
                 "(model.prune_embedding keeps those of the run's data)",
                 tokens[i], i, cfg_.input_rows());
      rows_[size_t(i)] = r;
    }
    tokens = rows_.data();
  }
  const int64_t Tl = T / P.cp(), N = P.rows(B, T);
  if (B != B_ || T != T_) {
    release_activations();
    tokens_ = act({B, Tl}, DType::i32);
    out_ = P.sp_active() ? act({P.own_rows(B, T), C}, dt_) : act({B, Tl, C}, dt_);
    B_ = B;
    T_ = T;
  }
  pos0_ = pos0;
  if (P.cp() > 1) {
    LOOM_CHECK(!on_device, "embedding: under context parallelism the tokens come from host memory");
    P.slice_sequence(tokens, tokens_.i32(), B, T);
  } else {
    be_->copy({.dst = tokens_.raw(), .dst_dtype = DType::i32, .src = tokens, .src_dtype = DType::i32,
               .src_host = !on_device, .n = B * T});
  }
  // Under tp each rank looks up its vocabulary rows (zero rows for the others' tokens) and rank 0
  // adds the positions; the sum over tp (reduce-scattered under sp) is the embedding, each row's
  // token and position values meeting exactly as on one device.
  const bool split = P.tp() > 1;
  void* dst = P.sp_active() ? P.partial_buffer(N, C) : out_.raw();
  be_->embedding_forward({.dtype = dt_, .out = dst, .tokens = tokens_.i32(), .wte = wte().weights().raw(),
                          .wpe = P.tp_rank() == 0 && wpe() ? wpe()->weights().raw() : nullptr, .B = B, .T = Tl, .C = C,
                          .V = cfg_.input_rows(), .pos0 = pos0, .positions = P.cp() > 1 ? P.positions(T) : nullptr,
                          .vocab_begin = split ? P.vocab_begin(cfg_) : 0, .vocab_rows = split ? P.vocab_rows(cfg_) : 0});
  P.reduce(dst, out_.raw(), N, C);
}

void Embedding::backward(const void* dout) {
  LOOM_CHECK(out_.defined(), "embedding: backward before forward");
  ChainParallel& P = *par_;
  const int64_t C = cfg_.n_embd, N = P.rows(B_, T_);
  const bool split = P.tp() > 1;
  // Both tables from the output gradient of every token row (gathered under sp).
  be_->embedding_backward({.dtype = dt_, .dwte = wte().grad.f32(), .dwpe = wpe() ? wpe()->grad.f32() : nullptr,
                           .dout = P.gather(dout, N, C),
                           .tokens = tokens_.i32(), .B = B_, .T = T_ / P.cp(), .C = C, .V = cfg_.input_rows(),
                           .pos0 = pos0_, .positions = P.cp() > 1 ? P.positions(T_) : nullptr,
                           .vocab_begin = split ? P.vocab_begin(cfg_) : 0, .vocab_rows = split ? P.vocab_rows(cfg_) : 0});
}

int64_t Embedding::deferred_gradient_bytes(int64_t B, int64_t T) const {
  return par_->own_rows(B, T) * cfg_.n_embd * int64_t(esize());
}

void Embedding::backward_input(const void* dout) {
  LOOM_CHECK(out_.defined(), "embedding: backward_input before forward");
  dout_ = work(out_.shape());
  be_->copy({.dst = dout_.raw(), .dst_dtype = dt_, .src = dout, .src_dtype = dt_, .n = dout_.numel()});
}

void Embedding::backward_weight() {
  LOOM_CHECK(dout_.defined(), "embedding: backward_weight without backward_input");
  backward(dout_.raw());
  dout_ = Tensor();
}

// ---------------------------------------------------------------------------------------------
// TransformerBlock

TransformerBlock::TransformerBlock(const GPTConfig& cfg, int64_t layer, Backend& be, const BlockOptions& o)
    : ChainBlock(be, o), cfg_(cfg), layer_(layer) {
  ChainParallel& P = *par_;
  P.check(cfg, "model config '" + cfg.name + "'");
  // Order and names as Hugging Face GPT-2 (weights here in Linear layout [out, in]); the
  // LN1_W ... MLP_PROJ_B indices are model::BlockParam's (a config without biases has fewer
  // parameters: idx_ maps the roles to them). Under tp: c_attn and c_fc split by output rows
  // (column-parallel; c_attn's q, k and v each by heads, c_fc's SwiGLU gate and up each by
  // columns of F), the c_projs by input columns (row-parallel); norms and the c_proj biases whole
  // on every rank.
  const int64_t HS = cfg.head_size();
  const std::vector<ChainParallel::Section> qkv_sections = {
      {cfg.n_head, HS}, {cfg.kv_heads(), HS}, {cfg.kv_heads(), HS}};
  // c_fc's F columns (twice under SwiGLU: gate, then up), each split over tp as rows of one.
  const std::vector<ChainParallel::Section> fc_sections(cfg.mlp == Mlp::swiglu ? 2 : 1, {cfg.ffn(), 1});
  std::vector<ParamSpec> specs = block_param_specs(cfg, layer);
  params().reserve(specs.size());
  size_t next = 0;
  for (int i = 0; i < kBlockParams; ++i) {
    if (!block_param_present(cfg, BlockParam(i))) {
      idx_[i] = -1;
      continue;
    }
    ParamSpec spec = std::move(specs.at(next++));
    idx_[i] = int(params().size());
    switch (i) {
      case LN1_W: case LN1_B: case LN2_W: case LN2_B: add_param(P.whole(std::move(spec), true)); break;
      case QKV_W: case QKV_B: add_param(P.rows_split(std::move(spec), qkv_sections)); break;
      case FC_W: case FC_B: add_param(P.rows_split(std::move(spec), fc_sections)); break;
      case ATTN_PROJ_W: case MLP_PROJ_W: add_param(P.columns_split(std::move(spec))); break;
      default: add_param(P.whole(std::move(spec), false));  // the c_proj biases
    }
  }
  for (auto& q : params()) allocate_param(q);
  arena_ = nullptr;
  if (cfg.position == Position::rope)
    inv_freq_ = rope_inv_freq(HS, cfg.rope_theta,
                              {cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                               cfg.rope_original_max_position});
}

void TransformerBlock::rotate(void* qkv, int64_t B, int64_t T, int64_t pos0, bool inverse) {
  if (inv_freq_.empty()) return;
  ChainParallel& P = *par_;
  const int64_t HS = cfg_.head_size(), heads = cfg_.n_head / P.tp() + local_kv_heads(cfg_, P.tp());
  // The rank's query heads and key heads are adjacent in each row: one call rotates both.
  be_->rope({.dtype = dt_, .x = qkv, .B = B, .T = T / P.cp(), .NH = heads, .HS = HS,
             .stride = local_qkv_rows(cfg_, P.tp()), .pos0 = pos0, .positions = P.cp() > 1 ? P.positions(T) : nullptr,
             .inv_freq = inv_freq_.data(), .inverse = inverse});
}

std::unique_ptr<ChainBlock> TransformerBlock::replica(MemTag tag) const {
  return std::unique_ptr<ChainBlock>(new TransformerBlock(*this, tag));
}

AttnShape TransformerBlock::attention_shape(int64_t B, int64_t T) const {
  const ChainParallel& P = *par_;
  if (P.cp() > 1) return parallel::cp::RingAttention::chunk_shape(ring_shape(B, T), P.cp(), true);
  const int64_t Cl = cfg_.n_embd / P.tp(), Ql = local_qkv_rows(cfg_, P.tp());
  return {.B = B, .NH = cfg_.n_head / P.tp(), .HS = cfg_.head_size(), .Tq = T, .Tkv = T, .q_stride = Ql,
          .kv_stride = Ql, .o_stride = Cl, .NKV = local_kv_heads(cfg_, P.tp())};
}

parallel::cp::RingShape TransformerBlock::ring_shape(int64_t B, int64_t T) const {
  const ChainParallel& P = *par_;
  return {B, T, cfg_.n_head / P.tp(), cfg_.head_size(), local_kv_heads(cfg_, P.tp())};
}

int64_t TransformerBlock::attention_workspace_bytes(int64_t B, int64_t T, int threads) const {
  const ChainParallel& P = *par_;
  int64_t n = be_->attention_workspace_bytes(dt_, attention_shape(B, T), threads);
  // Ring attention's chunk pairs off the diagonal are calls without a mask.
  if (P.cp() > 1)
    n = std::max(n, be_->attention_workspace_bytes(
                        dt_, parallel::cp::RingAttention::chunk_shape(ring_shape(B, T), P.cp(), false), threads));
  return n;
}

// As forward and backward call them: c_attn and c_fc column-parallel, c_proj's row-parallel with
// the bias on tp rank 0 (every rank's without tp).
void TransformerBlock::linear_shapes(int64_t B, int64_t T, std::vector<LinearShape>& out) const {
  const ChainParallel& P = *par_;
  const int64_t C = cfg_.n_embd, Cl = C / P.tp(), N = P.rows(B, T);
  const int64_t Ql = local_qkv_rows(cfg_, P.tp()), FCl = cfg_.fc_rows() / P.tp(), Fl = cfg_.ffn() / P.tp();
  const bool row_bias = P.tp() == 1 || P.tp_rank() == 0;
  out.push_back({.M = N, .K = C, .N = Ql, .bias = idx_[QKV_B] >= 0});
  out.push_back({.M = N, .K = Cl, .N = C, .bias = row_bias && idx_[ATTN_PROJ_B] >= 0});
  out.push_back({.M = N, .K = C, .N = FCl, .bias = idx_[FC_B] >= 0});
  out.push_back({.M = N, .K = Fl, .N = C, .bias = row_bias && idx_[MLP_PROJ_B] >= 0});
}

std::vector<SavedActivation> TransformerBlock::saved_activations(int64_t B, int64_t T) const {
  const ChainParallel& P = *par_;
  const int64_t C = cfg_.n_embd, Cl = C / P.tp(), NHl = cfg_.n_head / P.tp(), Tl = T / P.cp();
  const int64_t Ql = local_qkv_rows(cfg_, P.tp()), FCl = cfg_.fc_rows() / P.tp(), Fl = cfg_.ffn() / P.tp();
  const std::string p = name() + ".";
  const DType f = DType::f32, a = dt_;
  // Per token, GPT-2: 16 C activations + 4 f32 statistics, plus n_head log-sum-exps; a T x T
  // attention matrix only where the backend's attention keeps one (the GEMM kernels). Under tp the
  // rank's heads and MLP columns; under sp the stream side (norms, residuals) of its own rows.
  // RMSNorm saves no means.
  const Shape st = P.sp_active() ? Shape{P.own_rows(B, T), C} : Shape{B, Tl, C};
  const Shape rows = P.sp_active() ? Shape{P.own_rows(B, T)} : Shape{B, Tl};
  std::vector<SavedActivation> v{{p + "ln1", a, st},           {p + "ln1_mean", f, rows},    {p + "ln1_rstd", f, rows},
                                 {p + "qkv", a, {B, Tl, Ql}},  {p + "atty", a, {B, Tl, Cl}}, {p + "lse", f, {B, NHl, Tl}},
                                 {p + "res2", a, st},          {p + "ln2", a, st},           {p + "ln2_mean", f, rows},
                                 {p + "ln2_rstd", f, rows},    {p + "fch", a, {B, Tl, FCl}}, {p + "fch_gelu", a, {B, Tl, Fl}},
                                 {p + "out", a, st}};
  // (Selective recomputation keeps neither atty nor lse: backward computes them again.)
  const bool rms = this->rms();
  v.erase(std::remove_if(v.begin(), v.end(),
                         [&](const SavedActivation& s) {
                           return (selective_ && (s.name.ends_with(".atty") || s.name.ends_with(".lse"))) ||
                                  (rms && s.name.ends_with("_mean"));
                         }),
          v.end());
  const int64_t probs = P.cp() > 1 ? 0 : be_->attention_probs_bytes(dt_, attention_shape(B, T));
  if (probs > 0) v.push_back({p + "probs", a, {B, NHl, T, T}});
  return v;
}

void TransformerBlock::release_activations() {
  a_ = Saved{};
  d_ = Deferred{};
  out_ = Tensor();
  B_ = T_ = 0;
}

void TransformerBlock::use_parameters_of(const TransformerBlock& other) {
  LOOM_CHECK(other.be_ == be_ && other.params().size() == params().size(), "{}: parameters of another model", name());
  shared_params_ = other.shared_params_;  // (a decoder's one replica, moved from layer to layer)
  layer_ = other.layer_;
  std::copy(std::begin(other.idx_), std::end(other.idx_), std::begin(idx_));
}

void TransformerBlock::drop_saved() {
  a_ = Saved{};
  d_ = Deferred{};
}

// The saved activations of [B, T] (after drop_saved only those missing).
void TransformerBlock::allocate(int64_t B, int64_t T, bool probs) {
  if (B == B_ && T == T_ && a_.ln1.defined()) return;  // (a forward without recomputation)
  if (B != B_ || T != T_) release_activations();
  for (const SavedActivation& s : saved_activations(B, T)) {
    if (s.name.ends_with(".probs") && !probs) continue;
    const std::string what = s.name.substr(s.name.rfind('.') + 1);
    Tensor* t = what == "ln1"        ? &a_.ln1
                : what == "ln1_mean" ? &a_.ln1_mean
                : what == "ln1_rstd" ? &a_.ln1_rstd
                : what == "qkv"      ? &a_.qkv
                : what == "atty"     ? &a_.atty
                : what == "lse"      ? &a_.lse
                : what == "res2"     ? &a_.res2
                : what == "ln2"      ? &a_.ln2
                : what == "ln2_mean" ? &a_.ln2_mean
                : what == "ln2_rstd" ? &a_.ln2_rstd
                : what == "fch"      ? &a_.fch
                : what == "fch_gelu" ? &a_.fch_gelu
                : what == "out"      ? &out_
                : what == "probs"    ? &a_.probs
                                     : nullptr;
    LOOM_CHECK(t, "{}: no buffer for saved activation '{}'", name(), s.name);
    if (!t->defined()) *t = act(s.shape, s.dtype);
  }
  B_ = B;
  T_ = T;
}

void TransformerBlock::attend_cached(const KVStep& kv) {
  const int64_t B = B_, T = T_, C = cfg_.n_embd, Q = cfg_.qkv_rows(), Ckv = cfg_.kv_heads() * cfg_.head_size();
  const int64_t pos = kv.pos;
  LOOM_CHECK(kv.k && kv.v && pos >= 0 && pos + T <= kv.t_max, "{}: cached positions [{}, {}) exceed the cache of {}",
             name(), pos, pos + T, kv.t_max);
  const int64_t es = int64_t(esize());
  auto* kc = static_cast<char*>(kv.k);
  auto* vc = static_cast<char*>(kv.v);
  // Append this call's keys and values (rotated keys with rotary positions) at positions
  // [pos, pos + T) of every sequence.
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const char* row = at(a_.qkv, (b * T + t) * Q);
      const int64_t dst = (b * kv.t_max + pos + t) * Ckv;
      be_->copy({.dst = kc + dst * es, .dst_dtype = dt_, .src = row + C * es, .src_dtype = dt_, .n = Ckv});
      be_->copy({.dst = vc + dst * es, .dst_dtype = dt_, .src = row + (C + Ckv) * es, .src_dtype = dt_, .n = Ckv});
    }
  // One sequence at a time: its T queries at positions [pos, pos + T) against its pos + T keys.
  const AttnShape s{.B = 1, .NH = cfg_.n_head, .HS = cfg_.head_size(), .Tq = T, .Tkv = pos + T, .q_stride = Q,
                    .kv_stride = Ckv, .o_stride = C, .q_pos0 = pos, .kv_pos0 = 0, .NKV = cfg_.kv_heads()};
  for (int64_t b = 0; b < B; ++b) {
    const char* q = at(a_.qkv, b * T * Q);
    be_->attention_forward({.dtype = dt_, .shape = s, .out = at(a_.atty, b * T * C), .lse = a_.lse.f32() + b * cfg_.n_head * T,
                            .q = q, .k = kc + b * kv.t_max * Ckv * es, .v = vc + b * kv.t_max * Ckv * es});
  }
}

// x may be out() itself (a decoder's residual stream in place): x is last read by the residual
// add before ln_2, and out is first written by the MLP's c_proj after it.
void TransformerBlock::forward(const void* x, int64_t B, int64_t T, const KVStep* kv) {
  ChainParallel& P = *par_;
  LOOM_CHECK(!kv || P.single(), "{}: cached decoding runs on one device (tp = cp = 1)", name());
  const int64_t C = cfg_.n_embd, Cl = C / P.tp(), N = P.rows(B, T), Ns = P.own_rows(B, T);
  const int64_t Ql = local_qkv_rows(cfg_, P.tp()), FCl = cfg_.fc_rows() / P.tp(), Fl = cfg_.ffn() / P.tp();
  allocate(B, T, /*probs=*/kv == nullptr);
  const bool rms = this->rms();
  be_->layernorm_forward({.dtype = dt_, .out = a_.ln1.raw(), .mean = rms ? nullptr : a_.ln1_mean.f32(),
                          .rstd = a_.ln1_rstd.f32(), .inp = x, .weight = w(LN1_W), .bias = w(LN1_B), .N = Ns, .C = C,
                          .eps = cfg_.ln_eps, .rms = rms});
  // c_attn, column-parallel: every token row (gathered under sp), this rank's heads; then the
  // rotary embedding of its queries and keys.
  be_->linear_forward({.dtype = dt_, .out = a_.qkv.raw(), .inp = P.gather(a_.ln1.raw(), N, C), .weight = w(QKV_W),
                       .bias = w(QKV_B), .M = N, .K = C, .N = Ql});
  rotate(a_.qkv.raw(), B, T, kv ? kv->pos : 0, false);
  // Selective recomputation: the attention's output and log-sum-exps live in workspace for the
  // c_proj below and are computed again in backward.
  Tensor atty = a_.atty, lse = a_.lse;
  if (kv) {
    attend_cached(*kv);
  } else {
    if (selective_) {
      atty = work({B, T / P.cp(), Cl});
      lse = Tensor::empty({B, cfg_.n_head / P.tp(), T / P.cp()}, DType::f32, MemTag::workspace, *pool_);
    }
    attend(atty, lse, B, T);
  }
  // c_proj, row-parallel: partial sums over tp (the bias added once, by tp rank 0), summed
  // (reduce-scattered to the own rows under sp). res2 = x + that, then ln_2 of it: one pass where
  // the backend fuses the residual add.
  const void* bias0 = P.tp_rank() == 0 ? w(ATTN_PROJ_B) : nullptr;
  void* part = P.sp_active() ? P.partial_buffer(N, C) : a_.res2.raw();
  be_->linear_forward({.dtype = dt_, .out = part, .inp = atty.raw(), .weight = w(ATTN_PROJ_W), .bias = bias0,
                       .M = N, .K = Cl, .N = C});
  P.reduce(part, a_.res2.raw(), N, C);
  be_->layernorm_forward({.dtype = dt_, .out = a_.ln2.raw(), .mean = rms ? nullptr : a_.ln2_mean.f32(),
                          .rstd = a_.ln2_rstd.f32(), .inp = a_.res2.raw(), .residual_b = x,
                          .residual_out = a_.res2.raw(), .weight = w(LN2_W), .bias = w(LN2_B), .N = Ns, .C = C,
                          .eps = cfg_.ln_eps, .rms = rms});
  if (cfg_.mlp == Mlp::swiglu) {
    be_->linear_forward({.dtype = dt_, .out = a_.fch.raw(), .inp = P.gather(a_.ln2.raw(), N, C), .weight = w(FC_W),
                         .bias = w(FC_B), .M = N, .K = C, .N = FCl});
    be_->swiglu_forward(dt_, a_.fch_gelu.raw(), a_.fch.raw(), N, Fl);
  } else {
    be_->linear_forward({.dtype = dt_, .out = a_.fch_gelu.raw(), .pre_gelu = a_.fch.raw(),
                         .inp = P.gather(a_.ln2.raw(), N, C), .weight = w(FC_W), .bias = w(FC_B), .M = N, .K = C,
                         .N = FCl, .gelu = true});
  }
  if (P.tp() == 1) {
    // out = res2 + c_proj(fch_gelu): the residual add in the GEMM where the backend fuses it.
    be_->linear_forward({.dtype = dt_, .out = out_.raw(), .inp = a_.fch_gelu.raw(), .weight = w(MLP_PROJ_W),
                         .bias = w(MLP_PROJ_B), .M = N, .K = Fl, .N = C, .residual = a_.res2.raw()});
    return;
  }
  part = P.sp_active() ? P.partial_buffer(N, C) : out_.raw();
  be_->linear_forward({.dtype = dt_, .out = part, .inp = a_.fch_gelu.raw(), .weight = w(MLP_PROJ_W),
                       .bias = P.tp_rank() == 0 ? w(MLP_PROJ_B) : nullptr, .M = N, .K = Fl, .N = C});
  P.reduce(part, out_.raw(), N, C);
  be_->add(dt_, out_.raw(), out_.raw(), a_.res2.raw(), Ns * C);
}

// The attention of a training step from the saved qkv into out and lse (ring attention under cp).
void TransformerBlock::attend(const Tensor& out, const Tensor& lse, int64_t B, int64_t T) {
  ChainParallel& P = *par_;
  const int64_t HS = cfg_.head_size(), NHl = cfg_.n_head / P.tp(), NKVl = local_kv_heads(cfg_, P.tp());
  const int64_t es = int64_t(esize());
  if (P.cp() > 1) {
    P.ring().forward(*P.cp_group(), out.raw(), lse.f32(), a_.qkv.raw(), ring_shape(B, T));
    return;
  }
  const char* qkv = at(a_.qkv, 0);
  be_->attention_forward({.dtype = dt_, .shape = attention_shape(B, T), .out = out.raw(), .lse = lse.f32(),
                          .probs = a_.probs.defined() ? a_.probs.raw() : nullptr, .q = qkv,
                          .k = qkv + NHl * HS * es, .v = qkv + (NHl + NKVl) * HS * es});
}

void TransformerBlock::set_selective(bool on) {
  LOOM_CHECK(!on || be_->attention_probs_bytes(dt_, attention_shape(1, 2 * par_->cp())) == 0,
             "{}: selective recomputation needs an attention kernel that keeps no probabilities", name());
  release_activations();
  selective_ = on;
}

void TransformerBlock::backward(const void* x, const BackwardScratch& s) {
  LOOM_CHECK(out_.defined(), "{}: backward before forward", name());
  run_backward(x, s, false);
}

int64_t TransformerBlock::deferred_gradient_bytes(int64_t B, int64_t T) const {
  const ChainParallel& P = *par_;
  const int64_t C = cfg_.n_embd, Cl = C / P.tp(), Ql = local_qkv_rows(cfg_, P.tp()), FCl = cfg_.fc_rows() / P.tp();
  // dout C + dfch FCl + dres2 C + dqkv Ql (+ atty Cl under selective recomputation)
  return P.rows(B, T) * (2 * C + FCl + Ql + (selective_ ? Cl : 0)) * int64_t(esize());
}

void TransformerBlock::backward_input(const void* x, const BackwardScratch& s) {
  LOOM_CHECK(out_.defined(), "{}: backward_input before forward", name());
  LOOM_CHECK(!d_.dout.defined(), "{}: backward_input twice without backward_weight", name());
  run_backward(x, s, true);
}

// The backward, or (defer) its input-gradient part with the weight GEMMs and bias sums moved to
// backward_weight: each gradient is produced by the same operations on the same values.
void TransformerBlock::run_backward(const void* x, const BackwardScratch& s, bool defer) {
  ChainParallel& P = *par_;
  const int64_t C = cfg_.n_embd, Cl = C / P.tp(), B = B_, T = T_, N = P.rows(B, T), Ns = P.own_rows(B, T);
  const int64_t HS = cfg_.head_size(), NHl = cfg_.n_head / P.tp(), NKVl = local_kv_heads(cfg_, P.tp());
  const int64_t Ql = local_qkv_rows(cfg_, P.tp()), FCl = cfg_.fc_rows() / P.tp(), Fl = cfg_.ffn() / P.tp();
  const int64_t es = int64_t(esize());
  const bool rms = this->rms(), swiglu = cfg_.mlp == Mlp::swiglu;
  if (defer) {
    d_.dout = work({N, C});
    d_.dfch = work({N, FCl});
    d_.dres2 = work({N, C});
    d_.dqkv = work({N, Ql});
  }
  auto keep = [&](Tensor& dst, const void* src) {
    be_->copy({.dst = dst.raw(), .dst_dtype = dt_, .src = src, .src_dtype = dt_, .n = dst.numel()});
  };
  auto wg = [&](int i) { return defer ? nullptr : g(i); };  // a weight or bias gradient computed now
  // Selective recomputation: the attention's output and log-sum-exps again, from the saved qkv.
  Tensor atty = a_.atty, lse = a_.lse;
  if (selective_) {
    atty = work({B, T / P.cp(), Cl});
    lse = Tensor::empty({B, cfg_.n_head / P.tp(), T / P.cp()}, DType::f32, MemTag::workspace, *pool_);
    attend(atty, lse, B, T);
    if (defer) d_.atty = atty;  // for the deferred c_proj weight gradient
  }
  const char* qkv = at(a_.qkv, 0);
  char* dqkv = defer ? at(d_.dqkv, 0) : static_cast<char*>(s.buf4C);  // [N, Ql] (in the wide buffer)

  // MLP branch; s.dres = d(out) = d(res2) through the residual. The output gradient of the
  // row-parallel c_proj is every token row's (gathered under sp). Its backward also goes back
  // through the GELU or the SwiGLU (into d(fch)).
  const void* dout = P.gather(s.dres, N, C);
  if (defer) keep(d_.dout, dout);
  void* dfch = defer ? d_.dfch.raw() : s.buf4C;  // [N, FCl]
  if (swiglu) {
    // d(c_proj input) [N, Fl] beside d(fch) in the wide buffer, then back through the SwiGLU.
    void* dact = static_cast<char*>(s.buf4C) + N * FCl * es;
    be_->linear_backward({.dtype = dt_, .dinp = dact, .dweight = wg(MLP_PROJ_W), .dbias = wg(MLP_PROJ_B), .dout = dout,
                          .inp = defer ? nullptr : a_.fch_gelu.raw(), .weight = w(MLP_PROJ_W), .M = N, .K = Fl, .N = C});
    be_->swiglu_backward(dt_, dfch, dact, a_.fch.raw(), N, Fl);
  } else if (defer) {
    be_->linear_backward({.dtype = dt_, .dinp = s.buf4C, .dout = dout, .weight = w(MLP_PROJ_W), .M = N, .K = Fl, .N = C});
    be_->gelu_backward(dt_, d_.dfch.raw(), a_.fch.raw(), s.buf4C, N * Fl);
  } else {
    be_->linear_backward({.dtype = dt_, .dinp = s.buf4C, .dweight = g(MLP_PROJ_W), .dbias = g(MLP_PROJ_B), .dout = dout,
                          .inp = a_.fch_gelu.raw(), .weight = w(MLP_PROJ_W), .gelu_pre = a_.fch.raw(), .M = N,
                          .K = Fl, .N = C});
  }
  // c_fc, column-parallel: its input gradient is a partial sum over tp.
  be_->linear_backward({.dtype = dt_, .dinp = s.bufC, .dweight = wg(FC_W), .dbias = wg(FC_B), .dout = dfch,
                        .inp = defer ? nullptr : P.gather(a_.ln2.raw(), N, C), .weight = w(FC_W), .M = N, .K = C,
                        .N = FCl});
  be_->layernorm_backward({.dtype = dt_, .dinp = s.dres, .accumulate = true, .dweight = g(LN2_W), .dbias = g(LN2_B),
                           .dout = P.reduce_input_grad(s.bufC, N, C), .inp = a_.res2.raw(), .weight = w(LN2_W),
                           .mean = rms ? nullptr : a_.ln2_mean.f32(), .rstd = a_.ln2_rstd.f32(), .N = Ns, .C = C,
                           .rms = rms});
  // Attention branch; s.dres = d(res2) = d(x) through the residual.
  dout = P.gather(s.dres, N, C);
  if (defer) keep(d_.dres2, dout);
  be_->linear_backward({.dtype = dt_, .dinp = s.bufC, .dweight = wg(ATTN_PROJ_W), .dbias = wg(ATTN_PROJ_B), .dout = dout,
                        .inp = atty.raw(), .weight = w(ATTN_PROJ_W), .M = N, .K = Cl, .N = C});
  const int64_t ko = NHl * HS * es, vo = (NHl + NKVl) * HS * es;  // byte offsets of k and v in a row
  if (P.cp() > 1) {
    P.ring().backward(*P.cp_group(), dqkv, s.bufC, a_.qkv.raw(), atty.raw(), lse.f32(), ring_shape(B, T));
  } else {
    be_->attention_backward({.dtype = dt_, .shape = attention_shape(B, T), .dq = dqkv, .dk = dqkv + ko, .dv = dqkv + vo,
                             .dout = s.bufC, .q = qkv, .k = qkv + ko, .v = qkv + vo, .out = atty.raw(),
                             .lse = lse.f32(), .probs = a_.probs.defined() ? a_.probs.raw() : nullptr});
  }
  // The gradients of the rotated queries and keys, rotated back: those of c_attn's outputs.
  rotate(dqkv, B, T, 0, true);
  be_->linear_backward({.dtype = dt_, .dinp = s.bufC, .dweight = wg(QKV_W), .dbias = wg(QKV_B), .dout = dqkv,
                        .inp = defer ? nullptr : P.gather(a_.ln1.raw(), N, C), .weight = w(QKV_W), .M = N, .K = C,
                        .N = Ql});
  be_->layernorm_backward({.dtype = dt_, .dinp = s.dres, .accumulate = true, .dweight = g(LN1_W), .dbias = g(LN1_B),
                           .dout = P.reduce_input_grad(s.bufC, N, C), .inp = x, .weight = w(LN1_W),
                           .mean = rms ? nullptr : a_.ln1_mean.f32(), .rstd = a_.ln1_rstd.f32(), .N = Ns, .C = C,
                           .rms = rms});
}

std::vector<Parameter*> TransformerBlock::input_pass_parameters() {
  std::vector<Parameter*> out;
  for (int i : {LN1_W, LN1_B, LN2_W, LN2_B})
    if (idx_[i] >= 0) out.push_back(&params()[size_t(idx_[i])]);
  return out;
}

void TransformerBlock::backward_weight() {
  LOOM_CHECK(d_.dout.defined(), "{}: backward_weight without backward_input", name());
  ChainParallel& P = *par_;
  const int64_t C = cfg_.n_embd, Cl = C / P.tp(), N = P.rows(B_, T_);
  const int64_t Ql = local_qkv_rows(cfg_, P.tp()), FCl = cfg_.fc_rows() / P.tp(), Fl = cfg_.ffn() / P.tp();
  be_->linear_backward({.dtype = dt_, .dweight = g(MLP_PROJ_W), .dbias = g(MLP_PROJ_B), .dout = d_.dout.raw(),
                        .inp = a_.fch_gelu.raw(), .M = N, .K = Fl, .N = C});
  be_->linear_backward({.dtype = dt_, .dweight = g(FC_W), .dbias = g(FC_B), .dout = d_.dfch.raw(),
                        .inp = P.gather(a_.ln2.raw(), N, C), .M = N, .K = C, .N = FCl});
  be_->linear_backward({.dtype = dt_, .dweight = g(ATTN_PROJ_W), .dbias = g(ATTN_PROJ_B), .dout = d_.dres2.raw(),
                        .inp = (selective_ ? d_.atty : a_.atty).raw(), .M = N, .K = Cl, .N = C});
  be_->linear_backward({.dtype = dt_, .dweight = g(QKV_W), .dbias = g(QKV_B), .dout = d_.dqkv.raw(),
                        .inp = P.gather(a_.ln1.raw(), N, C), .M = N, .K = C, .N = Ql});
  d_ = Deferred{};
}

// ---------------------------------------------------------------------------------------------
// Head

Head::Head(const GPTConfig& cfg, Parameter* tied, Backend& be, const BlockOptions& o)
    : ChainBlock(be, o), cfg_(cfg), lm_head_(tied) {
  const ChainParallel& P = *par_;
  std::vector<ParamSpec> specs = head_param_specs(cfg);
  params().reserve(specs.size());
  allocate_param(add_param(P.whole(specs[0], true)));
  if (cfg.norm == Norm::layernorm) allocate_param(add_param(P.whole(specs[1], true)));
  if (!cfg.tied_embeddings) {
    allocate_param(add_param(P.vocab_split(specs.back(), cfg)));
    lm_head_ = &params().back();
  }
  arena_ = nullptr;
  LOOM_CHECK(lm_head_ != nullptr, "head: tied embeddings need the wte parameter");
  const int64_t rows = std::max(lm_head_->spec.alloc_rows, lm_head_->spec.shape.at(0));
  LOOM_CHECK(rows == P.vocab_rows(cfg), "head: lm_head has {} rows, expected {}", rows, P.vocab_rows(cfg));
}

std::unique_ptr<ChainBlock> Head::replica(MemTag tag) const { return std::unique_ptr<ChainBlock>(new Head(*this, tag)); }

// lm_head: every token row, the rank's vocabulary columns, no bias.
void Head::linear_shapes(int64_t B, int64_t T, std::vector<LinearShape>& out) const {
  const ChainParallel& P = *par_;
  out.push_back({.M = P.rows(B, T), .K = cfg_.n_embd, .N = P.vocab_rows(cfg_)});
}

std::vector<SavedActivation> Head::saved_activations(int64_t B, int64_t T) const {
  const ChainParallel& P = *par_;
  const DType f = DType::f32;
  const int64_t C = cfg_.n_embd, Tl = T / P.cp();
  const Shape st = P.sp_active() ? Shape{P.own_rows(B, T), C} : Shape{B, Tl, C};
  const Shape rows = P.sp_active() ? Shape{P.own_rows(B, T)} : Shape{B, Tl};
  // The logits buffer holds dlogits after the fused loss, so there is one [B, T, Vp] buffer (the
  // rank's vocabulary columns under tp). RMSNorm saves no means.
  std::vector<SavedActivation> v = {{"head.lnf", dt_, st}, {"head.lnf_mean", f, rows}, {"head.lnf_rstd", f, rows},
                                    {"head.logits", dt_, {B, Tl, P.vocab_rows(cfg_)}}, {"head.losses", f, {B, Tl}},
                                    {"head.targets", DType::i32, {B, Tl}}};
  if (cfg_.norm == Norm::rmsnorm) v.erase(v.begin() + 1);
  return v;
}

void Head::release_activations() {
  lnf_ = lnf_mean_ = lnf_rstd_ = logits_ = losses_ = targets_ = Tensor();
  B_ = T_ = 0;
  has_targets_ = holds_dlogits_ = weight_pending_ = false;
}

void Head::loss(bool with_dlogits, float dloss) {
  ChainParallel& P = *par_;
  const int64_t N = P.rows(B_, T_);
  if (P.tp() == 1) {
    be_->crossentropy({.dtype = dt_, .losses = losses_.f32(), .dlogits = with_dlogits ? logits_.raw() : nullptr,
                       .logits = logits_.raw(), .targets = targets_.i32(), .dloss = dloss, .N = N,
                       .V = cfg_.vocab_size, .Vp = P.vocab_rows(cfg_)});
    return;
  }
  // The rows' max, sum of exponentials and target logit reduced over tp: no rank holds whole rows.
  parallel::tp::vocab_cross_entropy(P.tp_group(), *be_, losses_.f32(), with_dlogits ? logits_.raw() : nullptr,
                                    logits_.raw(), targets_.i32(), P.loss_statistics(N),
                                    {.dtype = dt_, .N = N, .Vs = P.vocab_rows(cfg_), .v0 = P.vocab_begin(cfg_),
                                     .V = cfg_.vocab_size, .dloss = dloss});
}

double Head::forward(const void* x, const int32_t* targets, int64_t B, int64_t T, bool fuse_backward,
                     float dloss_scale, const DeviceTargets* dev) {
  ChainParallel& P = *par_;
  const int64_t C = cfg_.n_embd, V = cfg_.vocab_size, Vs = P.vocab_rows(cfg_), N = P.rows(B, T), Ns = P.own_rows(B, T);
  LOOM_CHECK(!dev || P.single(), "head: a device batch runs on one device (tp = cp = 1)");
  if (B != B_ || T != T_) {
    release_activations();
    for (const SavedActivation& a : saved_activations(B, T)) {
      Tensor* t = a.name == "head.lnf"        ? &lnf_
                  : a.name == "head.lnf_mean" ? &lnf_mean_
                  : a.name == "head.lnf_rstd" ? &lnf_rstd_
                  : a.name == "head.logits"   ? &logits_
                  : a.name == "head.losses"   ? &losses_
                                              : &targets_;
      *t = act(a.shape, a.dtype);
    }
    B_ = B;
    T_ = T;
  }
  be_->layernorm_forward({.dtype = dt_, .out = lnf_.raw(), .mean = lnf_mean_.defined() ? lnf_mean_.f32() : nullptr,
                          .rstd = lnf_rstd_.f32(), .inp = x, .weight = params()[0].weights().raw(), .bias = norm_bias(),
                          .N = Ns, .C = C, .eps = cfg_.ln_eps, .rms = cfg_.norm == Norm::rmsnorm});
  // lm_head, column-parallel over the vocabulary: every token row, the rank's vocabulary columns.
  be_->linear_forward({.dtype = dt_, .out = logits_.raw(), .inp = P.gather(lnf_.raw(), N, C),
                       .weight = lm_head_->weights_full().raw(), .M = N, .K = C, .N = Vs});
  holds_dlogits_ = false;
  has_targets_ = targets != nullptr;
  counted_ = 0;
  if (!has_targets_) return std::numeric_limits<double>::quiet_NaN();

  if (dev) {
    counted_ = dev->counted;
  } else {
    for (int64_t i = 0; i < B * T; ++i) {
      LOOM_CHECK(targets[i] >= -1 && targets[i] < V, "head: target {} at index {} is outside [-1, {})", targets[i], i, V);
      counted_ += targets[i] >= 0;  // the whole sequence's (every cp rank's) count
    }
  }
  if (P.cp() > 1) {
    LOOM_CHECK(!dev, "head: under context parallelism the targets come from host memory");
    P.slice_sequence(targets, targets_.i32(), B, T);
  } else {
    be_->copy({.dst = targets_.raw(), .dst_dtype = DType::i32, .src = targets, .src_dtype = DType::i32,
               .src_host = dev == nullptr, .n = N});
  }
  const float dloss = counted_ ? dloss_scale / float(counted_) : 0.0f;
  loss(fuse_backward, dloss);
  holds_dlogits_ = fuse_backward;
  if (dev) {
    LOOM_CHECK(dev->loss_out, "head: a device batch needs loss_out");
    be_->sum(losses_.f32(), N, counted_ ? 1.0f / float(counted_) : 0.0f, dev->loss_out);
    return std::numeric_limits<double>::quiet_NaN();
  }
  std::vector<float> host;
  const float* losses = losses_.f32();
  if (losses_.device() != Device::cpu) {
    host.resize(size_t(N));
    be_->download(host.data(), losses_.raw(), DType::f32, N);
    losses = host.data();
  }
  double sum = 0;
  for (int64_t i = 0; i < N; ++i) sum += losses[i];
  if (P.cp() > 1) {  // the sum over the whole sequence
    float s = float(sum);
    P.cp_host_group()->all_reduce(&s, 1, DType::f32);
    sum = s;
  }
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
  ChainParallel& P = *par_;
  const int64_t C = cfg_.n_embd, N = P.rows(B_, T_), Ns = P.own_rows(B_, T_);
  if (!holds_dlogits_) {
    loss(true, counted_ ? dloss_scale / float(counted_) : 0.0f);
    holds_dlogits_ = true;
  }
  be_->linear_backward({.dtype = dt_, .dinp = s.bufC, .dout = logits_.raw(), .weight = lm_head_->weights_full().raw(),
                        .M = N, .K = C, .N = P.vocab_rows(cfg_)});
  be_->layernorm_backward({.dtype = dt_, .dinp = s.dres, .dweight = params()[0].grad.f32(), .dbias = norm_bias_grad(),
                           .dout = P.reduce_input_grad(s.bufC, N, C), .inp = x, .weight = params()[0].weights().raw(),
                           .mean = lnf_mean_.defined() ? lnf_mean_.f32() : nullptr, .rstd = lnf_rstd_.f32(), .N = Ns,
                           .C = C, .rms = cfg_.norm == Norm::rmsnorm});
  weight_pending_ = true;
}

std::vector<Parameter*> Head::input_pass_parameters() {
  std::vector<Parameter*> out{&params()[0]};  // the final norm's weight, and its bias with LayerNorm
  if (cfg_.norm == Norm::layernorm) out.push_back(&params()[1]);
  return out;
}

void Head::backward_weight() {
  LOOM_CHECK(weight_pending_, "head: backward_weight without backward_input");
  ChainParallel& P = *par_;
  const int64_t C = cfg_.n_embd, N = P.rows(B_, T_);
  be_->linear_backward({.dtype = dt_, .dweight = lm_head_->grad_full.f32(), .dout = logits_.raw(),
                        .inp = P.gather(lnf_.raw(), N, C), .M = N, .K = C, .N = P.vocab_rows(cfg_)});
  weight_pending_ = false;
}

const Tensor& Head::logits() const {
  LOOM_CHECK(logits_.defined() && !holds_dlogits_,
             "head: logits are not available (no forward yet, or the buffer now holds dlogits)");
  return logits_;
}

ChainMemory chain_memory(const std::vector<ChainBlock*>& blocks, int64_t B, int64_t T) {
  ChainMemory c;
  for (const ChainBlock* b : blocks) {
    if (!dynamic_cast<const TransformerBlock*>(b)) {
      c.fixed += double(b->saved_activation_bytes(B, T));
      continue;
    }
    c.full.push_back(double(b->saved_activation_bytes(B, T)));
    double out = 0;
    for (const SavedActivation& a : b->saved_activations(B, T))
      if (a.name.ends_with(".out")) out = double(a.bytes());
    c.out.push_back(out);
    c.forward.push_back(1.0);
  }
  return c;
}

}  // namespace loom::model

#include "model/tp_gpt.h"
#include "model/param_specs.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/residual.h"
#include "parallel/context/ring_attention.h"
#include "parallel/tensor/mappings.h"
#include "parallel/tensor/vocab_parallel.h"

namespace loom::model {

namespace {
constexpr int64_t F = sizeof(float);
constexpr int64_t I = sizeof(int32_t);
namespace tpm = parallel::tp;

enum : int {
  LN1_W = kLn1W, LN1_B = kLn1B, QKV_W = kQkvW, QKV_B = kQkvB, ATTN_PROJ_W = kAttnProjW, ATTN_PROJ_B = kAttnProjB,
  LN2_W = kLn2W, LN2_B = kLn2B, FC_W = kFcW, FC_B = kFcB, MLP_PROJ_W = kMlpProjW, MLP_PROJ_B = kMlpProjB
};

// Shard builders: the local shape and where it lies in the full tensor.
std::unique_ptr<ShardedParameter> make_shard(ParamSpec global, Shape local, std::vector<ShardSegment> segs,
                                             bool replicated, bool sp_partial) {
  auto p = std::make_unique<ShardedParameter>();
  p->shard.spec = global;
  p->shard.spec.shape = local;
  p->shard.spec.alloc_rows = local.empty() ? 0 : local[0];
  p->global = std::move(global);
  p->segments = std::move(segs);
  p->replicated = replicated;
  p->sp_partial = sp_partial;
  return p;
}

std::unique_ptr<ShardedParameter> replicated(ParamSpec spec, bool sp_partial) {
  Shape s = spec.shape;
  const int64_t n = spec.numel();
  return make_shard(std::move(spec), s, {{0, 0, n}}, true, sp_partial);
}

// Rows of `sections` equal sections (q | k | v for c_attn), each split over t ranks.
std::unique_ptr<ShardedParameter> row_shard(ParamSpec spec, int sections, int t, int r) {
  const int64_t R = spec.shape[0], K = spec.shape.size() > 1 ? spec.shape[1] : 1;
  const int64_t Rs = R / sections, Rl = Rs / t;
  std::vector<ShardSegment> segs;
  for (int s = 0; s < sections; ++s) segs.push_back({s * Rl * K, (s * Rs + r * Rl) * K, Rl * K});
  Shape local = spec.shape;
  local[0] = sections * Rl;
  return make_shard(std::move(spec), local, std::move(segs), false, false);
}

// Columns (the input dimension of a Linear weight [out, in]) split over t ranks.
std::unique_ptr<ShardedParameter> col_shard(ParamSpec spec, int t, int r) {
  const int64_t R = spec.shape[0], K = spec.shape[1], Kl = K / t;
  std::vector<ShardSegment> segs;
  for (int64_t i = 0; i < R; ++i) segs.push_back({i * Kl, i * K + r * Kl, Kl});
  return make_shard(std::move(spec), {R, Kl}, std::move(segs), false, false);
}

// Vocabulary rows [r Vs, (r + 1) Vs) of a [V, C] table; rows >= V are zero padding.
std::unique_ptr<ShardedParameter> vocab_shard(ParamSpec spec, int64_t Vs, int r) {
  const int64_t V = spec.shape[0], C = spec.shape[1];
  const int64_t v0 = r * Vs, real = std::clamp<int64_t>(V - v0, 0, Vs);
  std::vector<ShardSegment> segs;
  if (real > 0) segs.push_back({0, v0 * C, real * C});
  return make_shard(std::move(spec), {Vs, C}, std::move(segs), false, false);
}

Tensor act(const Shape& s, DType t, MemoryPool& pool) { return Tensor::empty(s, t, MemTag::activations, pool); }

// rows f32 [n, C] += bias f32 [C]
void add_bias(float* rows, const float* bias, int64_t n, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < C; ++c) rows[i * C + c] += bias[c];
}
}  // namespace

// The parameters, shared by a stage's replicas.
struct ParallelGPT::Weights {
  std::vector<std::unique_ptr<ShardedParameter>> sharded;
  std::vector<Parameter*> list;
  ShardedParameter *wte = nullptr, *wpe = nullptr, *lnf_w = nullptr, *lnf_b = nullptr, *lm_head = nullptr;
  std::vector<std::array<ShardedParameter*, 12>> layers;  // the stage's blocks, in order
};

// The scratch of one forward or backward call: two [N, C] buffers, [N, 4 Cl], [N, Cl], the
// cross-entropy statistics [3N] and the residual-stream gradient [Ns, C] (tag workspace). A model
// and its replicas share one (a rank runs one of them at a time), so a pipeline stage takes it
// once, not once per micro-batch; each model's Impl holds handles to the buffers it uses.
struct ParallelGPT::Scratch {
  int64_t N = -1, Ns = -1;
  Tensor wA, wB, buf4, datty, ce, dres;
  // rows: the micro-batch's rows N, own: the rows of the residual stream this rank holds (Ns).
  void forward(MemoryPool& pool, int64_t rows, int64_t own, int64_t C, bool head) {
    if (rows != N || own != Ns) {
      *this = Scratch{};
      N = rows, Ns = own;
      wA = Tensor::empty({N, C}, DType::f32, MemTag::workspace, pool);
      wB = Tensor::empty({N, C}, DType::f32, MemTag::workspace, pool);
    }
    if (head && !ce.defined()) ce = Tensor::empty({3 * N}, DType::f32, MemTag::workspace, pool);
  }
  // A model keeps handles to its forward's buffers, so a shape change in between only re-sizes
  // the shared ones.
  void backward(MemoryPool& pool, int64_t rows, int64_t own, int64_t C, int64_t Cl) {
    if (rows != N || own != Ns) forward(pool, rows, own, C, false);
    if (buf4.defined()) return;
    buf4 = Tensor::empty({N, 4 * Cl}, DType::f32, MemTag::workspace, pool);
    datty = Tensor::empty({N, Cl}, DType::f32, MemTag::workspace, pool);
    dres = Tensor::empty({Ns, C}, DType::f32, MemTag::workspace, pool);
  }
};

struct ParallelGPT::Impl {
  struct Layer {
    ShardedParameter* p[12] = {};
    Tensor ln1, ln1_mean, ln1_rstd;  // f32 [Ns, C], [Ns], [Ns]
    Tensor qkv;                      // f32 [N, 3 Cl] this rank's heads
    Tensor atty;                     // f32 [N, Cl]
    Tensor lse;                      // f32 [B, NHl, Tl] (cp: [B, 2, NHl, Tc])
    Tensor res2;                     // f32 [Ns, C]
    Tensor ln2, ln2_mean, ln2_rstd;  // f32 [Ns, C], [Ns], [Ns]
    Tensor fch, fch_gelu;            // f32 [N, 4 Cl]
    Tensor out;                      // f32 [Ns, C]
    float* w(int i) const { return p[i]->shard.value.f32(); }
    float* g(int i) const { return p[i]->shard.grad.f32(); }
  };
  // A weight gradient deferred by backward_stage(..., input_only): dW (+)= dout^T inp, db += sums.
  struct DeferredGemm {
    float *dW = nullptr, *db = nullptr;
    const float *dout = nullptr, *inp = nullptr;  // into the tensors below or saved activations
    Tensor dout_copy, inp_copy;                   // f32, tag workspace, when the source is transient
    int64_t M = 0, K = 0, N = 0;
  };
  explicit Impl(const Weights& w) {
    wte = w.wte, wpe = w.wpe, lnf_w = w.lnf_w, lnf_b = w.lnf_b, lm_head = w.lm_head;
    layers.resize(w.layers.size());
    for (size_t l = 0; l < layers.size(); ++l)
      for (int i = 0; i < 12; ++i) layers[l].p[i] = w.layers[l][size_t(i)];
  }

  ShardedParameter *wte = nullptr, *wpe = nullptr, *lnf_w = nullptr, *lnf_b = nullptr, *lm_head = nullptr;
  std::vector<Layer> layers;
  const float* x0 = nullptr;         // f32 [Ns, C] the first block's input (emb_out or the stage input)
  std::vector<DeferredGemm> deferred;
  Tensor def_dres, def_dfull;        // the embedding's deferred output gradient: own rows, all rows
  // Shapes of the last forward: B, T (global), Tl = T / cp, N = B Tl rows, own rows [r0, r0 + Ns).
  int64_t B = 0, T = 0, Tl = 0, N = 0, Ns = 0, r0 = 0;
  Tensor tokens;                     // i32 [N] this rank's positions
  Tensor emb_out;                    // f32 [Ns, C]
  Tensor lnf, lnf_mean, lnf_rstd;    // f32 [Ns, C], [Ns], [Ns]
  Tensor logits;                     // f32 [N, Vs] (dlogits after the fused forward)
  Tensor losses;                     // f32 [N]
  Tensor targets;                    // i32 [N]
  bool holds_dlogits = false, can_backward = false;
  float dloss = 0;
  // Workspace (tag workspace): handles to the shared scratch's buffers (Scratch).
  Tensor wA, wB, buf4, datty, dres, ce;
};

ParallelGPT::ParallelGPT(const GPTConfig& cfg, ParallelGroups groups, ParallelOptions opts, MemoryPool& pool,
                         uint64_t seed)
    : cfg_(cfg), g_(groups), opts_(opts), pool_(pool), w_(std::make_shared<Weights>()),
      scratch_(std::make_shared<Scratch>()) {
  cfg_.validate("model config '" + cfg_.name + "'");
  const int64_t n_el = cfg_.n_layer + 2;
  first_ = opts_.first;
  last_ = opts_.last < 0 ? n_el : opts_.last;
  if (first_ < 0 || first_ >= last_ || last_ > n_el)
    throw Error(fmt::format("model config '{}': pipeline stage [{}, {}) is not a non-empty range of the {} chain "
                            "elements (embedding, {} blocks, head)",
                            cfg_.name, opts_.first, opts_.last, n_el, cfg_.n_layer));
  tp_ = tpm::group_size(g_.tp);
  tpr_ = tpm::group_rank(g_.tp);
  cp_ = tpm::group_size(g_.cp);
  cpr_ = tpm::group_rank(g_.cp);
  if (cfg_.n_head % tp_ != 0)
    throw Error(fmt::format("model config '{}': n_head = {} is not divisible by tp = {} (attention is split by "
                            "heads; choose tp dividing the head count)",
                            cfg_.name, cfg_.n_head, tp_));
  if (opts_.activation_budget < 0)
    throw Error(fmt::format("parallel options: activation_budget = {} must be >= 0", opts_.activation_budget));
  Vs_ = tpm::vocab_shard_rows(cfg_.padded_vocab(), tp_);
  const bool sp = opts_.sp;
  auto add = [&](std::unique_ptr<ShardedParameter> p) {
    p->shard.allocate(pool_);
    w_->sharded.push_back(std::move(p));
    return w_->sharded.back().get();
  };
  Weights& m = *w_;
  // The full tensors are the single-device model's (model/param_specs.h); each is replicated or
  // split over tp by its role.
  const std::vector<ParamSpec> emb = embedding_param_specs(cfg_), head = head_param_specs(cfg_);
  const ParamSpec& wte_spec = emb[0];
  if (has_embedding()) {
    m.wte = add(vocab_shard(wte_spec, Vs_, tpr_));
    m.wpe = add(replicated(emb[1], sp));
  }
  for (int64_t l = std::max<int64_t>(first_, 1) - 1; l < std::min<int64_t>(last_, cfg_.n_layer + 1) - 1; ++l) {
    const std::vector<ParamSpec> b = block_param_specs(cfg_, l);
    auto& L = m.layers.emplace_back();
    L[LN1_W] = add(replicated(b[kLn1W], sp));
    L[LN1_B] = add(replicated(b[kLn1B], sp));
    L[QKV_W] = add(row_shard(b[kQkvW], 3, tp_, tpr_));
    L[QKV_B] = add(row_shard(b[kQkvB], 3, tp_, tpr_));
    L[ATTN_PROJ_W] = add(col_shard(b[kAttnProjW], tp_, tpr_));
    L[ATTN_PROJ_B] = add(replicated(b[kAttnProjB], false));
    L[LN2_W] = add(replicated(b[kLn2W], sp));
    L[LN2_B] = add(replicated(b[kLn2B], sp));
    L[FC_W] = add(row_shard(b[kFcW], 1, tp_, tpr_));
    L[FC_B] = add(row_shard(b[kFcB], 1, tp_, tpr_));
    L[MLP_PROJ_W] = add(col_shard(b[kMlpProjW], tp_, tpr_));
    L[MLP_PROJ_B] = add(replicated(b[kMlpProjB], false));
  }
  if (has_head()) {
    m.lnf_w = add(replicated(head[0], sp));
    m.lnf_b = add(replicated(head[1], sp));
    if (!cfg_.tied_embeddings) {
      m.lm_head = add(vocab_shard(head[2], Vs_, tpr_));
    } else if (m.wte) {
      m.lm_head = m.wte;
    } else {  // the stage's own copy of the wte shard (same initialisation)
      auto copy = vocab_shard(wte_spec, Vs_, tpr_);
      copy->tied_copy = true;
      m.lm_head = add(std::move(copy));
    }
  }
  for (auto& p : m.sharded) m.list.push_back(&p->shard);
  if (opts_.attention_workspace) {
    attn_ = opts_.attention_workspace;
  } else {
    own_attn_ = std::make_unique<cpu::AttnWorkspace>(pool_);
    attn_ = own_attn_.get();
  }
  ring_ = std::make_shared<parallel::cp::RingAttention>(pool_, attn_);
  impl_ = std::make_unique<Impl>(m);
  init_weights(seed);
}

ParallelGPT::ParallelGPT(const ParallelGPT& o, ReplicaOf)
    : cfg_(o.cfg_), g_(o.g_), opts_(o.opts_), pool_(o.pool_), tp_(o.tp_), tpr_(o.tpr_), cp_(o.cp_), cpr_(o.cpr_),
      Vs_(o.Vs_), first_(o.first_), last_(o.last_), w_(o.w_), scratch_(o.scratch_), attn_(o.attn_), ring_(o.ring_),
      impl_(std::make_unique<Impl>(*o.w_)) {}

std::unique_ptr<ParallelGPT> ParallelGPT::replica() const {
  return std::unique_ptr<ParallelGPT>(new ParallelGPT(*this, ReplicaOf{}));
}

void ParallelGPT::share_scratch_with(const ParallelGPT& other) {
  LOOM_CHECK(opts_.attention_workspace && opts_.attention_workspace == other.opts_.attention_workspace,
             "model '{}': stages share scratch only with the same caller-kept attention scratch", cfg_.name);
  LOOM_CHECK(g_.tp == other.g_.tp && g_.cp == other.g_.cp && opts_.sp == other.opts_.sp,
             "model '{}': stages share scratch only within the same tp / cp groups and sp", cfg_.name);
  LOOM_CHECK(impl_->N == 0, "model '{}': share_scratch_with after a forward", cfg_.name);
  scratch_ = other.scratch_;
  ring_ = other.ring_;
}

ParallelGPT::~ParallelGPT() = default;

const std::vector<Parameter*>& ParallelGPT::parameters() const { return w_->list; }
const std::vector<std::unique_ptr<ShardedParameter>>& ParallelGPT::sharded() const { return w_->sharded; }

ShardedParameter* ParallelGPT::tied_wte() const {
  if (!cfg_.tied_embeddings) return has_embedding() ? w_->wte : nullptr;
  return w_->wte ? w_->wte : w_->lm_head;
}

int64_t ParallelGPT::stream_rows(int64_t B, int64_t T) const {
  const int64_t N = B * (T / cp_);
  return opts_.sp ? tpm::sp_rows(N, tp_, tpr_).size() : N;
}

ShardedParameter& ParallelGPT::sharded(std::string_view name) const {
  for (auto& p : w_->sharded)
    if (p->global.name == name && !p->tied_copy) return *p;
  throw Error(fmt::format("model '{}' has no parameter named '{}'", cfg_.name, name));
}

void ParallelGPT::init_weights(uint64_t seed) {
  for (auto& p : w_->sharded) {
    p->shard.value_full.zero_();
    for (const ShardSegment& s : p->segments)
      init_values(p->global, seed, p->shard.value.f32() + s.local, s.global, s.n);
  }
}

void ParallelGPT::zero_grad() {
  for (auto& p : w_->sharded) p->shard.grad_full.zero_();
}

// ---------------------------------------------------------------------------------------------
// Memory declaration

int64_t ParallelGPT::embedding_saved_bytes(int64_t B, int64_t T) const {
  const int64_t N = B * (T / cp_), Ns = opts_.sp ? tpm::sp_rows(N, tp_, tpr_).size() : N;
  return I * N + F * Ns * cfg_.n_embd;  // tokens, out
}

int64_t ParallelGPT::block_saved_bytes(int64_t B, int64_t T) const {
  const int64_t N = B * (T / cp_), Ns = opts_.sp ? tpm::sp_rows(N, tp_, tpr_).size() : N;
  const int64_t C = cfg_.n_embd, Cl = C / tp_, NHl = cfg_.n_head / tp_;
  // Residual-stream side (sharded under sp): ln1 C + 2 stats, res2 C, ln2 C + 2 stats, out C.
  // Tensor-parallel side: qkv 3 Cl, atty Cl, fch 4 Cl, fch_gelu 4 Cl; lse NHl per row.
  return F * (Ns * (4 * C + 4) + N * (12 * Cl + NHl));
}

int64_t ParallelGPT::head_saved_bytes(int64_t B, int64_t T) const {
  const int64_t N = B * (T / cp_), Ns = opts_.sp ? tpm::sp_rows(N, tp_, tpr_).size() : N;
  // lnf C + 2 stats (own rows), logits Vs and losses (all rows), targets (i32).
  return F * (Ns * (cfg_.n_embd + 2) + N * (Vs_ + 1)) + I * N;
}

cpu::AttnArgs ParallelGPT::attention_args(int64_t B, int64_t T) const {
  const int64_t NHl = cfg_.n_head / tp_, Cl = cfg_.n_embd / tp_;
  cpu::AttnArgs aa;
  aa.B = B, aa.NH = NHl, aa.HS = cfg_.n_embd / cfg_.n_head, aa.Tq = aa.Tkv = T;
  aa.q_stride = aa.kv_stride = 3 * Cl, aa.o_stride = Cl;
  return aa;
}

int64_t ParallelGPT::attention_workspace_bytes(int64_t B, int64_t T, int threads) const {
  if (cp_ > 1)
    return parallel::cp::RingAttention::workspace_bytes({B, T, cfg_.n_head / tp_, cfg_.n_embd / cfg_.n_head}, cp_,
                                                        threads);
  return cpu::attention_training_workspace_bytes(attention_args(B, T), threads);
}

int64_t ParallelGPT::saved_activation_bytes(int64_t B, int64_t T) const {
  return (has_embedding() ? embedding_saved_bytes(B, T) : 0) + int64_t(w_->layers.size()) * block_saved_bytes(B, T) +
         (has_head() ? head_saved_bytes(B, T) : 0);
}

void ParallelGPT::release_activations() {
  Impl& m = *impl_;
  for (auto& L : m.layers) {
    ShardedParameter* p[12];
    std::memcpy(p, L.p, sizeof(p));
    L = Impl::Layer{};
    std::memcpy(L.p, p, sizeof(p));
  }
  m.tokens = m.emb_out = m.lnf = m.lnf_mean = m.lnf_rstd = m.logits = m.losses = m.targets = Tensor();
  m.wA = m.wB = m.buf4 = m.datty = m.dres = m.ce = Tensor();
  m.deferred.clear();
  m.def_dres = m.def_dfull = Tensor();
  m.x0 = nullptr;
  if (own_attn_) {  // scratch is this model's to free; a caller that keeps it runs the next micro-batch
    *scratch_ = Scratch{};
    ring_->release();
    own_attn_->release();
  }
  m.B = m.T = m.Tl = m.N = m.Ns = m.r0 = 0;
  m.holds_dlogits = m.can_backward = false;
}

const Tensor& ParallelGPT::losses() const {
  LOOM_CHECK(impl_->losses.defined(), "model '{}': no forward with targets yet", cfg_.name);
  return impl_->losses;
}

// ---------------------------------------------------------------------------------------------
// Forward

float ParallelGPT::forward(const Tensor& tokens, const Tensor& targets, const ForwardOptions& opt) {
  LOOM_CHECK(has_embedding() && has_head(), "model '{}': forward() runs the whole model; stage [{}, {}) runs "
             "forward_stage()", cfg_.name, first_, last_);
  return forward_stage(tokens, targets, nullptr, opt);
}

const float* ParallelGPT::stage_output() const {
  LOOM_CHECK(!has_head() && impl_->can_backward, "model '{}': stage [{}, {}) has no output before its forward (or "
             "ends in the head)", cfg_.name, first_, last_);
  return impl_->layers.empty() ? impl_->x0 : impl_->layers.back().out.f32();
}

const float* ParallelGPT::input_grad() const {
  LOOM_CHECK(!has_embedding() && impl_->dres.defined(), "model '{}': stage [{}, {}) has no input gradient (no "
             "backward yet, or it starts with the embedding)", cfg_.name, first_, last_);
  return impl_->dres.f32();
}

float ParallelGPT::forward_stage(const Tensor& tokens, const Tensor& targets, const float* input,
                                 const ForwardOptions& opt) {
  Impl& m = *impl_;
  LOOM_CHECK(has_embedding() == (input == nullptr), "model '{}': stage [{}, {}) {}", cfg_.name, first_, last_,
             has_embedding() ? "starts with the embedding and takes no input" : "needs the previous stage's output");
  check_batch(cfg_, tokens, targets, /*need_targets=*/true);
  const int64_t B = tokens.size(0), T = tokens.size(1);
  parallel::cp::check_sequence(T, cp_, ("model '" + cfg_.name + "'").c_str());
  if (opts_.activation_budget > 0 && saved_activation_bytes(B, T) > opts_.activation_budget)
    throw Error(fmt::format("model '{}': micro-batch [{}, {}] needs {} of saved activations per rank, over the "
                            "activation budget of {} (tp={}{}, cp={})",
                            cfg_.name, B, T, format_bytes(saved_activation_bytes(B, T)),
                            format_bytes(opts_.activation_budget), tp_, opts_.sp ? " sp" : "", cp_));
  const int64_t C = cfg_.n_embd, NH = cfg_.n_head, NHl = NH / tp_, Cl = C / tp_, HS = C / NH;
  const int64_t Tl = T / cp_, N = B * Tl;
  const auto rows = opts_.sp ? tpm::sp_rows(N, tp_, tpr_) : comm::Range{0, N};
  const int64_t Ns = rows.size();
  if (B != m.B || T != m.T) {
    release_activations();
    m.B = B, m.T = T, m.Tl = Tl, m.N = N, m.Ns = Ns, m.r0 = rows.begin;
    if (has_embedding()) {
      m.tokens = act({N}, DType::i32, pool_);
      m.emb_out = act({Ns, C}, DType::f32, pool_);
    }
    for (auto& L : m.layers) {
      L.ln1 = act({Ns, C}, DType::f32, pool_);
      L.ln1_mean = act({Ns}, DType::f32, pool_);
      L.ln1_rstd = act({Ns}, DType::f32, pool_);
      L.qkv = act({N, 3 * Cl}, DType::f32, pool_);
      L.atty = act({N, Cl}, DType::f32, pool_);
      L.lse = act({B, NHl, Tl}, DType::f32, pool_);
      L.res2 = act({Ns, C}, DType::f32, pool_);
      L.ln2 = act({Ns, C}, DType::f32, pool_);
      L.ln2_mean = act({Ns}, DType::f32, pool_);
      L.ln2_rstd = act({Ns}, DType::f32, pool_);
      L.fch = act({N, 4 * Cl}, DType::f32, pool_);
      L.fch_gelu = act({N, 4 * Cl}, DType::f32, pool_);
      L.out = act({Ns, C}, DType::f32, pool_);
    }
    if (has_head()) {
      m.lnf = act({Ns, C}, DType::f32, pool_);
      m.lnf_mean = act({Ns}, DType::f32, pool_);
      m.lnf_rstd = act({Ns}, DType::f32, pool_);
      m.logits = act({N, Vs_}, DType::f32, pool_);
      m.losses = act({B, Tl}, DType::f32, pool_);
      m.targets = act({N}, DType::i32, pool_);
    }
  }
  if (!m.wA.defined()) {
    scratch_->forward(pool_, N, Ns, C, has_head());
    m.wA = scratch_->wA, m.wB = scratch_->wB, m.ce = scratch_->ce;
  }
  // The attention scratch for every layer's forward and backward calls, taken once.
  if (!m.layers.empty()) attn_->reserve(attention_workspace_bytes(B, T, omp_get_max_threads()));
  m.can_backward = false;
  m.holds_dlogits = false;
  m.deferred.clear();
  m.def_dres = m.def_dfull = Tensor();
  const bool sp = opts_.sp && tp_ > 1;
  comm::Comm* tpg = tp_ > 1 ? g_.tp : nullptr;
  if (has_embedding()) parallel::cp::slice_sequence(tokens.i32(), m.tokens.i32(), B, T, cp_, cpr_);
  if (has_head()) parallel::cp::slice_sequence(targets.i32(), m.targets.i32(), B, T, cp_, cpr_);

  // Embedding: vocabulary-parallel lookup, reduced (sp: reduce-scattered), plus positions.
  if (has_embedding()) {
    float* out = m.emb_out.f32();
    float* look = sp ? m.wB.f32() : out;  // f32 [N, C] partial lookup
    tpm::vocab_embedding_forward(look, m.tokens.i32(), m.wte->shard.value.f32(), N, C, int64_t(tpr_) * Vs_, Vs_,
                                 cfg_.vocab_size);
    if (sp)
      tpm::scatter_rows_forward(tpg, look, out, N, C);
    else
      tpm::reduce_forward(tpg, out, N * C);
    const float* wpe = m.wpe->shard.value.f32();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < Ns; ++i) {
      const int64_t n = rows.begin + i, pos = parallel::cp::global_position(n % Tl, T, cp_, cpr_);
      for (int64_t c = 0; c < C; ++c) out[i * C + c] += wpe[pos * C + c];
    }
  }

  m.x0 = has_embedding() ? m.emb_out.f32() : input;
  const float* x = m.x0;
  for (auto& L : m.layers) {
    // Attention: ln_1 (own rows) -> [gather] -> c_attn (column) -> attention -> c_proj (row) -> reduce.
    cpu::layernorm_forward(L.ln1.f32(), L.ln1_mean.f32(), L.ln1_rstd.f32(), x, L.w(LN1_W), L.w(LN1_B), Ns, C,
                           cfg_.ln_eps);
    const float* lnfull = L.ln1.f32();
    if (sp) {
      tpm::gather_rows_forward(tpg, L.ln1.f32(), m.wA.f32(), N, C);
      lnfull = m.wA.f32();
    }
    cpu::matmul_forward(L.qkv.f32(), lnfull, L.w(QKV_W), L.w(QKV_B), N, C, 3 * Cl);
    if (cp_ > 1) {
      ring_->forward(*g_.cp, L.atty.f32(), L.lse.f32(), L.qkv.f32(), {B, T, NHl, HS});
    } else {
      const cpu::AttnArgs aa = attn_->use(attention_args(B, T), false);
      const float* q = L.qkv.f32();
      cpu::attention_forward(L.atty.f32(), L.lse.f32(), q, q + Cl, q + 2 * Cl, aa);
    }
    if (tp_ == 1) {
      cpu::matmul_forward(L.res2.f32(), L.atty.f32(), L.w(ATTN_PROJ_W), L.w(ATTN_PROJ_B), N, C, C);
    } else {
      float* part = sp ? m.wB.f32() : L.res2.f32();  // f32 [N, C] partial sums
      cpu::matmul_forward(part, L.atty.f32(), L.w(ATTN_PROJ_W), nullptr, N, Cl, C);
      if (sp)
        tpm::scatter_rows_forward(tpg, part, L.res2.f32(), N, C);
      else
        tpm::reduce_forward(tpg, part, N * C);
      add_bias(L.res2.f32(), L.w(ATTN_PROJ_B), Ns, C);
    }
    cpu::residual_forward(L.res2.f32(), L.res2.f32(), x, Ns * C);

    // MLP: ln_2 -> [gather] -> c_fc (column) -> GELU -> c_proj (row) -> reduce.
    cpu::layernorm_forward(L.ln2.f32(), L.ln2_mean.f32(), L.ln2_rstd.f32(), L.res2.f32(), L.w(LN2_W), L.w(LN2_B),
                           Ns, C, cfg_.ln_eps);
    lnfull = L.ln2.f32();
    if (sp) {
      tpm::gather_rows_forward(tpg, L.ln2.f32(), m.wA.f32(), N, C);
      lnfull = m.wA.f32();
    }
    cpu::matmul_forward(L.fch.f32(), lnfull, L.w(FC_W), L.w(FC_B), N, C, 4 * Cl);
    cpu::gelu_forward(L.fch_gelu.f32(), L.fch.f32(), N * 4 * Cl);
    if (tp_ == 1) {
      cpu::matmul_forward(L.out.f32(), L.fch_gelu.f32(), L.w(MLP_PROJ_W), L.w(MLP_PROJ_B), N, 4 * C, C);
    } else {
      float* part = sp ? m.wB.f32() : L.out.f32();
      cpu::matmul_forward(part, L.fch_gelu.f32(), L.w(MLP_PROJ_W), nullptr, N, 4 * Cl, C);
      if (sp)
        tpm::scatter_rows_forward(tpg, part, L.out.f32(), N, C);
      else
        tpm::reduce_forward(tpg, part, N * C);
      add_bias(L.out.f32(), L.w(MLP_PROJ_B), Ns, C);
    }
    cpu::residual_forward(L.out.f32(), L.out.f32(), L.res2.f32(), Ns * C);
    x = L.out.f32();
  }

  if (!has_head()) {
    m.can_backward = true;
    return 0.0f;
  }

  // Head: ln_f -> [gather] -> lm_head shard (column) -> vocabulary-parallel cross-entropy.
  cpu::layernorm_forward(m.lnf.f32(), m.lnf_mean.f32(), m.lnf_rstd.f32(), x, m.lnf_w->shard.value.f32(),
                         m.lnf_b->shard.value.f32(), Ns, C, cfg_.ln_eps);
  const float* lnfull = m.lnf.f32();
  if (sp) {
    tpm::gather_rows_forward(tpg, m.lnf.f32(), m.wA.f32(), N, C);
    lnfull = m.wA.f32();
  }
  cpu::matmul_forward(m.logits.f32(), lnfull, m.lm_head->shard.value.f32(), nullptr, N, C, Vs_);

  // The loss is the mean over the counted targets of the whole sequence (all cp ranks).
  float counts[2] = {0, 0};  // counted targets, loss sum
  for (int64_t n = 0; n < N; ++n) counts[0] += m.targets.i32()[n] >= 0 ? 1.0f : 0.0f;
  if (cp_ > 1) g_.cp->all_reduce(counts, 1, DType::f32);
  const double counted = counts[0];
  m.dloss = counted > 0 ? float(double(opt.dloss_scale) / counted) : 0.0f;
  tpm::VocabCEArgs ca;
  ca.N = N, ca.Vs = Vs_, ca.v0 = int64_t(tpr_) * Vs_, ca.V = cfg_.vocab_size, ca.dloss = m.dloss;
  tpm::vocab_cross_entropy(tpg, m.losses.f32(), opt.fuse_backward ? m.logits.f32() : nullptr, m.logits.f32(),
                           m.targets.i32(), m.ce.f32(), ca);
  m.holds_dlogits = opt.fuse_backward;
  double sum = 0;
  for (int64_t n = 0; n < N; ++n) sum += m.losses.f32()[n];
  counts[1] = float(sum);
  if (cp_ > 1) g_.cp->all_reduce(counts + 1, 1, DType::f32);
  m.can_backward = true;
  return counted > 0 ? float(double(counts[1]) / counted) : 0.0f;
}

// ---------------------------------------------------------------------------------------------
// Backward

void ParallelGPT::backward() {
  LOOM_CHECK(has_embedding() && has_head(), "model '{}': backward() runs the whole model; stage [{}, {}) runs "
             "backward_stage()", cfg_.name, first_, last_);
  backward_stage(nullptr, false);
}

void ParallelGPT::backward_stage(const float* grad_output, bool input_only) {
  Impl& m = *impl_;
  LOOM_CHECK(m.can_backward, "model '{}': backward needs a forward with targets first", cfg_.name);
  LOOM_CHECK(has_head() == (grad_output == nullptr), "model '{}': stage [{}, {}) {}", cfg_.name, first_, last_,
             has_head() ? "ends in the head and takes no output gradient" : "needs the gradient of its output");
  const int64_t C = cfg_.n_embd, NH = cfg_.n_head, NHl = NH / tp_, Cl = C / tp_, HS = C / NH;
  const int64_t B = m.B, T = m.T, N = m.N, Ns = m.Ns;
  const bool sp = opts_.sp && tp_ > 1;
  comm::Comm* tpg = tp_ > 1 ? g_.tp : nullptr;
  if (!m.buf4.defined()) {
    scratch_->backward(pool_, N, Ns, C, Cl);
    m.buf4 = scratch_->buf4, m.datty = scratch_->datty, m.dres = scratch_->dres;
  }
  m.deferred.clear();
  float* dres = m.dres.f32();  // f32 [Ns, C] gradient of the residual stream (own rows)
  float* wA = m.wA.f32();
  float* wB = m.wB.f32();
  if (grad_output) std::memcpy(dres, grad_output, size_t(Ns * C) * sizeof(float));
  // d(partial) [N, C] of a column-parallel GEMM's input -> own rows of the full gradient in `to`
  // (sp: reduce-scatter into wA; otherwise all-reduce in place).
  auto reduce_input_grad = [&](float* partial) -> const float* {
    if (sp) {
      tpm::gather_rows_backward(tpg, partial, wA, N, C);
      return wA;
    }
    tpm::copy_backward(tpg, partial, N * C);
    return partial;
  };
  // The full [N, C] gradient of a row-parallel GEMM's output from the own rows in dres.
  auto full_output_grad = [&]() -> const float* {
    if (!sp) return dres;
    tpm::scatter_rows_backward(tpg, dres, wA, N, C);
    return wA;
  };
  auto gathered = [&](const Tensor& own) -> const float* {
    if (!sp) return own.f32();
    tpm::gather_rows_forward(tpg, own.f32(), wA, N, C);
    return wA;
  };
  // A copy (tag workspace) of a buffer this backward reuses, for a deferred weight gradient.
  auto keep = [&](const float* src, int64_t n) {
    Tensor t = Tensor::empty({n}, DType::f32, MemTag::workspace, pool_);
    std::memcpy(t.f32(), src, size_t(n) * sizeof(float));
    return t;
  };
  // The backward of out [M, Nout] = inp [M, K] @ W^T + b: dinp now; dW, db now or (input_only)
  // deferred, keeping copies of dout / inp when they live in reused buffers.
  auto linear = [&](float* dinp, float* dW, float* db, const float* dout, bool dout_reused, const float* inp,
                    bool inp_reused, const float* W, int64_t M, int64_t K, int64_t Nout) {
    if (!input_only) {
      cpu::matmul_backward(dinp, dW, db, dout, inp, W, M, K, Nout);
      return;
    }
    if (dinp) cpu::matmul_backward(dinp, nullptr, nullptr, dout, inp, W, M, K, Nout);
    Impl::DeferredGemm d;
    d.dW = dW, d.db = db, d.M = M, d.K = K, d.N = Nout;
    if (dout_reused) d.dout_copy = keep(dout, M * Nout);
    d.dout = dout_reused ? d.dout_copy.f32() : dout;
    if (inp_reused) d.inp_copy = keep(inp, M * K);
    d.inp = inp_reused ? d.inp_copy.f32() : inp;
    m.deferred.push_back(std::move(d));
  };

  // Head.
  if (has_head()) {
    if (!m.holds_dlogits) {
      tpm::VocabCEArgs ca;
      ca.N = N, ca.Vs = Vs_, ca.v0 = int64_t(tpr_) * Vs_, ca.V = cfg_.vocab_size, ca.dloss = m.dloss;
      tpm::vocab_cross_entropy(tpg, m.losses.f32(), m.logits.f32(), m.logits.f32(), m.targets.i32(), m.ce.f32(), ca);
      m.holds_dlogits = true;
    }
    const float* lnfull = gathered(m.lnf);
    linear(wB, m.lm_head->shard.grad.f32(), nullptr, m.logits.f32(), false, lnfull, sp,
           m.lm_head->shard.value.f32(), N, C, Vs_);
    const float* dln = reduce_input_grad(wB);
    const float* x = m.layers.empty() ? m.x0 : m.layers.back().out.f32();
    cpu::layernorm_backward(dres, m.lnf_w->shard.grad.f32(), m.lnf_b->shard.grad.f32(), dln, x,
                            m.lnf_w->shard.value.f32(), m.lnf_mean.f32(), m.lnf_rstd.f32(), Ns, C, false);
  }

  for (int64_t l = int64_t(m.layers.size()) - 1; l >= 0; --l) {
    auto& L = m.layers[size_t(l)];
    const float* x = l == 0 ? m.x0 : m.layers[size_t(l - 1)].out.f32();
    // MLP branch: dres = d(out) = d(res2) through the residual.
    const float* dout = full_output_grad();
    float* b4 = m.buf4.f32();
    linear(b4, L.g(MLP_PROJ_W), L.g(MLP_PROJ_B), dout, true, L.fch_gelu.f32(), false, L.w(MLP_PROJ_W), N, 4 * Cl, C);
    cpu::gelu_backward(b4, L.fch.f32(), b4, N * 4 * Cl);
    const float* lnfull = gathered(L.ln2);
    linear(wB, L.g(FC_W), L.g(FC_B), b4, true, lnfull, sp, L.w(FC_W), N, C, 4 * Cl);
    const float* dln = reduce_input_grad(wB);
    cpu::layernorm_backward(dres, L.g(LN2_W), L.g(LN2_B), dln, L.res2.f32(), L.w(LN2_W), L.ln2_mean.f32(),
                            L.ln2_rstd.f32(), Ns, C, true);
    // Attention branch: dres = d(res2) = d(x) through the residual.
    dout = full_output_grad();
    linear(m.datty.f32(), L.g(ATTN_PROJ_W), L.g(ATTN_PROJ_B), dout, true, L.atty.f32(), false, L.w(ATTN_PROJ_W), N,
           Cl, C);
    float* dqkv = b4;  // f32 [N, 3 Cl] in the [N, 4 Cl] buffer
    if (cp_ > 1) {
      ring_->backward(*g_.cp, dqkv, m.datty.f32(), L.qkv.f32(), L.atty.f32(), L.lse.f32(), {B, T, NHl, HS});
    } else {
      const cpu::AttnArgs aa = attn_->use(attention_args(B, T), true);
      const float* q = L.qkv.f32();
      cpu::attention_backward(dqkv, dqkv + Cl, dqkv + 2 * Cl, m.datty.f32(), q, q + Cl, q + 2 * Cl, L.atty.f32(),
                              L.lse.f32(), aa);
    }
    lnfull = gathered(L.ln1);
    linear(wB, L.g(QKV_W), L.g(QKV_B), dqkv, true, lnfull, sp, L.w(QKV_W), N, C, 3 * Cl);
    dln = reduce_input_grad(wB);
    cpu::layernorm_backward(dres, L.g(LN1_W), L.g(LN1_B), dln, x, L.w(LN1_W), L.ln1_mean.f32(), L.ln1_rstd.f32(),
                            Ns, C, true);
  }

  // Embedding: positions from the own rows, the vocabulary shard from all rows.
  if (has_embedding()) {
    const float* dfull = full_output_grad();
    if (input_only) {  // both are weight gradients: deferred with copies of their inputs
      m.def_dres = keep(dres, Ns * C);
      m.def_dfull = keep(dfull, N * C);
    } else {
      embedding_weight_grads(dres, dfull);
    }
  }
  m.can_backward = false;
}

void ParallelGPT::embedding_weight_grads(const float* dres, const float* dfull) {
  Impl& m = *impl_;
  const int64_t C = cfg_.n_embd;
  float* dwpe = m.wpe->shard.grad.f32();
  for (int64_t i = 0; i < m.Ns; ++i) {
    const int64_t n = m.r0 + i, pos = parallel::cp::global_position(n % m.Tl, m.T, cp_, cpr_);
    for (int64_t c = 0; c < C; ++c) dwpe[pos * C + c] += dres[i * C + c];
  }
  tpm::vocab_embedding_backward(m.wte->shard.grad.f32(), dfull, m.tokens.i32(), m.N, C, int64_t(tpr_) * Vs_, Vs_);
}

void ParallelGPT::backward_weight() {
  Impl& m = *impl_;
  for (const Impl::DeferredGemm& d : m.deferred)
    cpu::matmul_backward(nullptr, d.dW, d.db, d.dout, d.inp, nullptr, d.M, d.K, d.N);
  m.deferred.clear();
  if (m.def_dres.defined()) {
    embedding_weight_grads(m.def_dres.f32(), m.def_dfull.f32());
    m.def_dres = m.def_dfull = Tensor();
  }
}

void ParallelGPT::finish_gradients() {
  if (!opts_.sp || tp_ == 1) return;
  for (auto& p : w_->sharded)
    if (p->sp_partial) g_.tp->all_reduce(p->shard.grad.f32(), p->shard.spec.numel(), DType::f32);
}

}  // namespace loom::model

#include "model/gpt.h"

#include <cmath>

#include "model/param_specs.h"

namespace loom::model {

GPT::GPT(const GPTConfig& cfg, Backend& be, uint64_t seed, const ModelLayout& layout)
    : cfg_(cfg), layout_(layout), be_(be), pool_(be.pool()) {
  build(seed);
}

GPT::GPT(const GPTConfig& cfg, MemoryPool& pool, uint64_t seed, const ModelLayout& layout)
    : cfg_(cfg), layout_(layout), own_be_(make_backend(pool.device(), {.pool = &pool, .matmul = layout.matmul})), be_(*own_be_), pool_(pool) {
  build(seed);
}

void GPT::build(uint64_t seed) {
  cfg_.validate("model config '" + cfg_.name + "'");
  seed_ = seed;
  if (layout_.activation_budget < 0)
    throw Error(fmt::format("model '{}': activation_budget = {} must be >= 0", cfg_.name, layout_.activation_budget));
  par_ = std::make_shared<ChainParallel>(be_, layout_.groups, layout_.sp);
  // On a device every gradient is a slice of one buffer: one fill zeroes them (a graphed step's
  // one memset instead of one per parameter) and one collective sums them over replicas. On the
  // CPU each keeps its own allocation, which data parallelism lays out itself.
  GradArena arena;
  GradArena* a = nullptr;
  if (be_.device() != Device::cpu && !layout_.defer_parameters) {
    arena.flat = be_.empty({arena_elements()}, DType::f32, MemTag::grads);
    be_.fill_zero(arena.flat.raw(), int64_t(arena.flat.nbytes()));
    grads_ = arena.flat;
    a = &arena;
  }
  const BlockOptions bo{.arena = a, .parallel = par_, .defer_parameters = layout_.defer_parameters};
  embedding_ = std::make_unique<Embedding>(cfg_, be_, bo);
  for (int64_t l = 0; l < cfg_.n_layer; ++l) blocks_.push_back(std::make_unique<TransformerBlock>(cfg_, l, be_, bo));
  head_ = std::make_unique<Head>(cfg_, &embedding_->wte(), be_, bo);
  for (ChainBlock* b : chain())
    for (Parameter* p : b->parameters()) params_.push_back(p);
  if (!layout_.defer_parameters) init_weights(seed);
}

int64_t GPT::arena_elements() const {
  // This rank's parameters as the blocks cut them (their shards under tp), declared without
  // allocating, in the order the blocks then take them from the arena.
  const BlockOptions declare{.parallel = par_, .defer_parameters = true};
  std::vector<ParamSpec> specs;
  auto add = [&](ChainBlock& b) {
    for (const Parameter* p : b.parameters()) specs.push_back(p->spec);
  };
  Embedding e(cfg_, be_, declare);
  add(e);
  for (int64_t l = 0; l < cfg_.n_layer; ++l) {
    TransformerBlock t(cfg_, l, be_, declare);
    add(t);
  }
  Head h(cfg_, &e.wte(), be_, declare);
  add(h);
  return GradArena::elements(specs);
}

std::vector<ChainBlock*> GPT::chain() const {
  std::vector<ChainBlock*> c{embedding_.get()};
  for (auto& b : blocks_) c.push_back(b.get());
  c.push_back(head_.get());
  return c;
}

Parameter& GPT::parameter(std::string_view name) const {
  for (Parameter* p : params_)
    if (p->spec.name == name) return *p;
  throw Error(fmt::format("model '{}' has no parameter named '{}'", cfg_.name, name));
}

void GPT::init_weights(uint64_t seed) {
  for (Parameter* p : params_) p->initialise(seed, &be_);
}

void GPT::refresh_compute() {
  for (Parameter* p : params_) p->refresh_compute(be_);
}

int64_t GPT::num_parameters() const {
  int64_t n = 0;
  for (Parameter* p : params_) n += p->spec.numel();
  return n;
}

int64_t GPT::num_nonembedding_parameters() const {
  int64_t n = 0;
  for (Parameter* p : params_) {
    const std::string& s = p->spec.name;
    if (s != "wte.weight" && s != "wpe.weight" && s != "lm_head.weight") n += p->spec.numel();
  }
  return n;
}

int64_t GPT::param_bytes() const {
  int64_t n = 0;
  for (Parameter* p : params_) n += p->spec.alloc_numel() * int64_t(sizeof(float));
  return n;
}

int64_t GPT::saved_activation_bytes(int64_t B, int64_t T) const {
  int64_t n = 0;
  for (ChainBlock* b : chain()) n += b->saved_activation_bytes(B, T);
  return n;
}

int64_t GPT::workspace_bytes(int64_t B, int64_t T, int threads) const {
  // dres [B, T, C] + bufC [B, T, C] + buf4C [B, T, wide], held from the first backward on, and the
  // attention kernel's scratch, held from the first forward on (the same for every block; the
  // larger of forward and backward).
  const ChainParallel& P = *par_;
  const int64_t C = cfg_.n_embd, N = P.rows(B, T), Ns = P.own_rows(B, T), e = int64_t(dtype_size(be_.compute_dtype()));
  int64_t bytes = e * (Ns * C + N * C + N * wide_columns(cfg_, P.tp()));
  if (P.sp_active()) bytes += e * (2 * N * C + Ns * C);  // gathered rows, partial sums, own-row gradients
  if (P.tp() > 1) bytes += int64_t(sizeof(float)) * 3 * N;  // the vocabulary-parallel loss's statistics
  if (P.cp() > 1) bytes += int64_t(sizeof(int32_t)) * (T / P.cp());  // the rows' positions
  return bytes + linear_workspace_bytes(B, T) +
         (blocks_.empty() ? 0 : blocks_[0]->attention_workspace_bytes(B, T, threads));
}

int64_t GPT::linear_workspace_bytes(int64_t B, int64_t T) const {
  std::vector<LinearShape> shapes;
  for (const ChainBlock* b : chain()) b->linear_shapes(B, T, shapes);
  return be_.linear_workspace_bytes(shapes);
}

void check_batch(const GPTConfig& cfg, const Tensor& tokens, const Tensor& targets, bool need_targets) {
  LOOM_CHECK(tokens.defined() && tokens.dtype() == DType::i32 && tokens.dim() == 2,
             "model '{}': tokens must be i32 [B, T], got {}", cfg.name, tokens.defined() ? tokens.str() : "none");
  const int64_t B = tokens.size(0), T = tokens.size(1);
  LOOM_CHECK(B > 0 && T > 0, "model '{}': empty batch {}", cfg.name, shape_str(tokens.shape()));
  if (T > cfg.block_size)
    throw Error(fmt::format("model '{}': sequence length {} exceeds block_size {}", cfg.name, T, cfg.block_size));
  if (!need_targets && !targets.defined()) return;
  if (!targets.defined() || targets.dtype() != DType::i32 || targets.shape() != tokens.shape())
    throw Error(fmt::format("model '{}': targets must be i32 {}, got {}", cfg.name, shape_str(tokens.shape()),
                            targets.defined() ? targets.str() : std::string("none")));
}

float GPT::forward(const Tensor& tokens, const Tensor& targets, const ForwardOptions& opt) {
  check_batch(cfg_, tokens, targets, /*need_targets=*/false);
  const int64_t B = tokens.size(0), T = tokens.size(1);
  if (B != B_ || T != T_) {
    // Free the old shapes first so the peak never holds both.
    release_activations();
    B_ = B;
    T_ = T;
  }
  can_backward_ = false;
  const int64_t L = cfg_.n_layer;
  // The blocks' attention scratch, sized once for the largest call: with targets a backward may
  // follow, so the larger of the forward and backward call (without, the forward calls take what
  // they need).
  if (layout_.activation_budget > 0 && saved_activation_bytes(B, T) > layout_.activation_budget)
    throw Error(fmt::format("model '{}': micro-batch [{}, {}] needs {} of saved activations per rank, over the "
                            "activation budget of {} (tp={}{}, cp={})",
                            cfg_.name, B, T, format_bytes(saved_activation_bytes(B, T)),
                            format_bytes(layout_.activation_budget), par_->tp(), par_->sp_active() ? " sp" : "",
                            par_->cp()));
  if (L > 0 && targets.defined() && par_->cp() == 1)
    be_.prepare_attention(be_.compute_dtype(), blocks_[0]->attention_shape(B, T));
  // A device batch (ForwardOptions::loss_out): tokens and targets in the backend's memory.
  const bool on_device = opt.loss_out != nullptr;
  if (on_device) {
    LOOM_CHECK(tokens.device() == be_.device() && targets.defined() && targets.device() == be_.device(),
               "model '{}': a device batch needs tokens and targets in the {} backend's memory", cfg_.name, be_.name());
    LOOM_CHECK(opt.counted >= 0 && opt.counted <= B * T, "model '{}': a device batch needs counted in [0, {}], got {}",
               cfg_.name, B * T, opt.counted);
  } else {
    LOOM_CHECK(tokens.device() == Device::cpu && (!targets.defined() || targets.device() == Device::cpu),
               "model '{}': tokens and targets in device memory need ForwardOptions::loss_out", cfg_.name);
  }
  if (hooks_) hooks_->before_forward(0);
  embedding_->forward(tokens.i32(), B, T, 0, on_device);
  if (hooks_) hooks_->after_forward(0);
  const void* x = embedding_->out().raw();
  for (int64_t l = 0; l < L; ++l) {
    if (hooks_) hooks_->before_forward(l + 1);
    blocks_[size_t(l)]->forward(x, B, T);
    if (hooks_) hooks_->after_forward(l + 1);
    x = blocks_[size_t(l)]->out().raw();
    // A recomputed segment keeps only its input and its last block's output: each block drops
    // what it saved, and the output before it once it has been read.
    const int s = plan_.segment_of(l);
    if (s < 0) continue;
    blocks_[size_t(l)]->drop_saved();
    if (l > plan_.segments[size_t(s)].first) blocks_[size_t(l - 1)]->release_activations();
  }
  dloss_scale_ = opt.dloss_scale;
  if (hooks_) hooks_->before_forward(L + 1);
  const DeviceTargets dev{opt.counted, opt.loss_out};
  double loss = head_->forward(x, targets.defined() ? targets.i32() : nullptr, B, T, opt.fuse_backward,
                               opt.dloss_scale, on_device ? &dev : nullptr);
  if (hooks_) hooks_->after_forward(L + 1);
  can_backward_ = targets.defined();
  return float(loss);
}

void GPT::backward() {
  LOOM_CHECK(can_backward_, "model '{}': backward needs a forward with targets first", cfg_.name);
  const int64_t B = B_, T = T_, C = cfg_.n_embd;
  if (!ws_dres_.defined()) {
    const DType dt = be_.compute_dtype();
    const ChainParallel& P = *par_;
    const int64_t N = P.rows(B, T), Ns = P.own_rows(B, T);
    ws_dres_ = be_.empty(P.single() ? Shape{B, T, C} : Shape{Ns, C}, dt, MemTag::workspace);
    ws_bufC_ = be_.empty(P.single() ? Shape{B, T, C} : Shape{N, C}, dt, MemTag::workspace);
    ws_buf4C_ = be_.empty(P.single() ? Shape{B, T, wide_columns(cfg_, 1)} : Shape{N, wide_columns(cfg_, P.tp())}, dt,
                          MemTag::workspace);
  }
  BackwardScratch s{ws_dres_.raw(), ws_bufC_.raw(), ws_buf4C_.raw()};
  auto input_of = [&](int64_t l) { return l == 0 ? embedding_->out().raw() : blocks_[size_t(l - 1)]->out().raw(); };
  const int64_t L = cfg_.n_layer;
  if (hooks_) hooks_->before_backward(L + 1);
  head_->backward(input_of(L), s, dloss_scale_);
  if (hooks_) hooks_->after_backward(L + 1);
  for (int64_t l = L - 1; l >= 0; --l) {
    const int seg = plan_.segment_of(l);
    if (seg >= 0 && l == plan_.segments[size_t(seg)].second) {
      // The segment runs forward again from its kept input, saving everything.
      for (int64_t m = plan_.segments[size_t(seg)].first; m <= l; ++m) {
        if (hooks_) hooks_->before_forward(m + 1);
        blocks_[size_t(m)]->forward(input_of(m), B, T);
        if (hooks_) hooks_->after_forward(m + 1);
      }
    }
    if (hooks_) hooks_->before_backward(l + 1);
    blocks_[size_t(l)]->backward(input_of(l), s);
    if (hooks_) hooks_->after_backward(l + 1);
    if (seg >= 0) blocks_[size_t(l)]->release_activations();  // its output's readers are done
  }
  if (hooks_) hooks_->before_backward(0);
  embedding_->backward(s.dres);
  if (hooks_) hooks_->after_backward(0);
  can_backward_ = false;  // the logits buffer now holds dlogits
}

void GPT::zero_grad() {
  if (grads_.defined()) {
    be_.fill_zero(grads_.raw(), int64_t(grads_.nbytes()));
    return;
  }
  for (Parameter* p : params_) {
    if (!p->grad_full.defined()) continue;
    if (p->grad_full.device() == Device::cpu)
      p->grad_full.zero_();
    else
      be_.fill_zero(p->grad_full.raw(), int64_t(p->grad_full.nbytes()));
  }
}

void GPT::set_recompute(const RecomputePlan& plan) {
  LOOM_CHECK(plan.blocks == cfg_.n_layer, "model '{}': a recompute plan for {} blocks, the model has {}", cfg_.name,
             plan.blocks, cfg_.n_layer);
  release_activations();
  plan_ = plan;
  for (auto& b : blocks_) b->set_selective(plan.selective);
}

ChainMemory GPT::chain_memory(int64_t B, int64_t T) const { return model::chain_memory(chain(), B, T); }

int64_t GPT::activation_peak_bytes(int64_t B, int64_t T) const {
  if (plan_.segments.empty()) return saved_activation_bytes(B, T);
  return int64_t(plan_peak(plan_, chain_memory(B, T)));
}

void GPT::release_activations() {
  for (ChainBlock* b : chain()) b->release_activations();
  ws_dres_ = ws_bufC_ = ws_buf4C_ = Tensor();
  par_->release();
  be_.release_workspace();
  ++activation_epoch_;
  B_ = T_ = 0;
  can_backward_ = false;
}

}  // namespace loom::model

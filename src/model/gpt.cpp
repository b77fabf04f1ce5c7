#include "model/gpt.h"

#include <omp.h>

#include <cmath>

namespace loom::model {

GPT::GPT(const GPTConfig& cfg, MemoryPool& pool, uint64_t seed) : cfg_(cfg), pool_(pool), attn_ws_(pool) {
  cfg_.validate("model config '" + cfg_.name + "'");
  embedding_ = std::make_unique<Embedding>(cfg_, pool);
  for (int64_t l = 0; l < cfg_.n_layer; ++l) blocks_.push_back(std::make_unique<TransformerBlock>(cfg_, l, pool));
  head_ = std::make_unique<Head>(cfg_, &embedding_->wte(), pool);
  for (ChainBlock* b : chain())
    for (Parameter* p : b->parameters()) params_.push_back(p);
  init_weights(seed);
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
  for (Parameter* p : params_) p->initialise(seed);
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
  // dres [B, T, C] + bufC [B, T, C] + buf4C [B, T, 4C], held from the first backward on, and the
  // attention kernel's scratch, held from the first forward on (the same for every block; the
  // larger of forward and backward).
  const int64_t scratch = int64_t(sizeof(float)) * B * T * cfg_.n_embd * 6;
  return scratch + (blocks_.empty() ? 0 : blocks_[0]->attention_workspace_bytes(B, T, threads));
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
  // follow, so the larger of the forward and backward call.
  if (L > 0) {
    const int threads = omp_get_max_threads();
    attn_ws_.reserve(targets.defined()
                         ? blocks_[0]->attention_workspace_bytes(B, T, threads)
                         : cpu::attention_workspace_bytes(blocks_[0]->attention_args(B, T), false, threads));
  }
  if (hooks_) hooks_->before_forward(0);
  embedding_->forward(tokens.i32(), B, T);
  if (hooks_) hooks_->after_forward(0);
  const float* x = embedding_->out().f32();
  for (int64_t l = 0; l < L; ++l) {
    if (hooks_) hooks_->before_forward(l + 1);
    blocks_[size_t(l)]->forward(x, B, T, &attn_ws_);
    if (hooks_) hooks_->after_forward(l + 1);
    x = blocks_[size_t(l)]->out().f32();
  }
  dloss_scale_ = opt.dloss_scale;
  if (hooks_) hooks_->before_forward(L + 1);
  double loss = head_->forward(x, targets.defined() ? targets.i32() : nullptr, B, T, opt.fuse_backward,
                               opt.dloss_scale);
  if (hooks_) hooks_->after_forward(L + 1);
  can_backward_ = targets.defined();
  return float(loss);
}

void GPT::backward() {
  LOOM_CHECK(can_backward_, "model '{}': backward needs a forward with targets first", cfg_.name);
  const int64_t B = B_, T = T_, C = cfg_.n_embd;
  if (!ws_dres_.defined()) {
    ws_dres_ = Tensor::empty({B, T, C}, DType::f32, MemTag::workspace, pool_);
    ws_bufC_ = Tensor::empty({B, T, C}, DType::f32, MemTag::workspace, pool_);
    ws_buf4C_ = Tensor::empty({B, T, 4 * C}, DType::f32, MemTag::workspace, pool_);
  }
  BackwardScratch s{ws_dres_.f32(), ws_bufC_.f32(), ws_buf4C_.f32(), &attn_ws_};
  auto input_of = [&](int64_t l) { return l == 0 ? embedding_->out().f32() : blocks_[size_t(l - 1)]->out().f32(); };
  const int64_t L = cfg_.n_layer;
  if (hooks_) hooks_->before_backward(L + 1);
  head_->backward(input_of(L), s, dloss_scale_);
  if (hooks_) hooks_->after_backward(L + 1);
  for (int64_t l = L - 1; l >= 0; --l) {
    if (hooks_) hooks_->before_backward(l + 1);
    blocks_[size_t(l)]->backward(input_of(l), s);
    if (hooks_) hooks_->after_backward(l + 1);
  }
  if (hooks_) hooks_->before_backward(0);
  embedding_->backward(s.dres);
  if (hooks_) hooks_->after_backward(0);
  can_backward_ = false;  // the logits buffer now holds dlogits
}

void GPT::zero_grad() {
  for (Parameter* p : params_)
    if (p->grad_full.defined()) p->grad_full.zero_();
}

void GPT::release_activations() {
  for (ChainBlock* b : chain()) b->release_activations();
  ws_dres_ = ws_bufC_ = ws_buf4C_ = Tensor();
  attn_ws_.release();
  B_ = T_ = 0;
  can_backward_ = false;
}

}  // namespace loom::model

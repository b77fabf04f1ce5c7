#include "model/kv_cache.h"

#include <algorithm>
#include <string>

#include "core/error.h"

namespace loom::model {

namespace {
// One sequence's largest attention call: every cached position as queries and keys.
AttnShape decoder_shape(const GPTConfig& cfg, int64_t t_max) {
  return {.B = 1, .NH = cfg.n_head, .HS = cfg.head_size(), .Tq = t_max, .Tkv = t_max, .q_stride = cfg.qkv_rows(),
          .kv_stride = cfg.kv_heads() * cfg.head_size(), .o_stride = cfg.n_embd, .NKV = cfg.kv_heads()};
}
}  // namespace

KVCache::KVCache(const GPTConfig& cfg, int64_t B, int64_t t_max, Backend& be)
    : B_(B), t_max_(t_max), C_(cfg.kv_heads() * cfg.head_size()) {
  LOOM_CHECK(B > 0, "KV cache: batch must be positive, got {}", B);
  LOOM_CHECK(t_max > 0 && t_max <= cfg.block_size, "KV cache: capacity {} must be in [1, block_size {}]", t_max,
             cfg.block_size);
  for (int64_t l = 0; l < cfg.n_layer; ++l) {
    k_.push_back(be.empty({B, t_max, C_}, be.compute_dtype(), MemTag::activations));
    v_.push_back(be.empty({B, t_max, C_}, be.compute_dtype(), MemTag::activations));
  }
}

int64_t KVCache::bytes() const {
  return k_.empty() ? 0 : 2 * int64_t(k_.size()) * int64_t(k_[0].nbytes());
}

CachedDecoder::CachedDecoder(const GPT& gpt, int64_t B, int64_t t_max)
    : gpt_(gpt), cfg_(gpt.config()), be_(gpt.backend()), cache_(cfg_, B, t_max > 0 ? t_max : cfg_.block_size, be_) {
  const std::vector<ChainBlock*> chain = gpt.chain();
  emb_ = chain.front()->replica(MemTag::workspace);
  head_ = chain.back()->replica(MemTag::workspace);
  if (cfg_.n_layer > 0) layer_ = chain[1]->replica(MemTag::workspace);
}

int64_t CachedDecoder::attention_workspace_bytes(int threads) const {
  return be_.attention_workspace_bytes(be_.compute_dtype(), decoder_shape(cfg_, cache_.t_max_), threads);
}

const Tensor& CachedDecoder::forward(const int32_t* tokens, int64_t T, bool all_logits) {
  const int64_t B = cache_.B_, C = cfg_.n_embd, pos = cache_.len_;
  LOOM_CHECK(T > 0, "decoder: no tokens to run");
  LOOM_CHECK(pos + T <= cache_.t_max_, "decoder: positions [{}, {}) exceed the cache capacity {}", pos, pos + T,
             cache_.t_max_);
  if (!reserved_ && cfg_.n_layer > 0) {  // once: no call this cache allows needs more
    be_.prepare_attention(be_.compute_dtype(), decoder_shape(cfg_, cache_.t_max_));
    reserved_ = true;
  }
  auto& emb = static_cast<Embedding&>(*emb_);
  emb.forward(tokens, B, T, pos);
  const void* x = emb.out().raw();
  const std::vector<ChainBlock*> chain = gpt_.chain();
  for (int64_t l = 0; l < cfg_.n_layer; ++l) {
    auto& blk = static_cast<TransformerBlock&>(*layer_);
    blk.use_parameters_of(static_cast<const TransformerBlock&>(*chain[size_t(l + 1)]));
    const KVStep kv{.k = cache_.k(l), .v = cache_.v(l), .t_max = cache_.t_max_, .pos = pos};
    blk.forward(x, B, T, &kv);
    x = blk.out().raw();
  }
  cache_.len_ = pos + T;

  // Head: ln_f and lm_head over every position or only the last one of each sequence.
  auto& head = static_cast<Head&>(*head_);
  const DType dt = be_.compute_dtype();
  if (all_logits) {
    head.forward(x, nullptr, B, T, false, 1.0f);
  } else {
    if (!last_.defined() || last_.size(0) != B) last_ = be_.empty({B, 1, C}, dt, MemTag::workspace);
    const size_t es = dtype_size(dt);
    for (int64_t b = 0; b < B; ++b)
      be_.copy({.dst = static_cast<char*>(last_.raw()) + b * C * int64_t(es), .dst_dtype = dt,
                .src = static_cast<const char*>(x) + (b * T + T - 1) * C * int64_t(es), .src_dtype = dt, .n = C});
    head.forward(last_.raw(), nullptr, B, 1, false, 1.0f);
  }
  const Tensor& logits = head.logits();
  if (logits.device() == Device::cpu && logits.dtype() == DType::f32) return logits;
  if (!host_logits_.defined() || host_logits_.shape() != logits.shape())
    host_logits_ = Tensor::empty(logits.shape(), DType::f32, MemTag::workspace, default_cpu_pool());
  be_.download(host_logits_.f32(), logits.raw(), logits.dtype(), logits.numel());
  return host_logits_;
}

std::vector<int32_t> generate_cached(const GPT& gpt, const std::vector<int32_t>& prompt, int64_t max_new_tokens,
                                     const TokenSampler& sample, int32_t stop_token) {
  LOOM_CHECK(!prompt.empty(), "generation needs a prompt of at least one token");
  LOOM_CHECK(max_new_tokens >= 0, "generation: max_new_tokens must be non-negative, got {}", max_new_tokens);
  const GPTConfig& cfg = gpt.config();
  const int64_t block = cfg.block_size;
  std::vector<int32_t> ctx = prompt, out;
  if (max_new_tokens == 0) return out;
  CachedDecoder dec(gpt, 1, std::min<int64_t>(block, int64_t(prompt.size()) + max_new_tokens));
  // Prefill: the last block_size tokens of the prompt.
  const int64_t T0 = std::min<int64_t>(int64_t(ctx.size()), block);
  const float* row = dec.forward(ctx.data() + ctx.size() - size_t(T0), T0).f32();
  for (int64_t n = 0; n < max_new_tokens; ++n) {
    const int32_t next = sample(row, uint64_t(ctx.size()));
    ctx.push_back(next);
    out.push_back(next);
    if (next == stop_token || n + 1 == max_new_tokens) break;
    if (int64_t(ctx.size()) <= block) {
      row = dec.forward(&ctx.back(), 1).f32();
    } else {  // the window slides: every position changes, so prefill it again
      dec.reset();
      row = dec.forward(ctx.data() + ctx.size() - size_t(block), block).f32();
    }
  }
  return out;
}

}  // namespace loom::model

#include "model/kv_cache.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "core/error.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/residual.h"

namespace loom::model {

namespace {
// One sequence's attention call: Tq queries from position pos against the Tkv = pos + Tq cached
// keys, q in the packed qkv rows, K and V in the cache rows.
cpu::AttnArgs decoder_args(const GPTConfig& cfg, int64_t Tq, int64_t pos) {
  const int64_t C = cfg.n_embd;
  cpu::AttnArgs aa;
  aa.B = 1;
  aa.NH = cfg.n_head;
  aa.HS = C / cfg.n_head;
  aa.Tq = Tq;
  aa.Tkv = pos + Tq;
  aa.q_stride = 3 * C;
  aa.kv_stride = C;
  aa.o_stride = C;
  aa.q_pos0 = pos;
  aa.kv_pos0 = 0;
  return aa;
}
}  // namespace

KVCache::KVCache(const GPTConfig& cfg, int64_t B, int64_t t_max, MemoryPool& pool)
    : B_(B), t_max_(t_max), C_(cfg.n_embd) {
  LOOM_CHECK(B > 0, "KV cache: batch must be positive, got {}", B);
  LOOM_CHECK(t_max > 0 && t_max <= cfg.block_size, "KV cache: capacity {} must be in [1, block_size {}]", t_max,
             cfg.block_size);
  for (int64_t l = 0; l < cfg.n_layer; ++l) {
    k_.push_back(Tensor::empty({B, t_max, C_}, DType::f32, MemTag::activations, pool));
    v_.push_back(Tensor::empty({B, t_max, C_}, DType::f32, MemTag::activations, pool));
  }
}

int64_t KVCache::bytes() const { return 2 * int64_t(k_.size()) * B_ * t_max_ * C_ * int64_t(sizeof(float)); }

CachedDecoder::CachedDecoder(const GPT& gpt, int64_t B, int64_t t_max)
    : gpt_(gpt), cfg_(gpt.config()), pool_(gpt.pool()), cache_(cfg_, B, t_max > 0 ? t_max : cfg_.block_size, pool_),
      attn_(pool_) {}

int64_t CachedDecoder::attention_workspace_bytes(int threads) const {
  return cpu::attention_workspace_bytes(decoder_args(cfg_, cache_.t_max_, 0), false, threads);
}

void CachedDecoder::ensure_scratch(int64_t T, int64_t rows_out) {
  const int64_t B = cache_.B_, C = cfg_.n_embd;
  if (T != T_) {
    auto ws = [&](const Shape& s) { return Tensor::empty(s, DType::f32, MemTag::workspace, pool_); };
    x_ = ln_ = qkv_ = atty_ = fch_ = lse_ = Tensor();
    x_ = ws({B, T, C});
    ln_ = ws({B, T, C});
    qkv_ = ws({B, T, 3 * C});
    atty_ = ws({B, T, C});
    fch_ = ws({B, T, 4 * C});
    lse_ = ws({cfg_.n_head, T});
    T_ = T;
  }
  if (rows_out != rows_out_) {
    lnf_ = logits_ = Tensor();
    lnf_ = Tensor::empty({rows_out, C}, DType::f32, MemTag::workspace, pool_);
    logits_ = Tensor::empty({rows_out, cfg_.padded_vocab()}, DType::f32, MemTag::workspace, pool_);
    rows_out_ = rows_out;
  }
}

const Tensor& CachedDecoder::forward(const int32_t* tokens, int64_t T, bool all_logits) {
  const int64_t B = cache_.B_, C = cfg_.n_embd, BT = B * T, pos = cache_.len_;
  LOOM_CHECK(T > 0, "decoder: no tokens to run");
  LOOM_CHECK(pos + T <= cache_.t_max_, "decoder: positions [{}, {}) exceed the cache capacity {}", pos, pos + T,
             cache_.t_max_);
  const int64_t rows_out = all_logits ? BT : B;
  ensure_scratch(T, rows_out);
  attn_.reserve(attention_workspace_bytes(omp_get_max_threads()));  // once: no call needs more
  auto w = [&](const std::string& name) -> const float* { return gpt_.parameter(name).value.f32(); };

  float* x = x_.f32();      // f32 [B, T, C] residual stream
  float* ln = ln_.f32();    // f32 [B, T, C]
  float* qkv = qkv_.f32();  // f32 [B, T, 3C]
  float* atty = atty_.f32();
  float* fch = fch_.f32();  // f32 [B, T, 4C]
  cpu::embedding_forward(x, tokens, w("wte.weight"), w("wpe.weight"), B, T, C, cfg_.vocab_size, pos);

  for (int64_t l = 0; l < cfg_.n_layer; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    cpu::layernorm_forward(ln, nullptr, nullptr, x, w(p + "ln_1.weight"), w(p + "ln_1.bias"), BT, C, cfg_.ln_eps);
    cpu::matmul_forward(qkv, ln, w(p + "attn.c_attn.weight"), w(p + "attn.c_attn.bias"), BT, C, 3 * C);
    // Append this call's keys and values at positions [pos, pos + T) of every sequence.
    float* kc = cache_.k(l);  // f32 [B, T_max, C]
    float* vc = cache_.v(l);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        const float* row = qkv + (b * T + t) * 3 * C;
        std::memcpy(kc + (b * cache_.t_max_ + pos + t) * C, row + C, size_t(C) * sizeof(float));
        std::memcpy(vc + (b * cache_.t_max_ + pos + t) * C, row + 2 * C, size_t(C) * sizeof(float));
      }
    const cpu::AttnArgs aa = attn_.args(decoder_args(cfg_, T, pos));
    for (int64_t b = 0; b < B; ++b)
      cpu::attention_forward(atty + b * T * C, lse_.f32(), qkv + b * T * 3 * C, kc + b * cache_.t_max_ * C,
                             vc + b * cache_.t_max_ * C, aa);
    // x += c_proj(atty); x += mlp(ln_2(x)). ln holds the projection before the residual add.
    cpu::matmul_forward(ln, atty, w(p + "attn.c_proj.weight"), w(p + "attn.c_proj.bias"), BT, C, C);
    cpu::residual_forward(x, x, ln, BT * C);
    cpu::layernorm_forward(ln, nullptr, nullptr, x, w(p + "ln_2.weight"), w(p + "ln_2.bias"), BT, C, cfg_.ln_eps);
    cpu::matmul_forward(fch, ln, w(p + "mlp.c_fc.weight"), w(p + "mlp.c_fc.bias"), BT, C, 4 * C);
    cpu::gelu_forward(fch, fch, BT * 4 * C);
    cpu::matmul_forward(ln, fch, w(p + "mlp.c_proj.weight"), w(p + "mlp.c_proj.bias"), BT, 4 * C, C);
    cpu::residual_forward(x, x, ln, BT * C);
  }
  cache_.len_ = pos + T;

  // Head: ln_f and lm_head over every position or only the last one of each sequence.
  const float* head_in = x;
  if (!all_logits) {
    for (int64_t b = 0; b < B; ++b)
      std::memcpy(ln + b * C, x + (b * T + T - 1) * C, size_t(C) * sizeof(float));
    head_in = ln;
  }
  cpu::layernorm_forward(lnf_.f32(), nullptr, nullptr, head_in, w("ln_f.weight"), w("ln_f.bias"), rows_out, C,
                         cfg_.ln_eps);
  const Parameter& lm_head = gpt_.parameter(cfg_.tied_embeddings ? "wte.weight" : "lm_head.weight");
  cpu::matmul_forward(logits_.f32(), lnf_.f32(), lm_head.value_full.f32(), nullptr, rows_out, C,
                      cfg_.padded_vocab());
  return logits_;
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

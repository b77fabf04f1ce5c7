#include "model/config.h"

#include <cmath>

#include <fmt/format.h>

#include "core/error.h"

namespace loom::model {

std::string_view norm_name(Norm n) { return n == Norm::rmsnorm ? "rmsnorm" : "layernorm"; }
std::string_view mlp_name(Mlp m) { return m == Mlp::swiglu ? "swiglu" : "gelu"; }
std::string_view position_name(Position p) { return p == Position::rope ? "rope" : "learned"; }

Norm norm_from_name(std::string_view s, std::string_view where) {
  if (s == "layernorm") return Norm::layernorm;
  if (s == "rmsnorm") return Norm::rmsnorm;
  throw Error(fmt::format("{}: '{}' is not layernorm or rmsnorm", where, s));
}

Mlp mlp_from_name(std::string_view s, std::string_view where) {
  if (s == "gelu") return Mlp::gelu;
  if (s == "swiglu") return Mlp::swiglu;
  throw Error(fmt::format("{}: '{}' is not gelu or swiglu", where, s));
}

Position position_from_name(std::string_view s, std::string_view where) {
  if (s == "learned") return Position::learned;
  if (s == "rope") return Position::rope;
  throw Error(fmt::format("{}: '{}' is not learned or rope", where, s));
}

int64_t GPTConfig::nonembedding_parameters() const {
  const int64_t C = n_embd, F = ffn(), norm_params = norm == Norm::layernorm ? 2 * C : C;
  const int64_t weights = qkv_rows() * C + C * C + fc_rows() * C + C * F;
  const int64_t biases = bias ? qkv_rows() + C + fc_rows() + C : 0;
  return n_layer * (2 * norm_params + weights + biases) + norm_params;
}

void GPTConfig::validate(std::string_view where) const {
  auto positive = [&](int64_t v, const char* field) {
    if (v <= 0) throw Error(fmt::format("{}: {} must be positive, got {}", where, field, v));
  };
  positive(n_layer, "n_layer");
  positive(n_head, "n_head");
  positive(n_embd, "n_embd");
  positive(vocab_size, "vocab_size");
  positive(block_size, "block_size");
  if (n_embd % n_head != 0)
    throw Error(fmt::format("{}: n_embd ({}) must be a multiple of n_head ({})", where, n_embd, n_head));
  if (vocab_size > int64_t(INT32_MAX))
    throw Error(fmt::format("{}: vocab_size {} does not fit token ids of 32 bits", where, vocab_size));
  if (!(ln_eps > 0) || !std::isfinite(ln_eps))
    throw Error(fmt::format("{}: ln_eps must be positive and finite, got {}", where, ln_eps));
  if (!(init_std > 0)) throw Error(fmt::format("{}: init_std must be positive, got {}", where, init_std));
  if (n_kv_head < 0) throw Error(fmt::format("{}: n_kv_head must be non-negative (0: n_head), got {}", where, n_kv_head));
  if (n_head % kv_heads() != 0)
    throw Error(fmt::format("{}: n_kv_head ({}) must divide n_head ({}) (grouped-query attention: each key/value head "
                            "serves n_head / n_kv_head query heads)",
                            where, kv_heads(), n_head));
  if (ffn_hidden < 0) throw Error(fmt::format("{}: ffn_hidden must be non-negative (0: 4 n_embd), got {}", where, ffn_hidden));
  if (position == Position::rope) {
    if (head_size() % 2 != 0)
      throw Error(fmt::format("{}: rotary embeddings rotate pairs of a head's elements: the head size n_embd / n_head "
                              "= {} must be even",
                              where, head_size()));
    // (The smaller of the two backends' limits, kernels/cpu/rope.h and kernels/cuda/llama.cuh, so
    // that a model trains on both.)
    constexpr int64_t kRopeMaxHead = 256;
    if (head_size() > kRopeMaxHead)
      throw Error(fmt::format("{}: rotary embeddings take head sizes up to {}, got {}", where, kRopeMaxHead, head_size()));
    // (What rope_inv_freq, core/backend.h, requires.)
    if (!(rope_theta > 1) || !std::isfinite(rope_theta))
      throw Error(fmt::format("{}: rope_theta must be finite and exceed 1, got {}", where, rope_theta));
    if (!(rope_scaling_factor >= 0))
      throw Error(fmt::format("{}: rope_scaling_factor must be non-negative (0: no scaling), got {}", where,
                              rope_scaling_factor));
    if (rope_scaling_factor > 0 && !(rope_high_freq_factor > rope_low_freq_factor && rope_low_freq_factor > 0 &&
                                     rope_original_max_position > 0))
      throw Error(fmt::format("{}: rope scaling needs 0 < rope_low_freq_factor ({}) < rope_high_freq_factor ({}) and "
                              "a positive rope_original_max_position ({})",
                              where, rope_low_freq_factor, rope_high_freq_factor, rope_original_max_position));
  }
}

std::string GPTConfig::str() const {
  std::string s = fmt::format("{}: n_layer={} n_head={} n_embd={} vocab_size={} (padded {}) block_size={}{}", name,
                              n_layer, n_head, n_embd, vocab_size, padded_vocab(), block_size,
                              tied_embeddings ? " tied" : " untied");
  if (is_gpt2()) return s;
  s += fmt::format(" {} {} ffn_hidden={}", norm_name(norm), mlp_name(mlp), ffn());
  if (kv_heads() != n_head) s += fmt::format(" n_kv_head={}", kv_heads());
  if (position == Position::rope) s += fmt::format(" rope(theta={})", rope_theta);
  if (!bias) s += " no-bias";
  return s;
}

namespace {
struct Preset {
  const char* name;
  const char* alias;
  int64_t L, H, C, V, T;
  bool llama = false;
  int64_t KV = 0, F = 0;
  bool tied = true;
};
constexpr Preset kPresets[] = {
    {"gpt2-tiny", "", 2, 4, 64, 503, 64},
    {"gpt2-124m", "gpt2", 12, 12, 768, 50257, 1024},
    {"gpt2-350m", "gpt2-medium", 24, 16, 1024, 50257, 1024},
    {"gpt2-774m", "gpt2-large", 36, 20, 1280, 50257, 1024},
    {"gpt2-1558m", "gpt2-xl", 48, 25, 1600, 50257, 1024},
    {"llama-tiny", "", 2, 4, 64, 503, 64, true, 2, 176, false},
    {"llama-10m", "", 6, 6, 384, 4096, 128, true, 2, 1024, true},
    {"smollm-135m", "", 30, 9, 576, 49152, 2048, true, 3, 1536, true},
    {"tinyllama-1.1b", "", 22, 32, 2048, 32000, 2048, true, 4, 5632, false},
};
}  // namespace

GPTConfig gpt_preset(std::string_view name) {
  if (name == "gpt2-1.5b") name = "gpt2-1558m";  // (loom plan's name for it)
  for (const auto& p : kPresets) {
    if (name == p.name || (p.alias[0] && name == p.alias)) {
      GPTConfig c;
      c.name = p.name;
      c.n_layer = p.L;
      c.n_head = p.H;
      c.n_embd = p.C;
      c.vocab_size = p.V;
      c.block_size = p.T;
      if (p.llama) {
        c.norm = Norm::rmsnorm;
        c.mlp = Mlp::swiglu;
        c.position = Position::rope;
        c.bias = false;
        c.n_kv_head = p.KV;
        c.ffn_hidden = p.F;
        c.tied_embeddings = p.tied;
      }
      return c;
    }
  }
  std::string known;
  for (const auto& n : gpt_preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw Error(fmt::format("unknown model '{}' (known: {})", name, known));
}

std::vector<std::string> gpt_preset_names() {
  std::vector<std::string> out;
  for (const auto& p : kPresets) out.push_back(p.name);
  return out;
}

}  // namespace loom::model

#include "model/config.h"

#include <fmt/format.h>

#include "core/error.h"

namespace loom::model {

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
  if (!(ln_eps > 0)) throw Error(fmt::format("{}: ln_eps must be positive, got {}", where, ln_eps));
  if (!(init_std > 0)) throw Error(fmt::format("{}: init_std must be positive, got {}", where, init_std));
}

std::string GPTConfig::str() const {
  return fmt::format("{}: n_layer={} n_head={} n_embd={} vocab_size={} (padded {}) block_size={}{}", name, n_layer,
                     n_head, n_embd, vocab_size, padded_vocab(), block_size, tied_embeddings ? " tied" : " untied");
}

namespace {
struct Preset {
  const char* name;
  const char* alias;
  int64_t L, H, C, V, T;
};
constexpr Preset kPresets[] = {
    {"gpt2-tiny", "", 2, 4, 64, 503, 64},
    {"gpt2-124m", "gpt2", 12, 12, 768, 50257, 1024},
    {"gpt2-350m", "gpt2-medium", 24, 16, 1024, 50257, 1024},
    {"gpt2-774m", "gpt2-large", 36, 20, 1280, 50257, 1024},
    {"gpt2-1558m", "gpt2-xl", 48, 25, 1600, 50257, 1024},
};
}  // namespace

GPTConfig gpt_preset(std::string_view name) {
  for (const auto& p : kPresets) {
    if (name == p.name || (p.alias[0] && name == p.alias)) {
      GPTConfig c;
      c.name = p.name;
      c.n_layer = p.L;
      c.n_head = p.H;
      c.n_embd = p.C;
      c.vocab_size = p.V;
      c.block_size = p.T;
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

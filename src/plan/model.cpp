#include "plan/model.h"

#include <bit>
#include <filesystem>
#include <tuple>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "core/error.h"

namespace loom::plan {

int64_t ModelSpec::layer_matrix_params() const {
  const int64_t h = hidden, kvd = kv() * head_dim();
  const int64_t attn = h * h + 2 * h * kvd + h * h;  // q, k, v, o
  const int64_t mlp = (swiglu ? 3 : 2) * h * ffn_size();
  return attn + mlp;
}

int64_t ModelSpec::layer_params() const {
  const int64_t h = hidden, kvd = kv() * head_dim();
  int64_t p = layer_matrix_params();
  p += bias ? 4 * h : 2 * h;  // two norms: LayerNorm's weight and bias, or RMSNorm's weight
  if (bias) p += (h + 2 * kvd) + h + ffn_size() * (swiglu ? 2 : 1) + h;  // qkv, o, up (and gate), down
  return p;
}

int64_t ModelSpec::embedding_params() const { return vocab * hidden + (learned_positions ? seq * hidden : 0); }

int64_t ModelSpec::head_params() const { return (bias ? 2 * hidden : hidden) + (tied ? 0 : vocab * hidden); }

int64_t ModelSpec::params() const { return layers * layer_params() + embedding_params() + head_params(); }

double ModelSpec::layer_forward_flops_per_token() const {
  return 2.0 * double(layer_matrix_params()) + 4.0 * double(seq) * double(hidden);
}

double ModelSpec::head_forward_flops_per_token() const { return 2.0 * double(vocab) * double(hidden); }

double ModelSpec::forward_flops_per_token() const {
  return double(layers) * layer_forward_flops_per_token() + head_forward_flops_per_token();
}

double ModelSpec::model_flops(double tokens) const { return 3.0 * tokens * forward_flops_per_token(); }

void ModelSpec::validate(const std::string& where) const {
  auto positive = [&](int64_t v, const char* field) {
    if (v <= 0) throw Error(fmt::format("{}: model.{} must be a positive integer, got {}", where, field, v));
  };
  positive(layers, "layers");
  positive(hidden, "hidden");
  positive(heads, "heads");
  positive(vocab, "vocab");
  positive(seq, "seq");
  // Sizes whose products stay exact in 64 bits (parameter counts, FLOPs per step) and whose layer
  // lists the planner walks within seconds (its pipeline cuts grow with the square of the layers:
  // 1024 layers take about 8 s, 4096 more than a minute): beyond every published model by far.
  for (const auto& [v, field, most] : {std::tuple{layers, "layers", int64_t(1) << 10},
                                       std::tuple{hidden, "hidden", int64_t(1) << 20},
                                       std::tuple{ffn, "ffn", int64_t(1) << 22},
                                       std::tuple{vocab, "vocab", int64_t(1) << 24},
                                       std::tuple{seq, "seq", int64_t(1) << 24}})
    if (v > most) throw Error(fmt::format("{}: model.{} = {} is more than {} (2^{})", where, field, v, most,
                                          std::countr_zero(uint64_t(most))));
  if (hidden % heads != 0)
    throw Error(fmt::format("{}: model.hidden = {} is not divisible by model.heads = {}", where, hidden, heads));
  if (kv_heads < 0 || kv() > heads || heads % kv() != 0)
    throw Error(fmt::format("{}: model.kv_heads = {} must divide model.heads = {}", where, kv_heads, heads));
  if (ffn < 0) throw Error(fmt::format("{}: model.ffn must be >= 0 (0: 4 x hidden), got {}", where, ffn));
}

std::string ModelSpec::str() const {
  return fmt::format("{} ({} layers, hidden {}, {} heads{}, ffn {}{}, vocabulary {}, sequence {}; {:.2f}B parameters)",
                     name, layers, hidden, heads, kv() != heads ? fmt::format(" / {} kv", kv()) : "", ffn_size(),
                     swiglu ? " SwiGLU" : "", vocab, seq, double(params()) / 1e9);
}

ModelSpec from_gpt(const model::GPTConfig& c, int64_t seq) {
  ModelSpec m;
  m.name = c.name;
  m.layers = c.n_layer;
  m.hidden = c.n_embd;
  m.heads = c.n_head;
  m.vocab = c.vocab_size;
  m.seq = seq;
  m.tied = c.tied_embeddings;
  // The Llama family's options (a GPT-2 model's are the defaults).
  m.kv_heads = c.kv_heads();
  m.ffn = c.ffn();
  m.swiglu = c.mlp == model::Mlp::swiglu;
  m.bias = c.bias;
  m.learned_positions = c.position == model::Position::learned;
  // loom's wpe holds block_size rows whatever the training length.
  m.validate("model " + c.name);
  return m;
}

model::GPTConfig to_gpt(const ModelSpec& m) {
  model::GPTConfig g;
  g.name = m.name;
  g.n_layer = m.layers;
  g.n_head = m.heads;
  g.n_embd = m.hidden;
  g.vocab_size = m.vocab;
  g.block_size = m.seq;
  g.tied_embeddings = m.tied;
  g.n_kv_head = m.kv_heads;
  g.ffn_hidden = m.ffn;
  g.mlp = m.swiglu ? model::Mlp::swiglu : model::Mlp::gelu;
  g.bias = m.bias;
  g.position = m.learned_positions ? model::Position::learned : model::Position::rope;
  if (!m.bias) g.norm = model::Norm::rmsnorm;
  return g;
}

ModelSpec read_model(const std::string& path) {
  toml::table t;
  try {
    t = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    throw Error(fmt::format("{}: {} (line {})", path, e.description(), e.source().begin.line));
  }
  const toml::table* m = t["model"].as_table();
  if (!m) throw Error(fmt::format("{}: no [model] table", path));
  for (auto&& [k, v] : t)
    if (k.str() != "model")
      throw Error(fmt::format("{}: unknown {} '{}' (a model file holds a [model] table alone)", path,
                              v.is_table() ? "table" : "key", std::string(k.str())));
  ModelSpec s;
  s.name = std::filesystem::path(path).stem().string();
  for (auto&& [k, v] : *m) {
    const std::string key(k.str());
    auto integer = [&]() -> int64_t {
      if (!v.is_integer()) throw Error(fmt::format("{}: model.{} must be an integer", path, key));
      return v.as_integer()->get();
    };
    auto boolean = [&]() -> bool {
      if (!v.is_boolean()) throw Error(fmt::format("{}: model.{} must be true or false", path, key));
      return v.as_boolean()->get();
    };
    if (key == "name") {
      if (!v.is_string()) throw Error(fmt::format("{}: model.name must be a string", path));
      s.name = v.as_string()->get();
    } else if (key == "layers") s.layers = integer();
    else if (key == "hidden") s.hidden = integer();
    else if (key == "heads") s.heads = integer();
    else if (key == "kv_heads") s.kv_heads = integer();
    else if (key == "ffn") s.ffn = integer();
    else if (key == "vocab") s.vocab = integer();
    else if (key == "seq") s.seq = integer();
    else if (key == "swiglu") s.swiglu = boolean();
    else if (key == "tied") s.tied = boolean();
    else if (key == "bias") s.bias = boolean();
    else if (key == "learned_positions") s.learned_positions = boolean();
    else
      throw Error(fmt::format("{}: unknown field model.{} (fields: name, layers, hidden, heads, kv_heads, ffn, vocab, "
                              "seq, swiglu, tied, bias, learned_positions)",
                              path, key));
  }
  s.validate(path);
  return s;
}

ModelSpec model_named(const std::string& name) {
  auto gpt2 = [&](int64_t l, int64_t h, int64_t a) {
    ModelSpec m;
    m.name = name, m.layers = l, m.hidden = h, m.heads = a, m.vocab = 50257, m.seq = 1024;
    return m;
  };
  auto llama = [&](int64_t l, int64_t h, int64_t a, int64_t kv, int64_t ffn, int64_t v, int64_t s) {
    ModelSpec m;
    m.name = name, m.layers = l, m.hidden = h, m.heads = a, m.kv_heads = kv, m.ffn = ffn, m.vocab = v, m.seq = s;
    m.swiglu = true, m.tied = false, m.bias = false, m.learned_positions = false;
    return m;
  };
  if (name == "gpt2-124m") return gpt2(12, 768, 12);
  if (name == "gpt2-350m") return gpt2(24, 1024, 16);
  if (name == "gpt2-774m") return gpt2(36, 1280, 20);
  if (name == "gpt2-1.5b") return gpt2(48, 1600, 25);
  if (name == "llama-7b") return llama(32, 4096, 32, 32, 11008, 32000, 4096);
  if (name == "llama-70b") return llama(80, 8192, 64, 8, 28672, 32000, 4096);
  if (name == "llama3-405b") return llama(126, 16384, 128, 8, 53248, 128256, 8192);
  if (std::filesystem::exists(name)) return read_model(name);
  // The presets `loom train` builds (gpt2-tiny, gpt2-1558m, smollm-135m, ...), at their block_size.
  for (const std::string& n : model::gpt_preset_names())
    if (n == name) {
      const model::GPTConfig c = model::gpt_preset(name);
      return from_gpt(c, c.block_size);
    }
  std::string trains;
  for (const std::string& n : model::gpt_preset_names()) trains += ", " + n;
  throw Error(fmt::format("--model {}: neither a preset (gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b, llama-7b, "
                          "llama-70b, llama3-405b{}), a model file nor a loom train config",
                          name, trains));
}

}  // namespace loom::plan

#include "train/hf_gpt2.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <cmath>
#include <limits>
#include <map>
#include <set>

#include "core/error.h"
#include "train/safetensors.h"

namespace fs = std::filesystem;

namespace loom::model {

namespace {

using json = nlohmann::json;

constexpr const char* kPrefix = "transformer.";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The causal-mask buffers some GPT-2 files carry: h.<digits>.attn.bias / attn.masked_bias.
bool is_mask_buffer(const std::string& key) {
  if (key.rfind("h.", 0) != 0) return false;
  size_t i = 2;
  while (i < key.size() && key[i] >= '0' && key[i] <= '9') ++i;
  if (i == 2) return false;
  std::string rest = key.substr(i);
  return rest == ".attn.bias" || rest == ".attn.masked_bias";
}

void write_file_atomically(const std::string& path, const std::string& text) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw Error(fmt::format("{}: cannot open for writing", tmp));
    f << text;
    f.flush();
    if (!f) throw Error(fmt::format("{}: write failed", tmp));
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) throw Error(fmt::format("{}: cannot rename from {}: {}", path, tmp, ec.message()));
}

// A float as the shortest decimal that reads back to it (1e-05, not 9.999999747378752e-06).
double shortest(float f) { return std::stod(fmt::format("{}", f)); }

}  // namespace

HfKey hf_key(const std::string& loom_name) {
  static const char* kConv1d[] = {".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight",
                                  ".mlp.c_proj.weight"};
  HfKey k{loom_name, false};
  if (loom_name.rfind("h.", 0) == 0)
    for (const char* s : kConv1d) k.conv1d = k.conv1d || ends_with(loom_name, s);
  return k;
}

Shape hf_shape(const ParamSpec& spec) {
  if (hf_key(spec.name).conv1d) {
    LOOM_CHECK(spec.shape.size() == 2, "parameter '{}' is not a matrix", spec.name);
    return {spec.shape[1], spec.shape[0]};
  }
  return spec.shape;
}

void transpose_2d(const float* in, float* out, int64_t rows, int64_t cols) {
  constexpr int64_t kTile = 32;
  for (int64_t r0 = 0; r0 < rows; r0 += kTile)
    for (int64_t c0 = 0; c0 < cols; c0 += kTile)
      for (int64_t r = r0; r < std::min(rows, r0 + kTile); ++r)
        for (int64_t c = c0; c < std::min(cols, c0 + kTile); ++c) out[c * rows + r] = in[r * cols + c];
}

GPTConfig gpt_config_from_hf(const json& j, const std::string& where) {
  if (!j.is_object()) throw Error(fmt::format("{}: config must be a JSON object", where));
  auto integer = [&](const char* key, bool required, int64_t fallback) -> int64_t {
    if (!j.contains(key) || j[key].is_null()) {
      if (required) throw Error(fmt::format("{}: missing field '{}'", where, key));
      return fallback;
    }
    if (!j[key].is_number_integer()) throw Error(fmt::format("{}: field '{}' must be an integer", where, key));
    return j[key].get<int64_t>();
  };
  if (j.contains("model_type") && j["model_type"] != "gpt2")
    throw Error(fmt::format("{}: field 'model_type' is {}, loom imports gpt2", where, j["model_type"].dump()));
  GPTConfig c;
  c.name = "hf-gpt2";
  c.n_layer = integer("n_layer", true, 0);
  c.n_head = integer("n_head", true, 0);
  c.n_embd = integer("n_embd", true, 0);
  c.vocab_size = integer("vocab_size", true, 0);
  const bool has_positions = j.contains("n_positions") && !j["n_positions"].is_null();
  c.block_size = integer(has_positions ? "n_positions" : "n_ctx", true, 0);
  if (j.contains("layer_norm_epsilon")) {
    if (!j["layer_norm_epsilon"].is_number())
      throw Error(fmt::format("{}: field 'layer_norm_epsilon' must be a number", where));
    const double eps = j["layer_norm_epsilon"].get<double>();
    // loom keeps epsilon as an f32: a value that does not fit one (inf, or 0 after rounding) would
    // be written into a manifest that loom then refuses.
    if (!(eps > 0) || !std::isfinite(float(eps)) || !(float(eps) > 0.f))
      throw Error(fmt::format("{}: field 'layer_norm_epsilon' is {}: it must be positive and fit a 32-bit float "
                              "(at most {:.6g})",
                              where, eps, double(std::numeric_limits<float>::max())));
    c.ln_eps = float(eps);
  }
  if (j.contains("activation_function")) {
    const json& a = j["activation_function"];
    if (!a.is_string() || (a != "gelu_new" && a != "gelu_pytorch_tanh"))
      throw Error(fmt::format("{}: field 'activation_function' is {}; loom's GPT-2 uses the tanh GELU "
                              "(gelu_new or gelu_pytorch_tanh)", where, a.dump()));
  }
  if (j.contains("tie_word_embeddings")) {
    if (!j["tie_word_embeddings"].is_boolean())
      throw Error(fmt::format("{}: field 'tie_word_embeddings' must be true or false", where));
    c.tied_embeddings = j["tie_word_embeddings"].get<bool>();
  }
  const int64_t n_inner = integer("n_inner", false, 4 * c.n_embd);
  if (n_inner != 4 * c.n_embd)
    throw Error(fmt::format("{}: field 'n_inner' is {}; loom's MLP is 4 * n_embd = {} wide", where, n_inner,
                            4 * c.n_embd));
  auto refuse_true = [&](const char* key, const char* why) {
    if (j.contains(key) && j[key].is_boolean() && j[key].get<bool>())
      throw Error(fmt::format("{}: field '{}' is true; {}", where, key, why));
  };
  refuse_true("add_cross_attention", "loom's GPT-2 has no cross-attention");
  refuse_true("scale_attn_by_inverse_layer_idx", "loom scales attention by 1/sqrt(head size) only");
  if (j.contains("scale_attn_weights") && j["scale_attn_weights"].is_boolean() && !j["scale_attn_weights"].get<bool>())
    throw Error(fmt::format("{}: field 'scale_attn_weights' is false; loom always scales by 1/sqrt(head size)", where));
  c.validate(where);
  return c;
}

GPTConfig read_hf_config(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw Error(fmt::format("{}: cannot open config", path));
  json j;
  try {
    j = json::parse(f);
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: malformed JSON: {}", path, e.what()));
  }
  return gpt_config_from_hf(j, path);
}

json hf_config_json(const GPTConfig& c) {
  json j = {{"architectures", {"GPT2LMHeadModel"}},
            {"model_type", "gpt2"},
            {"activation_function", "gelu_new"},
            {"n_layer", c.n_layer},
            {"n_head", c.n_head},
            {"n_embd", c.n_embd},
            {"n_inner", nullptr},
            {"vocab_size", c.vocab_size},
            {"n_positions", c.block_size},
            {"n_ctx", c.block_size},
            {"layer_norm_epsilon", shortest(c.ln_eps)},
            {"initializer_range", shortest(c.init_std)},
            {"resid_pdrop", 0.0},
            {"embd_pdrop", 0.0},
            {"attn_pdrop", 0.0},
            {"scale_attn_weights", true},
            {"scale_attn_by_inverse_layer_idx", false},
            {"reorder_and_upcast_attn", false},
            {"tie_word_embeddings", c.tied_embeddings},
            {"use_cache", true},
            {"torch_dtype", "float32"}};
  if (c.vocab_size == 50257) {  // GPT-2's own vocabulary: <|endoftext|> is 50256
    j["bos_token_id"] = 50256;
    j["eos_token_id"] = 50256;
  }
  return j;
}

void load_hf_gpt2(const std::string& path, GPT& gpt) {
  const train::SafetensorsReader r(path);
  const GPTConfig& cfg = gpt.config();

  // Keys of the file by their unprefixed name.
  std::map<std::string, std::string> keys;
  for (const auto& e : r.entries()) {
    std::string k = e.name.rfind(kPrefix, 0) == 0 ? e.name.substr(std::strlen(kPrefix)) : e.name;
    if (!keys.emplace(k, e.name).second)
      throw Error(fmt::format("{}: tensor '{}' appears both with and without the '{}' prefix", path, k, kPrefix));
  }
  std::set<std::string> used;
  for (Parameter* p : gpt.parameters()) {
    const HfKey k = hf_key(p->spec.name);
    auto it = keys.find(k.name);
    if (it == keys.end())
      throw Error(fmt::format("{}: missing tensor '{}' (GPT-2 with n_layer={}, tied_embeddings={})", path, k.name,
                              cfg.n_layer, cfg.tied_embeddings));
    const train::SafetensorsEntry& e = r.entry(it->second);
    const Shape want = hf_shape(p->spec);
    if (e.shape != want)
      throw Error(fmt::format("{}: tensor '{}' has shape {}, expected {}{}", path, e.name, shape_str(e.shape),
                              shape_str(want), k.conv1d ? " (Conv1D layout [in, out])" : ""));
    if (e.dtype != DType::f32 && e.dtype != DType::f16 && e.dtype != DType::bf16)
      throw Error(fmt::format("{}: tensor '{}' has dtype {}, expected F32, F16 or BF16", path, e.name,
                              dtype_name(e.dtype)));
    std::vector<float> v = r.read_f32(e.name);  // f32 [hf shape]
    if (k.conv1d) transpose_2d(v.data(), p->value.f32(), want[0], want[1]);
    else std::memcpy(p->value.f32(), v.data(), v.size() * sizeof(float));
    used.insert(k.name);
  }
  for (const auto& [k, full] : keys) {
    if (used.count(k) || is_mask_buffer(k)) continue;
    if (k == "lm_head.weight" && cfg.tied_embeddings) {
      // A tied head saved explicitly: it must be wte, or the file is not a tied model.
      const Parameter& wte = gpt.parameter("wte.weight");
      const train::SafetensorsEntry& e = r.entry(full);
      if (e.shape != wte.spec.shape)
        throw Error(fmt::format("{}: tensor '{}' has shape {}, expected {} (tied to wte.weight)", path, full,
                                shape_str(e.shape), shape_str(wte.spec.shape)));
      std::vector<float> v = r.read_f32(full);
      if (std::memcmp(v.data(), wte.value.f32(), v.size() * sizeof(float)) != 0)
        throw Error(fmt::format("{}: tensor '{}' differs from wte.weight but the config ties them "
                                "(set tie_word_embeddings to false)", path, full));
      continue;
    }
    throw Error(fmt::format("{}: unexpected tensor '{}' (not a GPT-2 parameter of this config)", path, full));
  }
}

void save_hf_gpt2(const GPT& gpt, const std::string& out_dir) {
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) throw Error(fmt::format("{}: cannot create directory: {}", out_dir, ec.message()));
  train::SafetensorsWriter w;
  std::vector<std::vector<float>> transposed;  // kept alive until write()
  transposed.reserve(gpt.parameters().size());
  for (Parameter* p : gpt.parameters()) {
    const HfKey k = hf_key(p->spec.name);
    const Shape shape = hf_shape(p->spec);
    if (k.conv1d) {
      transposed.emplace_back(size_t(p->spec.numel()));
      transpose_2d(p->value.f32(), transposed.back().data(), p->spec.shape[0], p->spec.shape[1]);
      w.add(k.name, DType::f32, shape, transposed.back().data());
    } else {
      w.add(k.name, DType::f32, shape, p->value.f32());
    }
  }
  w.set_metadata("format", "pt");  // transformers refuses safetensors files without it
  const std::string st = (fs::path(out_dir) / "model.safetensors").string();
  const std::string cj = (fs::path(out_dir) / "config.json").string();
  // Both files complete under temporary names before either replaces what is there.
  w.write(st + ".partial");
  try {
    write_file_atomically(cj + ".partial", hf_config_json(gpt.config()).dump(2) + "\n");
  } catch (...) {
    fs::remove(st + ".partial", ec);
    throw;
  }
  fs::rename(st + ".partial", st, ec);
  if (ec) throw Error(fmt::format("{}: cannot rename from {}.partial: {}", st, st, ec.message()));
  fs::rename(cj + ".partial", cj, ec);
  if (ec) throw Error(fmt::format("{}: cannot rename from {}.partial: {}", cj, cj, ec.message()));
}

}  // namespace loom::model

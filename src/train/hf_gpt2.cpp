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
#include "core/file.h"
#include "model/param_specs.h"
#include "train/checkpoint.h"
#include "train/checkpoint_io.h"
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

// A float as the shortest decimal that reads back to it (1e-05, not 9.999999747378752e-06).

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
    std::vector<float> v = r.read_finite_f32(e.name);  // f32 [hf shape]
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

void save_hf_gpt2(const GPTConfig& cfg, const std::function<void(const ParamSpec&, float*)>& values,
                  const std::string& out_dir) {
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) throw Error(fmt::format("{}: cannot create directory: {}", out_dir, ec.message()));
  train::SafetensorsWriter w;
  for (const ParamSpec& spec : gpt_param_specs(cfg)) {
    const HfKey k = hf_key(spec.name);
    w.add_lazy(k.name, DType::f32, hf_shape(spec), [spec, conv1d = k.conv1d, &values](void* dst) {
      float* out = static_cast<float*>(dst);
      if (!conv1d) return values(spec, out);
      std::vector<float> v(size_t(spec.numel()));
      values(spec, v.data());
      transpose_2d(v.data(), out, spec.shape[0], spec.shape[1]);
    });
  }
  w.set_metadata("format", "pt");  // transformers refuses safetensors files without it
  const std::string st = (fs::path(out_dir) / "model.safetensors").string();
  const std::string cj = (fs::path(out_dir) / "config.json").string();
  // Both files complete under temporary names before either replaces what is there.
  w.write(st + ".partial");
  try {
    write_file_atomically(cj + ".partial", hf_config_json(cfg).dump(2) + "\n");
  } catch (...) {
    fs::remove(st + ".partial", ec);
    throw;
  }
  fs::rename(st + ".partial", st, ec);
  if (ec) throw Error(fmt::format("{}: cannot rename from {}.partial: {}", st, st, ec.message()));
  fs::rename(cj + ".partial", cj, ec);
  if (ec) throw Error(fmt::format("{}: cannot rename from {}.partial: {}", cj, cj, ec.message()));
}

void save_hf_gpt2(const GPT& gpt, const std::string& out_dir) {
  std::map<std::string, const Parameter*> by_name;
  for (const Parameter* p : gpt.parameters()) by_name[p->spec.name] = p;
  save_hf_gpt2(
      gpt.config(),
      [&](const ParamSpec& spec, float* dst) {
        const Parameter* p = by_name.at(spec.name);
        std::memcpy(dst, p->value.f32(), size_t(spec.numel()) * sizeof(float));
      },
      out_dir);
}

void save_hf_gpt2_from_checkpoint(const std::string& ckpt, const std::string& out_dir) {
  train::CheckpointReader r(ckpt);
  save_hf_gpt2(
      checkpoint_model_config(ckpt),
      [&](const ParamSpec& spec, float* dst) { read_checkpoint_param(r, ckpt, spec, dst); }, out_dir);
}

}  // namespace loom::model

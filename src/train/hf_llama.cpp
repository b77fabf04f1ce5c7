#include "train/hf_llama.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/file.h"
#include "model/param_specs.h"
#include "train/hf_config.h"
#include "train/safetensors.h"

namespace fs = std::filesystem;

namespace loom::model {

namespace {

using json = nlohmann::json;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// model.layers.<i>.self_attn.rotary_emb.inv_freq: a buffer, not a parameter.
bool is_rotary_buffer(const std::string& key) { return ends_with(key, ".rotary_emb.inv_freq"); }

}  // namespace

std::vector<HfPart> hf_llama_parts(const GPTConfig& cfg) {
  LOOM_CHECK(is_llama(cfg), "model '{}' is not the Llama architecture ({})", cfg.name, cfg.str());
  const int64_t HS = cfg.head_size(), Q = cfg.n_head * HS, KV = cfg.kv_heads() * HS, F = cfg.ffn();
  std::vector<HfPart> out;
  for (const ParamSpec& s : gpt_param_specs(cfg)) {
    const bool matrix = s.shape.size() == 2;
    auto part = [&](std::string hf, int64_t row0, int64_t rows) {
      Shape shape = matrix ? Shape{rows, s.shape[1]} : Shape{rows};
      out.push_back({std::move(hf), s.name, row0, rows, std::move(shape)});
    };
    auto whole = [&](std::string hf) { part(std::move(hf), 0, s.shape[0]); };
    if (s.name == "wte.weight") { whole("model.embed_tokens.weight"); continue; }
    if (s.name == "ln_f.weight") { whole("model.norm.weight"); continue; }
    if (s.name == "lm_head.weight") { whole("lm_head.weight"); continue; }
    // h.<i>.<rest>
    const size_t dot = s.name.find('.', 2);
    const std::string layer = s.name.substr(2, dot - 2), rest = s.name.substr(dot + 1);
    const std::string p = "model.layers." + layer + ".";
    const std::string kind = matrix ? "weight" : "bias";
    if (rest == "ln_1.weight") whole(p + "input_layernorm.weight");
    else if (rest == "ln_2.weight") whole(p + "post_attention_layernorm.weight");
    else if (rest.starts_with("attn.c_attn.")) {
      part(p + "self_attn.q_proj." + kind, 0, Q);
      part(p + "self_attn.k_proj." + kind, Q, KV);
      part(p + "self_attn.v_proj." + kind, Q + KV, KV);
    } else if (rest.starts_with("attn.c_proj.")) whole(p + "self_attn.o_proj." + kind);
    else if (rest.starts_with("mlp.c_fc.")) {
      part(p + "mlp.gate_proj." + kind, 0, F);
      part(p + "mlp.up_proj." + kind, F, F);
    } else if (rest.starts_with("mlp.c_proj.")) whole(p + "mlp.down_proj." + kind);
    else LOOM_FAIL("hf_llama_parts: no Hugging Face name for parameter '{}'", s.name);
  }
  return out;
}

HfFiles hf_files(const std::string& path) {
  HfFiles f;
  std::string index;
  if (fs::is_directory(path)) {
    f.dir = path;
    // transformers' order: model.safetensors, else the index of shards.
    if (fs::exists(fs::path(path) / "model.safetensors"))
      f.files.push_back((fs::path(path) / "model.safetensors").string());
    else if (fs::exists(fs::path(path) / "model.safetensors.index.json"))
      index = (fs::path(path) / "model.safetensors.index.json").string();
    else
      throw Error(fmt::format("{}: neither model.safetensors nor model.safetensors.index.json", path));
  } else if (ends_with(path, ".index.json")) {
    index = path;
    f.dir = fs::path(path).parent_path().string();
  } else {
    if (!fs::exists(path)) throw Error(fmt::format("{}: no such file", path));
    f.dir = fs::path(path).parent_path().string();
    f.files.push_back(path);
  }
  if (index.empty()) return f;
  const std::string text = read_file(index);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: malformed JSON: {}", index, e.what()));
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    throw Error(fmt::format("{}: missing field 'weight_map' (an object of tensor -> file)", index));
  std::set<std::string> files;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) throw Error(fmt::format("{}: field 'weight_map.{}' must be a file name", index, name));
    const std::string fname = file.get<std::string>();
    if (fname.empty() || fname.find('/') != std::string::npos || fname == "." || fname == "..")
      throw Error(fmt::format("{}: field 'weight_map.{}' is '{}', not a file beside the index", index, name, fname));
    const std::string full = (fs::path(f.dir) / fname).string();
    f.weight_map[name] = full;
    if (files.insert(full).second) f.files.push_back(full);
  }
  if (f.files.empty()) throw Error(fmt::format("{}: field 'weight_map' lists no tensors", index));
  return f;
}

void load_hf_llama(const std::string& path, GPT& gpt) {
  const GPTConfig& cfg = gpt.config();
  const HfFiles hf = hf_files(path);
  std::map<std::string, std::unique_ptr<train::SafetensorsReader>> readers;
  std::map<std::string, std::string> where;  // tensor -> file, from the files themselves
  for (const std::string& file : hf.files) {
    auto r = std::make_unique<train::SafetensorsReader>(file);
    for (const auto& e : r->entries()) {
      auto it = hf.weight_map.find(e.name);
      if (!hf.weight_map.empty() && (it == hf.weight_map.end() || it->second != file))
        throw Error(fmt::format("{}: tensor '{}' is not listed for this file in the index's weight_map", file, e.name));
      if (!where.emplace(e.name, file).second)
        throw Error(fmt::format("{}: tensor '{}' is also in {}", file, e.name, where[e.name]));
    }
    readers[file] = std::move(r);
  }
  for (const auto& [name, file] : hf.weight_map)
    if (!where.count(name))
      throw Error(fmt::format("{}: tensor '{}' of the index's weight_map is not in the file", file, name));
  std::map<std::string, Parameter*> params;
  for (Parameter* p : gpt.parameters()) params[p->spec.name] = p;
  std::set<std::string> used;
  for (const HfPart& part : hf_llama_parts(cfg)) {
    auto it = where.find(part.hf_name);
    if (it == where.end())
      throw Error(fmt::format("{}: missing tensor '{}' (Llama with n_layer={}, n_kv_head={}, bias={}, tied_embeddings={})",
                              hf.dir.empty() ? path : hf.dir, part.hf_name, cfg.n_layer, cfg.kv_heads(), cfg.bias,
                              cfg.tied_embeddings));
    const train::SafetensorsReader& r = *readers.at(it->second);
    const train::SafetensorsEntry& e = r.entry(part.hf_name);
    if (e.shape != part.shape)
      throw Error(fmt::format("{}: tensor '{}' has shape {}, expected {}", it->second, e.name, shape_str(e.shape),
                              shape_str(part.shape)));
    if (e.dtype != DType::f32 && e.dtype != DType::f16 && e.dtype != DType::bf16)
      throw Error(fmt::format("{}: tensor '{}' has dtype {}, expected F32, F16 or BF16", it->second, e.name,
                              dtype_name(e.dtype)));
    const std::vector<float> v = r.read_finite_f32(e.name);
    Parameter* p = params.at(part.loom_name);
    const int64_t cols = p->spec.shape.size() == 2 ? p->spec.shape[1] : 1;
    std::memcpy(p->value.f32() + part.row0 * cols, v.data(), v.size() * sizeof(float));
    used.insert(part.hf_name);
  }
  // A file's rotary buffers (older transformers saved them) are the frequencies its config gives:
  // within 1e-5 relative of loom's (transformers works them out in f32: a few roundings; bf16 and
  // f16 buffers within theirs), or the config does not describe the model the file was saved from
  // (another rope_theta or scaling).
  const std::vector<double> inv_freq =
      rope_inv_freq(cfg.head_size(), cfg.rope_theta,
                    {cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                     cfg.rope_original_max_position});
  for (const auto& [name, file] : where) {
    if (!is_rotary_buffer(name)) continue;
    const train::SafetensorsEntry& e = readers.at(file)->entry(name);
    if (e.shape != Shape{int64_t(inv_freq.size())})
      throw Error(fmt::format("{}: tensor '{}' has shape {}, expected [{}] (the rotary frequencies of a head of {})",
                              file, name, shape_str(e.shape), inv_freq.size(), cfg.head_size()));
    const std::vector<float> v = readers.at(file)->read_f32(name);
    // (f16's smallest frequencies of a large base are subnormal: spaced 2^-24 apart.)
    const double tol = e.dtype == DType::f32 ? 1e-5 : e.dtype == DType::bf16 ? 8e-3 : 1e-3;
    const double floor = e.dtype == DType::f16 ? std::ldexp(1.0, -24) : 0.0;
    for (size_t i = 0; i < v.size(); ++i)
      if (!(std::abs(double(v[i]) - inv_freq[i]) <= tol * inv_freq[i] + floor))
        throw Error(fmt::format("{}: tensor '{}' gives frequency {} a value of {:.9g} where the config's rotary "
                                "settings (rope_theta {}{}) give {:.9g}: the config does not describe this model",
                                file, name, i, v[i], cfg.rope_theta,
                                cfg.rope_scaling_factor > 0 ? fmt::format(", llama3 scaling factor {}", cfg.rope_scaling_factor)
                                                            : std::string(", no scaling"),
                                inv_freq[i]));
  }
  for (const auto& [name, file] : where) {
    if (used.count(name) || is_rotary_buffer(name)) continue;
    if (name == "lm_head.weight" && cfg.tied_embeddings) {
      // A tied head saved explicitly: it must be the embedding, or the file is not a tied model.
      const Parameter& wte = gpt.parameter("wte.weight");
      const train::SafetensorsEntry& e = readers.at(file)->entry(name);
      if (e.shape != wte.spec.shape)
        throw Error(fmt::format("{}: tensor '{}' has shape {}, expected {} (tied to model.embed_tokens.weight)", file,
                                name, shape_str(e.shape), shape_str(wte.spec.shape)));
      const std::vector<float> v = readers.at(file)->read_f32(name);
      if (std::memcmp(v.data(), wte.value.f32(), v.size() * sizeof(float)) != 0)
        throw Error(fmt::format("{}: tensor '{}' differs from model.embed_tokens.weight but the config ties them "
                                "(set tie_word_embeddings to false)",
                                file, name));
      continue;
    }
    throw Error(fmt::format("{}: unexpected tensor '{}' (not a Llama parameter of this config)", file, name));
  }
}

void save_hf_llama(const GPTConfig& cfg, const std::function<void(const ParamSpec&, float*)>& values,
                   const std::string& out_dir, int64_t max_shard_bytes) {
  LOOM_CHECK(max_shard_bytes > 0, "save_hf_llama: max_shard_bytes must be positive");
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) throw Error(fmt::format("{}: cannot create directory: {}", out_dir, ec.message()));
  const std::vector<HfPart> parts = hf_llama_parts(cfg);
  std::map<std::string, ParamSpec> specs;
  for (const ParamSpec& s : gpt_param_specs(cfg)) specs[s.name] = s;
  // Shards in parameter order, each up to max_shard_bytes (a larger tensor gets one of its own).
  std::vector<std::vector<const HfPart*>> shards(1);
  int64_t bytes = 0, total = 0;
  for (const HfPart& p : parts) {
    const int64_t n = shape_numel(p.shape) * int64_t(sizeof(float));
    if (bytes > 0 && bytes + n > max_shard_bytes) shards.emplace_back(), bytes = 0;
    shards.back().push_back(&p);
    bytes += n;
    total += n;
  }
  // The loom tensor the last part came from (the parts of one tensor are written one after another).
  auto cache_name = std::make_shared<std::string>();
  auto cache = std::make_shared<std::vector<float>>();
  const size_t n_shards = shards.size();
  auto shard_name = [&](size_t k) {
    return n_shards == 1 ? std::string("model.safetensors")
                         : fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, n_shards);
  };
  std::vector<std::string> written;  // temporary files, renamed at the end
  auto discard = [&]() {
    for (const std::string& t : written) fs::remove(t, ec);
  };
  json weight_map = json::object();
  try {
    for (size_t k = 0; k < n_shards; ++k) {
      train::SafetensorsWriter w;
      for (const HfPart* p : shards[k]) {
        const ParamSpec spec = specs.at(p->loom_name);
        w.add_lazy(p->hf_name, DType::f32, p->shape, [p, spec, &values, cache_name, cache](void* dst) {
          if (*cache_name != spec.name) {
            cache->assign(size_t(spec.numel()), 0.f);
            values(spec, cache->data());
            *cache_name = spec.name;
          }
          const int64_t cols = spec.shape.size() == 2 ? spec.shape[1] : 1;
          std::memcpy(dst, cache->data() + p->row0 * cols, size_t(p->rows * cols) * sizeof(float));
        });
        weight_map[p->hf_name] = shard_name(k);
      }
      w.set_metadata("format", "pt");  // transformers refuses safetensors files without it
      const std::string tmp = (fs::path(out_dir) / shard_name(k)).string() + ".partial";
      w.write(tmp);
      written.push_back(tmp);
    }
    auto write_json = [&](const std::string& name, const json& j) {
      const std::string tmp = (fs::path(out_dir) / name).string() + ".partial";
      write_file_atomically(tmp, j.dump(2) + "\n");
      written.push_back(tmp);
    };
    write_json("config.json", hf_config_json(cfg));
    if (n_shards > 1)
      write_json("model.safetensors.index.json", {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}});
  } catch (...) {
    discard();
    throw;
  }
  for (const std::string& t : written) {
    const std::string final_name = t.substr(0, t.size() - std::strlen(".partial"));
    fs::rename(t, final_name, ec);
    if (ec) throw Error(fmt::format("{}: cannot rename from {}: {}", final_name, t, ec.message()));
  }
}

}  // namespace loom::model

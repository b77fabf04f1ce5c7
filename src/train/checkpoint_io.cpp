#include "train/checkpoint_io.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <optional>

#include "core/error.h"
#include "data/shard.h"
#include "model/param_specs.h"
#include "train/checkpoint.h"
#include "train/safetensors.h"

namespace fs = std::filesystem;

namespace loom::model {

// The architecture options are written for every model; a manifest without them (GPT-2's, before
// the options existed) reads as GPT-2.
nlohmann::json gpt_config_manifest(const GPTConfig& c) {
  nlohmann::json j = {{"name", c.name},
          {"n_layer", c.n_layer},
          {"n_head", c.n_head},
          {"n_embd", c.n_embd},
          {"vocab_size", c.vocab_size},
          {"block_size", c.block_size},
          {"tied_embeddings", c.tied_embeddings},
          {"ln_eps", c.ln_eps},
          {"norm", std::string(norm_name(c.norm))},
          {"mlp", std::string(mlp_name(c.mlp))},
          {"position", std::string(position_name(c.position))},
          {"n_kv_head", c.kv_heads()},
          {"ffn_hidden", c.ffn()},
          {"bias", c.bias},
          {"rope_theta", c.rope_theta},
          {"rope_scaling",
           {{"factor", c.rope_scaling_factor},
            {"low_freq_factor", c.rope_low_freq_factor},
            {"high_freq_factor", c.rope_high_freq_factor},
            {"original_max_position", c.rope_original_max_position}}}};
  // A pruned input embedding's rows (the checkpoint's "vocab/kept" says which tokens).
  if (c.kept_tokens) j["input_rows"] = c.input_rows();
  return j;
}

GPTConfig gpt_config_from_manifest(const nlohmann::json& m, const std::string& where) {
  if (!m.is_object()) throw Error(fmt::format("{}: field 'model' must be an object", where));
  auto integer = [&](const char* key) -> int64_t {
    if (!m.contains(key)) throw Error(fmt::format("{}: missing field 'model.{}'", where, key));
    if (!m[key].is_number_integer()) throw Error(fmt::format("{}: field 'model.{}' must be an integer", where, key));
    return m[key].get<int64_t>();
  };
  GPTConfig c;
  if (m.contains("name") && m["name"].is_string()) c.name = m["name"].get<std::string>();
  c.n_layer = integer("n_layer");
  c.n_head = integer("n_head");
  c.n_embd = integer("n_embd");
  c.vocab_size = integer("vocab_size");
  c.block_size = integer("block_size");
  if (m.contains("tied_embeddings")) {
    if (!m["tied_embeddings"].is_boolean())
      throw Error(fmt::format("{}: field 'model.tied_embeddings' must be true or false", where));
    c.tied_embeddings = m["tied_embeddings"].get<bool>();
  }
  if (m.contains("ln_eps")) {
    if (!m["ln_eps"].is_number()) throw Error(fmt::format("{}: field 'model.ln_eps' must be a number", where));
    c.ln_eps = m["ln_eps"].get<float>();
  }
  auto text = [&](const char* key) -> std::string {
    if (!m[key].is_string()) throw Error(fmt::format("{}: field 'model.{}' must be a string", where, key));
    return m[key].get<std::string>();
  };
  auto number = [&](const nlohmann::json& j, const std::string& key) -> double {
    if (!j.is_number()) throw Error(fmt::format("{}: field 'model.{}' must be a number", where, key));
    return j.get<double>();
  };
  const std::string field = where + ": field";
  if (m.contains("norm")) c.norm = norm_from_name(text("norm"), field + " 'model.norm'");
  if (m.contains("mlp")) c.mlp = mlp_from_name(text("mlp"), field + " 'model.mlp'");
  if (m.contains("position")) c.position = position_from_name(text("position"), field + " 'model.position'");
  if (m.contains("n_kv_head")) c.n_kv_head = integer("n_kv_head");
  if (m.contains("ffn_hidden")) c.ffn_hidden = integer("ffn_hidden");
  if (m.contains("bias")) {
    if (!m["bias"].is_boolean()) throw Error(fmt::format("{}: field 'model.bias' must be true or false", where));
    c.bias = m["bias"].get<bool>();
  }
  if (m.contains("rope_theta")) c.rope_theta = number(m["rope_theta"], "rope_theta");
  if (m.contains("rope_scaling")) {
    const nlohmann::json& r = m["rope_scaling"];
    if (!r.is_object()) throw Error(fmt::format("{}: field 'model.rope_scaling' must be an object", where));
    if (r.contains("factor")) c.rope_scaling_factor = number(r["factor"], "rope_scaling.factor");
    if (r.contains("low_freq_factor")) c.rope_low_freq_factor = number(r["low_freq_factor"], "rope_scaling.low_freq_factor");
    if (r.contains("high_freq_factor"))
      c.rope_high_freq_factor = number(r["high_freq_factor"], "rope_scaling.high_freq_factor");
    if (r.contains("original_max_position")) {
      if (!r["original_max_position"].is_number_integer())
        throw Error(fmt::format("{}: field 'model.rope_scaling.original_max_position' must be an integer", where));
      c.rope_original_max_position = r["original_max_position"].get<int64_t>();
    }
  }
  c.validate(where + ": model");
  return c;
}

std::string resolve_checkpoint(const std::string& path) {
  if (!fs::exists(path)) throw Error(fmt::format("{}: no such checkpoint or run directory", path));
  if (fs::exists(fs::path(path) / "manifest.json")) return path;
  std::string c = train::latest_checkpoint(path);
  if (c.empty())
    throw Error(fmt::format("{}: neither a checkpoint (manifest.json) nor a run directory with a 'latest' file", path));
  return c;
}

namespace {

// The manifest's model against the parameters the checkpoint holds, before anything is made from
// it: the same parameters, by name and shape (a pruned input embedding: its kept rows). The
// manifest's checksum covers its text, not its agreement with the tensors.
void check_model_tensors(const GPTConfig& c, const train::CheckpointReader& r, const std::string& manifest) {
  int64_t stored = 0;
  for (const std::string& n : r.names()) stored += n.rfind("param/", 0) == 0;
  const int64_t per_layer = int64_t(block_param_specs(c, 0).size());
  LOOM_CHECK(c.n_layer <= stored / std::max<int64_t>(per_layer, 1),
             "{}: field 'model.n_layer' is {}, but checkpoint {} holds {} parameters ({} per layer)", manifest,
             c.n_layer, r.path(), stored, per_layer);
  const std::vector<ParamSpec> specs = gpt_param_specs(c);
  LOOM_CHECK(int64_t(specs.size()) == stored, "{}: field 'model' ({}) has {} parameters, but checkpoint {} holds {}",
             manifest, c.str(), specs.size(), r.path(), stored);
  for (const ParamSpec& s : specs) {
    const std::string name = "param/" + s.name;
    LOOM_CHECK(r.has(name), "{}: field 'model' ({}) has parameter '{}', which checkpoint {} does not hold", manifest,
               c.str(), s.name, r.path());
    Shape want = s.shape;
    if (s.name == "wte.weight" && r.has("vocab/kept") && r.shape("vocab/kept").size() == 1)
      want[0] = r.shape("vocab/kept")[0];  // a pruned fine-tune keeps the rows it trained
    LOOM_CHECK(r.shape(name) == want,
               "{}: field 'model' ({}) gives parameter '{}' the shape {}, but checkpoint {} holds {}", manifest,
               c.str(), s.name, shape_str(want), r.path(), shape_str(r.shape(name)));
  }
}

}  // namespace

GPTConfig checkpoint_model_config(const std::string& ckpt) {
  train::CheckpointMeta meta = train::read_checkpoint_meta(ckpt);
  const std::string manifest = (fs::path(ckpt) / "manifest.json").string();
  const GPTConfig c = gpt_config_from_manifest(meta.model, manifest);
  check_model_tensors(c, train::CheckpointReader(ckpt), manifest);
  return c;
}

std::string pruned_rows_path(const std::string& run_dir) {
  return (std::filesystem::path(run_dir) / "pruned_rows.safetensors").string();
}

void write_pruned_rows(const std::string& path, const Tensor& table, const std::string& source) {
  train::SafetensorsWriter w;
  w.add("wte.weight", table);
  w.set_metadata("loom", "the input embedding at the start of a pruned fine-tune (model.prune_embedding)");
  w.set_metadata("source", source);
  w.set_metadata("crc32", std::to_string(data::crc32(table.raw(), table.nbytes())));
  w.write(path);
}

namespace {

// The CRC-32 the file's metadata gives (files written before it had one: none).
std::optional<uint32_t> pruned_rows_crc(const train::SafetensorsReader& r) {
  const auto it = r.metadata().find("crc32");
  if (it == r.metadata().end()) return std::nullopt;
  const std::string& s = it->second;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  LOOM_CHECK(!s.empty() && end && *end == '\0' && v <= 0xffffffffull, "{}: metadata 'crc32' is '{}', not a CRC-32",
             r.path(), s);
  return uint32_t(v);
}

// Checks `n` f32 values of the rows' table from element `at` on (finite), and adds them to crc.
void check_rows(const std::string& path, const float* x, int64_t n, int64_t at, uint32_t& crc) {
  for (int64_t i = 0; i < n; ++i)
    LOOM_CHECK(std::isfinite(x[i]),
               "{}: tensor 'wte.weight' holds {} at index {} (the input embedding's rows must be finite)", path, x[i],
               at + i);
  crc = data::crc32(x, size_t(n) * sizeof(float), crc);
}

void check_rows_crc(const train::SafetensorsReader& r, uint32_t crc) {
  if (const auto want = pruned_rows_crc(r))
    LOOM_CHECK(crc == *want,
               "{}: tensor 'wte.weight' does not match the file's CRC-32 (it changed after it was written)", r.path());
}

}  // namespace

void verify_pruned_rows(const std::string& path, const Shape& shape) {
  const train::SafetensorsReader r(path);
  const train::SafetensorsEntry& e = r.entry("wte.weight");
  LOOM_CHECK(e.dtype == DType::f32 && e.shape == shape, "{}: tensor 'wte.weight' is {} {}, expected f32 {}", path,
             dtype_name(e.dtype), shape_str(e.shape), shape_str(shape));
  constexpr int64_t kPiece = int64_t(1) << 20;  // values per read
  std::vector<float> buf(static_cast<size_t>(std::min(kPiece, e.numel())));
  uint32_t crc = 0;
  for (int64_t at = 0; at < e.numel(); at += kPiece) {
    const int64_t n = std::min(kPiece, e.numel() - at);
    r.read_range("wte.weight", uint64_t(at) * sizeof(float), buf.data(), size_t(n) * sizeof(float));
    check_rows(path, buf.data(), n, at, crc);
  }
  check_rows_crc(r, crc);
}

void read_checkpoint_param(train::CheckpointReader& r, const std::string& ckpt, const ParamSpec& spec, float* dst) {
  if (spec.name != "wte.weight" || !r.has("vocab/kept")) {
    r.read("param/" + spec.name, 0, spec.numel(), dst);
    return;
  }
  // A pruned fine-tune's: the rows it did not train from its run's table, then the ones it did.
  const std::string rows = pruned_rows_path(std::filesystem::path(ckpt).parent_path().string());
  LOOM_CHECK(std::filesystem::exists(rows),
             "{}: missing: checkpoint {} keeps only the input embedding's trained rows (model.prune_embedding); the "
             "others are in that file",
             rows, ckpt);
  const int64_t V = spec.shape[0], C = spec.shape[1];
  const train::SafetensorsReader rr(rows);
  rr.read_into("wte.weight", dst, size_t(V * C) * sizeof(float), DType::f32, spec.shape);
  uint32_t crc = 0;
  check_rows(rows, dst, V * C, 0, crc);
  check_rows_crc(rr, crc);
  const Shape ks = r.shape("vocab/kept"), ws = r.shape("param/wte.weight");
  LOOM_CHECK(ks.size() == 1 && ws == (Shape{ks[0], C}), "{}: vocab/kept {} and param/wte.weight {} do not match", ckpt,
             shape_str(ks), shape_str(ws));
  std::vector<float> kept(static_cast<size_t>(ks[0]));
  r.read("vocab/kept", 0, ks[0], kept.data());
  for (int64_t j = 0; j < ks[0]; ++j) {
    const float id = kept[size_t(j)];
    LOOM_CHECK(id >= 0 && id < float(V) && id == std::floor(id),
               "{}: vocab/kept[{}] = {} is not a token id of the vocabulary of {}", ckpt, j, id, V);
    r.read("param/wte.weight", j * C, C, dst + int64_t(id) * C);
  }
}

void load_checkpoint_params(const std::string& ckpt, GPT& gpt) {
  std::vector<train::NamedTensor> into;
  Parameter* wte = nullptr;
  train::CheckpointReader r(ckpt);
  for (Parameter* p : gpt.parameters()) {
    if (p->spec.name == "wte.weight" && r.has("vocab/kept")) wte = p;
    else into.push_back({"param/" + p->spec.name, p->value});
  }
  train::load_checkpoint_tensors(ckpt, into);
  if (wte) read_checkpoint_param(r, ckpt, wte->spec, wte->value.f32());
}

std::string save_initial_checkpoint(const GPT& gpt, const std::string& dir, uint64_t seed) {
  const std::string held = train::run_marker(dir);
  if (!held.empty())
    throw Error(fmt::format("{}: already holds a run ({}); choose a new directory (nothing was written)", dir, held));
  std::vector<train::NamedTensor> state;
  for (Parameter* p : gpt.parameters()) {
    Tensor zeros = Tensor::zeros(p->spec.shape, DType::f32, MemTag::optimizer);  // f32 [param shape]
    state.push_back({"param/" + p->spec.name, p->value});
    state.push_back({"adam_m/" + p->spec.name, zeros});
    state.push_back({"adam_v/" + p->spec.name, zeros});
  }
  train::CheckpointMeta meta;
  meta.seed = seed;
  meta.model = gpt_config_manifest(gpt.config());
  meta.config_toml = "";
  return train::save_checkpoint(dir, meta, state, /*keep=*/1);
}

}  // namespace loom::model

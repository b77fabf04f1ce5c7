// Hugging Face GPT-2 interop: a random GPT-2 written in Hugging Face layout is imported and
// exported again with identical tensors, goes through a loom checkpoint unchanged, gives PyTorch's
// logits (committed dump of scripts/torch_hf_gpt2.py), and bad files are refused naming the file
// and the tensor or field without touching what is already written.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "core/error.h"
#include "core/file.h"
#include "data/shard.h"
#include "train/checkpoint_io.h"
#include "model/gpt.h"
#include "train/hf_gpt2.h"
#include "train/safetensors.h"

namespace fs = std::filesystem;
using namespace loom;
using loom::model::GPT;
using loom::model::GPTConfig;

namespace {

struct TmpDir {
  fs::path p;
  TmpDir() {
    static int n = 0;
    p = fs::temp_directory_path() / fmt::format("loom_hf_test_{}_{}", ::getpid(), n++);
    fs::remove_all(p);
    fs::create_directories(p);
  }
  ~TmpDir() { fs::remove_all(p); }
  std::string operator/(const std::string& name) const { return (p / name).string(); }
};

GPTConfig tiny_config() {
  GPTConfig c;
  c.name = "hf-gpt2";
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 64;
  c.vocab_size = 499;
  c.block_size = 48;
  return c;
}

// A random GPT-2 in Hugging Face layout, built from the names and shapes GPT-2 has (not from loom's
// tables): Conv1D weights [in, out].
struct HfModel {
  std::vector<std::pair<std::string, Shape>> specs;
  std::map<std::string, std::vector<float>> values;
};

HfModel random_hf_model(const GPTConfig& c, uint32_t seed) {
  const int64_t C = c.n_embd;
  HfModel m;
  m.specs = {{"wte.weight", {c.vocab_size, C}}, {"wpe.weight", {c.block_size, C}}};
  for (int64_t i = 0; i < c.n_layer; ++i) {
    const std::string p = "h." + std::to_string(i) + ".";
    m.specs.insert(m.specs.end(), {{p + "ln_1.weight", {C}},
                                   {p + "ln_1.bias", {C}},
                                   {p + "attn.c_attn.weight", {C, 3 * C}},
                                   {p + "attn.c_attn.bias", {3 * C}},
                                   {p + "attn.c_proj.weight", {C, C}},
                                   {p + "attn.c_proj.bias", {C}},
                                   {p + "ln_2.weight", {C}},
                                   {p + "ln_2.bias", {C}},
                                   {p + "mlp.c_fc.weight", {C, 4 * C}},
                                   {p + "mlp.c_fc.bias", {4 * C}},
                                   {p + "mlp.c_proj.weight", {4 * C, C}},
                                   {p + "mlp.c_proj.bias", {C}}});
  }
  m.specs.push_back({"ln_f.weight", {C}});
  m.specs.push_back({"ln_f.bias", {C}});
  std::mt19937 g(seed);
  std::normal_distribution<float> n(0.0f, 0.02f);
  for (const auto& [name, shape] : m.specs) {
    auto& v = m.values[name];
    v.resize(size_t(shape_numel(shape)));
    const bool ln_w = name.find("ln_") != std::string::npos && name.find(".weight") != std::string::npos;
    for (auto& x : v) x = (ln_w ? 1.0f : 0.0f) + n(g) * (ln_w ? 5.0f : 1.0f);
  }
  return m;
}

// Writes m as a Hugging Face model.safetensors (+ optional mask buffers and prefix) and config.json.
void write_hf(const HfModel& m, const GPTConfig& c, const fs::path& dir, const std::string& prefix = "",
              bool mask_buffers = true) {
  train::SafetensorsWriter w;
  for (const auto& [name, shape] : m.specs) w.add(prefix + name, DType::f32, shape, m.values.at(name).data());
  static std::vector<float> mask;
  mask.assign(size_t(c.block_size * c.block_size), 0.0f);
  for (int64_t i = 0; i < c.block_size; ++i)
    for (int64_t j = 0; j <= i; ++j) mask[size_t(i * c.block_size + j)] = 1.0f;
  if (mask_buffers)
    for (int64_t i = 0; i < c.n_layer; ++i)
      w.add(prefix + "h." + std::to_string(i) + ".attn.bias", DType::f32, {1, 1, c.block_size, c.block_size},
            mask.data());
  w.set_metadata("format", "pt");
  fs::create_directories(dir);
  w.write((dir / "model.safetensors").string());
  std::ofstream((dir / "config.json").string()) << model::hf_config_json(c).dump(2);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(HfGpt2, KeysAndShapes) {
  EXPECT_EQ(model::hf_key("h.11.attn.c_attn.weight").name, "h.11.attn.c_attn.weight");
  EXPECT_TRUE(model::hf_key("h.11.attn.c_attn.weight").conv1d);
  EXPECT_TRUE(model::hf_key("h.0.mlp.c_proj.weight").conv1d);
  EXPECT_FALSE(model::hf_key("h.0.mlp.c_proj.bias").conv1d);
  EXPECT_FALSE(model::hf_key("wte.weight").conv1d);
  EXPECT_FALSE(model::hf_key("lm_head.weight").conv1d);
  model::ParamSpec s{"h.0.mlp.c_fc.weight", {256, 64}, 256, model::Init::normal, 0.02f};
  EXPECT_EQ(model::hf_shape(s), (Shape{64, 256}));
  std::vector<float> a = {1, 2, 3, 4, 5, 6}, t(6);
  model::transpose_2d(a.data(), t.data(), 2, 3);
  EXPECT_EQ(t, (std::vector<float>{1, 4, 2, 5, 3, 6}));
}

TEST(HfGpt2, ImportExportRoundTripIsIdentical) {
  const GPTConfig c = tiny_config();
  const HfModel hf = random_hf_model(c, 7);
  TmpDir d;
  write_hf(hf, c, d.p / "in");
  const GPTConfig read = model::read_hf_config(d / "in/config.json");
  EXPECT_EQ(read.n_layer, c.n_layer);
  EXPECT_EQ(read.n_head, c.n_head);
  EXPECT_EQ(read.n_embd, c.n_embd);
  EXPECT_EQ(read.vocab_size, c.vocab_size);
  EXPECT_EQ(read.block_size, c.block_size);
  EXPECT_TRUE(read.tied_embeddings);

  MemoryPool pool("cpu:0");
  GPT gpt(read, pool, 1);
  model::load_hf_gpt2(d / "in/model.safetensors", gpt);
  // loom holds Linear layout: element (o, i) of a projection is element (i, o) of the file.
  const auto& w = gpt.parameter("h.1.attn.c_attn.weight");
  const auto& src = hf.values.at("h.1.attn.c_attn.weight");  // [C, 3C]
  for (int64_t o = 0; o < 3 * c.n_embd; o += 17)
    for (int64_t i = 0; i < c.n_embd; i += 5)
      ASSERT_EQ(w.value.f32()[o * c.n_embd + i], src[size_t(i * 3 * c.n_embd + o)]);
  // The wte padding rows stay zero.
  const auto& wte = gpt.parameter("wte.weight");
  for (int64_t i = c.vocab_size * c.n_embd; i < c.padded_vocab() * c.n_embd; ++i) ASSERT_EQ(wte.value_full.f32()[i], 0.0f);

  // HF -> loom checkpoint -> HF: every tensor byte-identical, names and shapes as Hugging Face's.
  model::save_initial_checkpoint(gpt, d / "run", 1337);
  const std::string ckpt = model::resolve_checkpoint(d / "run");
  const GPTConfig cc = model::checkpoint_model_config(ckpt);
  EXPECT_EQ(cc.str(), read.str());
  GPT again(cc, pool, 99);
  model::load_checkpoint_params(ckpt, again);
  model::save_hf_gpt2(again, d / "out");
  train::SafetensorsReader out(d / "out/model.safetensors");
  EXPECT_EQ(out.metadata().at("format"), "pt");
  EXPECT_EQ(out.entries().size(), hf.specs.size());  // mask buffers dropped, lm_head tied
  for (const auto& [name, shape] : hf.specs) {
    ASSERT_TRUE(out.contains(name)) << name;
    EXPECT_EQ(out.entry(name).shape, shape) << name;
    EXPECT_EQ(out.entry(name).dtype, DType::f32) << name;
    const std::vector<float> v = out.read_f32(name);
    ASSERT_EQ(std::memcmp(v.data(), hf.values.at(name).data(), v.size() * sizeof(float)), 0) << name;
  }
  // The exported config reads back to the same model.
  EXPECT_EQ(model::read_hf_config(d / "out/config.json").str(), read.str());
  std::ifstream cf(d / "out/config.json");
  const auto j = nlohmann::json::parse(cf);
  EXPECT_EQ(j.at("activation_function"), "gelu_new");
  EXPECT_EQ(j.at("model_type"), "gpt2");
  EXPECT_EQ(j.at("n_positions"), c.block_size);
  EXPECT_FALSE(fs::exists(d / "out/model.safetensors.partial"));
}

TEST(HfGpt2, PrefixedKeysAndExplicitTiedHead) {
  const GPTConfig c = tiny_config();
  HfModel hf = random_hf_model(c, 8);
  hf.specs.push_back({"lm_head.weight", {c.vocab_size, c.n_embd}});
  hf.values["lm_head.weight"] = hf.values.at("wte.weight");
  TmpDir d;
  write_hf(hf, c, d.p, "transformer.", false);
  MemoryPool pool("cpu:0");
  GPT gpt(c, pool, 1);
  model::load_hf_gpt2(d / "model.safetensors", gpt);
  const auto& v = gpt.parameter("wpe.weight");
  EXPECT_EQ(std::memcmp(v.value.f32(), hf.values.at("wpe.weight").data(), v.value.nbytes()), 0);

  // A head that differs from wte under a tied config is an error naming the file and tensor.
  hf.values["lm_head.weight"][5] += 1.0f;
  write_hf(hf, c, d.p, "transformer.", false);
  const std::string e = error_of([&] { model::load_hf_gpt2(d / "model.safetensors", gpt); });
  EXPECT_NE(e.find(d / "model.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("transformer.lm_head.weight"), std::string::npos) << e;
}

TEST(HfGpt2, UntiedHeadRoundTrip) {
  GPTConfig c = tiny_config();
  c.tied_embeddings = false;
  HfModel hf = random_hf_model(c, 9);
  hf.specs.push_back({"lm_head.weight", {c.vocab_size, c.n_embd}});
  auto head = hf.values.at("wte.weight");
  for (auto& x : head) x *= -0.5f;
  hf.values["lm_head.weight"] = head;
  TmpDir d;
  write_hf(hf, c, d.p / "in");
  const GPTConfig read = model::read_hf_config(d / "in/config.json");
  EXPECT_FALSE(read.tied_embeddings);
  MemoryPool pool("cpu:0");
  GPT gpt(read, pool, 1);
  model::load_hf_gpt2(d / "in/model.safetensors", gpt);
  model::save_hf_gpt2(gpt, d / "out");
  train::SafetensorsReader out(d / "out/model.safetensors");
  ASSERT_TRUE(out.contains("lm_head.weight"));
  EXPECT_EQ(out.read_f32("lm_head.weight"), head);
}

TEST(HfGpt2, BadFilesNameTheFileAndTensor) {
  const GPTConfig c = tiny_config();
  MemoryPool pool("cpu:0");
  GPT gpt(c, pool, 1);
  TmpDir d;
  const std::string st = d / "model.safetensors";
  auto expect_error = [&](const HfModel& m, const std::string& what) {
    write_hf(m, c, d.p);
    const std::string e = error_of([&] { model::load_hf_gpt2(st, gpt); });
    EXPECT_NE(e.find(st), std::string::npos) << e;
    EXPECT_NE(e.find(what), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << "one line: " << e;
  };
  {  // Linear layout where Hugging Face has Conv1D [in, out]
    HfModel m = random_hf_model(c, 1);
    for (auto& [n, s] : m.specs)
      if (n == "h.1.mlp.c_fc.weight") s = {s[1], s[0]};
    expect_error(m, "tensor 'h.1.mlp.c_fc.weight' has shape [256, 64], expected [64, 256]");
  }
  {  // missing tensor
    HfModel m = random_hf_model(c, 1);
    std::erase_if(m.specs, [](const auto& s) { return s.first == "h.0.ln_2.bias"; });
    expect_error(m, "missing tensor 'h.0.ln_2.bias'");
  }
  {  // a tensor GPT-2 does not have (a model of more layers than the config)
    HfModel m = random_hf_model(c, 1);
    m.specs.push_back({"h.2.ln_1.weight", {c.n_embd}});
    m.values["h.2.ln_1.weight"] = m.values.at("h.0.ln_1.weight");
    expect_error(m, "unexpected tensor 'h.2.ln_1.weight'");
  }
  {  // wrong dtype: an integer tensor where weights belong
    train::SafetensorsWriter w;
    HfModel m = random_hf_model(c, 1);
    std::vector<int32_t> ints(size_t(c.n_embd), 1);
    for (const auto& [name, shape] : m.specs) {
      if (name == "ln_f.bias") w.add(name, DType::i32, shape, ints.data());
      else w.add(name, DType::f32, shape, m.values.at(name).data());
    }
    w.write(st);
    const std::string e = error_of([&] { model::load_hf_gpt2(st, gpt); });
    EXPECT_NE(e.find(st), std::string::npos) << e;
    EXPECT_NE(e.find("tensor 'ln_f.bias' has dtype i32"), std::string::npos) << e;
  }
  {  // a header that lies about its offsets: the reader refuses before any import
    HfModel m = random_hf_model(c, 1);
    write_hf(m, c, d.p);
    std::fstream f(st, std::ios::in | std::ios::out | std::ios::binary);
    uint64_t n = 0;
    f.read(reinterpret_cast<char*>(&n), 8);
    std::string header(n, ' ');
    f.read(header.data(), std::streamsize(n));
    auto j = nlohmann::json::parse(header);
    auto& off = j["h.0.attn.c_proj.bias"]["data_offsets"];
    off[1] = off[1].get<uint64_t>() + 4;  // claims one float more than the shape holds
    std::string lie = j.dump();
    ASSERT_LE(lie.size(), n);
    lie.append(n - lie.size(), ' ');
    f.seekp(8);
    f.write(lie.data(), std::streamsize(n));
    f.close();
    const std::string e = error_of([&] { model::load_hf_gpt2(st, gpt); });
    EXPECT_NE(e.find(st), std::string::npos) << e;
    EXPECT_NE(e.find("h.0.attn.c_proj.bias"), std::string::npos) << e;
  }
}

TEST(HfGpt2, BadConfigNamesTheField) {
  const nlohmann::json good = model::hf_config_json(tiny_config());
  auto error_for = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = good;
    edit(j);
    return error_of([&] { model::gpt_config_from_hf(j, "cfg.json"); });
  };
  EXPECT_EQ(error_for([](auto&) {}), "");
  EXPECT_NE(error_for([](auto& j) { j.erase("n_head"); }).find("cfg.json: missing field 'n_head'"), std::string::npos);
  EXPECT_NE(error_for([](auto& j) { j["n_embd"] = "64"; }).find("cfg.json: field 'n_embd' must be an integer"),
            std::string::npos);
  EXPECT_NE(error_for([](auto& j) { j["activation_function"] = "relu"; }).find("'activation_function'"),
            std::string::npos);
  EXPECT_NE(error_for([](auto& j) { j["n_inner"] = 100; }).find("'n_inner'"), std::string::npos);
  EXPECT_NE(error_for([](auto& j) { j["n_head"] = 5; }).find("cfg.json"), std::string::npos);
  EXPECT_NE(error_for([](auto& j) { j["model_type"] = "llama"; }).find("'model_type'"), std::string::npos);
  EXPECT_NE(error_for([](auto& j) { j["scale_attn_by_inverse_layer_idx"] = true; }).find("scale_attn_by_inverse"),
            std::string::npos);
  // An epsilon that overflows f32 (or rounds to 0 in it) would be written into a manifest loom then
  // refuses: refused here, naming the field.
  EXPECT_NE(error_for([](auto& j) { j["layer_norm_epsilon"] = 1e300; }).find("cfg.json: field 'layer_norm_epsilon' is"),
            std::string::npos);
  EXPECT_NE(error_for([](auto& j) { j["layer_norm_epsilon"] = 1e-60; }).find("'layer_norm_epsilon'"), std::string::npos);
  EXPECT_NE(error_for([](auto& j) { j["layer_norm_epsilon"] = -1e-5; }).find("'layer_norm_epsilon'"), std::string::npos);
  // n_ctx stands in for n_positions in old configs.
  nlohmann::json old = good;
  old.erase("n_positions");
  EXPECT_EQ(model::gpt_config_from_hf(old, "cfg.json").block_size, tiny_config().block_size);
}

TEST(HfGpt2, FailedWritesKeepWhatIsThere) {
  const GPTConfig c = tiny_config();
  MemoryPool pool("cpu:0");
  GPT gpt(c, pool, 3);
  TmpDir d;
  // An export whose temporary file cannot be created leaves the previous export intact.
  model::save_hf_gpt2(gpt, d / "hf");
  const auto before = fs::file_size(d / "hf/model.safetensors");
  std::ifstream cfg_before(d / "hf/config.json");
  const std::string cfg_text((std::istreambuf_iterator<char>(cfg_before)), {});
  fs::create_directories(d / "hf/model.safetensors.partial.tmp");  // blocks the temporary name
  GPT other(tiny_config(), pool, 4);
  EXPECT_NE(error_of([&] { model::save_hf_gpt2(other, d / "hf"); }), "");
  EXPECT_EQ(fs::file_size(d / "hf/model.safetensors"), before);
  std::ifstream cfg_after(d / "hf/config.json");
  EXPECT_EQ(std::string((std::istreambuf_iterator<char>(cfg_after)), {}), cfg_text);
  GPT back(c, pool, 5);
  model::load_hf_gpt2(d / "hf/model.safetensors", back);
  EXPECT_EQ(std::memcmp(back.parameter("h.0.mlp.c_fc.weight").value.f32(),
                        gpt.parameter("h.0.mlp.c_fc.weight").value.f32(),
                        gpt.parameter("h.0.mlp.c_fc.weight").value.nbytes()),
            0);

  // A loom checkpoint is never written over an existing run.
  model::save_initial_checkpoint(gpt, d / "run", 1);
  const std::string e = error_of([&] { model::save_initial_checkpoint(other, d / "run", 1); });
  EXPECT_NE(e.find(d / "run"), std::string::npos) << e;
  GPT back2(c, pool, 6);
  model::load_checkpoint_params(model::resolve_checkpoint(d / "run"), back2);
  EXPECT_EQ(std::memcmp(back2.parameter("wte.weight").value.f32(), gpt.parameter("wte.weight").value.f32(),
                        gpt.parameter("wte.weight").value.nbytes()),
            0);
}

// The committed dump of scripts/torch_hf_gpt2.py: Hugging Face files and PyTorch's logits.
TEST(HfGpt2, LogitsMatchPyTorchDump) {
  const fs::path dir = fs::path(LOOM_SOURCE_DIR) / "tests/model/hf_gpt2_tiny";
  if (!fs::exists(dir / "reference.safetensors")) GTEST_SKIP() << "no dump at " << dir.string();
  const GPTConfig c = model::read_hf_config((dir / "config.json").string());
  MemoryPool pool("cpu:0");
  GPT gpt(c, pool, 1);
  model::load_hf_gpt2((dir / "model.safetensors").string(), gpt);
  train::SafetensorsReader ref((dir / "reference.safetensors").string());
  Tensor tokens = ref.load("tokens", MemTag::workspace);  // i32 [B, T]
  const std::vector<float> want = ref.read_f32("logits");   // f32 [B, T, V]
  gpt.forward(tokens, Tensor());
  const int64_t BT = tokens.size(0) * tokens.size(1), V = c.vocab_size, Vp = c.padded_vocab();
  double num = 0, den = 0;
  for (int64_t r = 0; r < BT; ++r)
    for (int64_t v = 0; v < V; ++v) {
      const double a = gpt.logits().f32()[r * Vp + v], b = want[size_t(r * V + v)];
      num += (a - b) * (a - b);
      den += b * b;
    }
  const double rel = std::sqrt(num / den);
  std::printf("logits ||l - l_ref|| / ||l_ref|| = %.3e\n", rel);
  EXPECT_LE(rel, 1e-5);
}

// A manifest whose model disagrees with the parameters the checkpoint holds (its checksum rewritten
// to match: edited, or written by another tool) is refused before anything is allocated from it,
// naming manifest.json and the field: more layers than stored (10^12 would hang allocating), fewer,
// or a vocabulary the stored embedding does not have.
TEST(CheckpointModel, ManifestModelMustMatchTheStoredParameters) {
  const fs::path d = fs::temp_directory_path() / ("loom_ckpt_model_" + std::to_string(::getpid()));
  fs::remove_all(d);
  GPTConfig c = model::gpt_preset("gpt2-tiny");
  c.n_layer = 2;
  MemoryPool pool("ckpt-model");
  GPT gpt(c, pool, 1);
  model::save_initial_checkpoint(gpt, (d / "run").string(), 1);
  const std::string ckpt = model::resolve_checkpoint((d / "run").string());
  EXPECT_EQ(model::checkpoint_model_config(ckpt).str(), c.str());
  const std::string manifest = (fs::path(ckpt) / "manifest.json").string();
  const std::string original = read_file(manifest);
  auto refused = [&](const std::string& key, const nlohmann::json& value) {
    nlohmann::json m = nlohmann::json::parse(original);
    m["model"][key] = value;
    const std::string text = m.dump(2) + "\n";
    std::ofstream(manifest, std::ios::trunc) << text;
    std::ofstream(fs::path(ckpt) / "manifest.crc32", std::ios::trunc) << data::crc32(text.data(), text.size()) << "\n";
    try {
      model::checkpoint_model_config(ckpt);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  std::string e = refused("n_layer", int64_t(1'000'000'000'000));
  EXPECT_NE(e.find(manifest + ": field 'model.n_layer' is 1000000000000, but checkpoint"), std::string::npos) << e;
  e = refused("n_layer", 1);
  EXPECT_NE(e.find(manifest + ": field 'model'"), std::string::npos) << e;
  EXPECT_NE(e.find("but checkpoint " + ckpt + " holds"), std::string::npos) << e;
  e = refused("ln_eps", 1e300);  // inf as f32
  EXPECT_NE(e.find(manifest + ": model: ln_eps must be positive and finite"), std::string::npos) << e;
  e = refused("vocab_size", 100);
  EXPECT_NE(e.find("gives parameter 'wte.weight' the shape [100, " + std::to_string(c.n_embd) + "]"), std::string::npos)
      << e;
  fs::remove_all(d);
}

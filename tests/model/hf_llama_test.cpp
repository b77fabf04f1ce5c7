// Hugging Face LlamaForCausalLM interop, on the committed checkpoint that the PyTorch reference
// wrote (tests/model/hf_llama_tiny: llama-tiny's initial weights in the hub's layout, two shards and
// model.safetensors.index.json, by scripts/torch_llama_reference.py --hf-out): it converts into a
// loom checkpoint and back with every tensor bit-identical (in one file and in shards), loom's loss
// on the reference's tokens equals PyTorch's (tests/data/llama_tiny_reference.safetensors, same
// weights), and bad files and configs are refused naming the file and the tensor or field.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/file.h"
#include "model/gpt.h"
#include "train/checkpoint.h"
#include "train/checkpoint_io.h"
#include "train/hf_config.h"
#include "train/hf_llama.h"
#include "train/safetensors.h"

namespace fs = std::filesystem;
using namespace loom;
using loom::model::GPT;
using loom::model::GPTConfig;

namespace {

const fs::path kDir = fs::path(LOOM_SOURCE_DIR) / "tests/model/hf_llama_tiny";

struct TmpDir {
  fs::path p;
  TmpDir() {
    static int n = 0;
    p = fs::temp_directory_path() / fmt::format("loom_hf_llama_test_{}_{}", ::getpid(), n++);
    fs::remove_all(p);
    fs::create_directories(p);
  }
  ~TmpDir() { fs::remove_all(p); }
  std::string operator/(const std::string& name) const { return (p / name).string(); }
};

// Every tensor of a Hugging Face model (any number of shards) by name.
std::map<std::string, std::pair<Shape, std::vector<float>>> read_all(const std::string& path) {
  std::map<std::string, std::pair<Shape, std::vector<float>>> out;
  for (const std::string& f : model::hf_files(path).files) {
    train::SafetensorsReader r(f);
    for (const auto& e : r.entries()) {
      EXPECT_EQ(e.dtype, DType::f32) << f << ": " << e.name;
      out[e.name] = {e.shape, r.read_f32(e.name)};
    }
  }
  return out;
}

void expect_identical(const std::string& a, const std::string& b) {
  const auto ta = read_all(a), tb = read_all(b);
  ASSERT_EQ(ta.size(), tb.size()) << a << " and " << b;
  for (const auto& [name, t] : ta) {
    ASSERT_TRUE(tb.count(name)) << b << " lacks " << name;
    EXPECT_EQ(tb.at(name).first, t.first) << name;
    ASSERT_EQ(tb.at(name).second.size(), t.second.size()) << name;
    EXPECT_EQ(std::memcmp(tb.at(name).second.data(), t.second.data(), t.second.size() * sizeof(float)), 0) << name;
  }
}

std::string write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  return path;
}

}  // namespace

TEST(HfLlama, ConfigReadsTheLlamaOptions) {
  const GPTConfig c = model::read_hf_config((kDir / "config.json").string());
  EXPECT_TRUE(model::is_llama(c));
  EXPECT_EQ(c.n_layer, 2);
  EXPECT_EQ(c.n_head, 4);
  EXPECT_EQ(c.kv_heads(), 2);
  EXPECT_EQ(c.n_embd, 64);
  EXPECT_EQ(c.ffn(), 176);
  EXPECT_EQ(c.vocab_size, 503);
  EXPECT_FALSE(c.bias);
  EXPECT_FALSE(c.tied_embeddings);
  EXPECT_EQ(c.rope_theta, 10000.0);
  // config.json written by loom reads back to the same model, Llama 3's rope scaling included.
  GPTConfig s = c;
  s.rope_scaling_factor = 8;
  s.rope_original_max_position = 8192;
  s.rope_theta = 500000;
  const auto j = model::hf_config_json(s);
  EXPECT_EQ(j.at("model_type"), "llama");
  EXPECT_EQ(j.at("rope_scaling").at("rope_type"), "llama3");
  EXPECT_EQ(model::llama_config_from_hf(j, "loom's config.json").str(), s.str());
  EXPECT_EQ(model::llama_config_from_hf(j, "x").rope_scaling_factor, 8.0);
}

TEST(HfLlama, RoundTripIsBitIdenticalAndTheLossIsPyTorchs) {
  const GPTConfig c = model::read_hf_config((kDir / "config.json").string());
  MemoryPool pool("cpu:0");
  GPT gpt(c, pool, 1);
  model::load_hf_llama(kDir.string(), gpt);

  // Through a loom checkpoint and back: in shards of at most 100 KiB (index written) and in one file.
  TmpDir d;
  model::save_initial_checkpoint(gpt, d / "run", 1337);
  const std::string ckpt = model::resolve_checkpoint(d / "run");
  const GPTConfig cc = model::checkpoint_model_config(ckpt);
  EXPECT_EQ(cc.str(), c.str());
  train::CheckpointReader r(ckpt);
  auto values = [&](const model::ParamSpec& spec, float* dst) { r.read("param/" + spec.name, 0, spec.numel(), dst); };
  model::save_hf_llama(cc, values, d / "sharded", 100 << 10);
  model::save_hf_llama(cc, values, d / "one");
  EXPECT_TRUE(fs::exists(d / "sharded/model.safetensors.index.json"));
  EXPECT_GT(model::hf_files(d / "sharded").files.size(), size_t(2));
  EXPECT_TRUE(fs::exists(d / "one/model.safetensors"));
  EXPECT_FALSE(fs::exists(d / "one/model.safetensors.index.json"));
  expect_identical(kDir.string(), d / "sharded");
  expect_identical(kDir.string(), d / "one");
  EXPECT_EQ(model::read_hf_config(d / "one/config.json").str(), c.str());
  // The special tokens are the tokenizer's: null, not transformers' defaults (1 and 2).
  const nlohmann::json exported = nlohmann::json::parse(read_file(d / "one/config.json"));
  EXPECT_TRUE(exported.at("bos_token_id").is_null() && exported.at("eos_token_id").is_null()) << exported.dump();

  // loom's loss on the reference's tokens, from the converted checkpoint: PyTorch's.
  GPT again(cc, pool, 99);
  model::load_checkpoint_params(ckpt, again);
  train::SafetensorsReader ref(std::string(LOOM_SOURCE_DIR) + "/tests/data/llama_tiny_reference.safetensors");
  MemoryPool io("io");
  const Tensor tokens = ref.load("tokens", MemTag::workspace, io), targets = ref.load("targets", MemTag::workspace, io);
  const float loss = again.forward(tokens, targets);
  const float want = ref.read_f32("loss").at(0);
  EXPECT_LE(std::fabs(double(loss) - want) / want, 1e-5) << "loss " << loss << " vs PyTorch's " << want;
}

TEST(HfLlama, BadFilesNameTheFileAndTensor) {
  const GPTConfig c = model::read_hf_config((kDir / "config.json").string());
  MemoryPool pool("cpu:0");
  auto expect_error = [&](const std::string& path, const std::string& want) {
    GPT gpt(c, pool, 1);
    try {
      model::load_hf_llama(path, gpt);
      ADD_FAILURE() << "no error for " << path << " (want " << want << ")";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  TmpDir d;
  // A shard missing: the index names a file that is not there.
  fs::create_directories(d.p / "missing");
  fs::copy(kDir / "model.safetensors.index.json", d.p / "missing");
  fs::copy(kDir / "model-00001-of-00002.safetensors", d.p / "missing");
  expect_error(d / "missing", "model-00002-of-00002.safetensors");
  // An index whose weight_map points outside its directory.
  fs::create_directories(d.p / "escape");
  write_text(d / "escape/model.safetensors.index.json",
             R"({"weight_map": {"model.norm.weight": "../model-00001-of-00002.safetensors"}})");
  expect_error(d / "escape", "not a file beside the index");
  // An index that lists no tensors (`loom convert` took its first file of none).
  fs::create_directories(d.p / "empty_map");
  write_text(d / "empty_map/model.safetensors.index.json", R"({"weight_map": {}})");
  expect_error(d / "empty_map", "model.safetensors.index.json: field 'weight_map' lists no tensors");
  // A tensor of another shape, and one loom has no parameter for.
  {
    const auto all = read_all(kDir.string());  // (the writer keeps pointers into it)
    std::vector<float> bad(size_t(64 * 63), 0.f), extra(4, 0.f);
    auto write_with = [&](const std::string& dir, const std::string& skip, const std::string& add, const Shape& shape,
                          const float* data) {
      train::SafetensorsWriter w;
      for (const auto& [name, t] : all)
        if (name != skip) w.add(name, DType::f32, t.first, t.second.data());
      w.add(add, DType::f32, shape, data);
      fs::create_directories(d.p / dir);
      w.write(d / (dir + "/model.safetensors"));
    };
    write_with("shape", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight", {64, 63},
               bad.data());
    expect_error(d / "shape", "'model.layers.0.self_attn.q_proj.weight' has shape [64, 63], expected [64, 64]");
    write_with("extra", "", "model.layers.0.self_attn.q_proj.bias", {4}, extra.data());
    expect_error(d / "extra", "unexpected tensor 'model.layers.0.self_attn.q_proj.bias'");
    write_with("missing_tensor", "model.norm.weight", "model.layers.0.self_attn.rotary_emb.inv_freq", {4}, extra.data());
    expect_error(d / "missing_tensor", "missing tensor 'model.norm.weight'");
    // A rotary buffer of the config's frequencies is taken (older transformers saved them); one of
    // another base says the config does not describe the file's model.
    std::vector<float> freq;
    for (double f : rope_inv_freq(c.head_size(), c.rope_theta)) freq.push_back(float(f));
    const std::string buffer = "model.layers.1.self_attn.rotary_emb.inv_freq";
    write_with("freq", "", buffer, {int64_t(freq.size())}, freq.data());
    GPT ok(c, pool, 1);
    EXPECT_NO_THROW(model::load_hf_llama(d / "freq", ok));
    std::vector<float> other;
    for (double f : rope_inv_freq(c.head_size(), 500000.0)) other.push_back(float(f));
    write_with("other_freq", "", buffer, {int64_t(other.size())}, other.data());
    expect_error(d / "other_freq", "tensor '" + buffer + "' gives frequency 1 a value of");
    // A directory with model.safetensors and an index: model.safetensors, as transformers reads.
    fs::copy(kDir / "model.safetensors.index.json", d.p / "freq");
    EXPECT_EQ(model::hf_files(d / "freq").files, std::vector<std::string>{d / "freq/model.safetensors"});
  }
  // Configs loom's Llama cannot run the same way.
  const std::string base = "\"model_type\": \"llama\", \"hidden_size\": 64, \"intermediate_size\": 176, "
                           "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"vocab_size\": 503, "
                           "\"max_position_embeddings\": 64";
  auto expect_config_error = [&](const std::string& extra, const std::string& want) {
    const std::string path = write_text(d / "config.json", "{" + base + extra + "}");
    try {
      (void)model::read_hf_config(path);
      ADD_FAILURE() << "no error for " << extra;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  };
  expect_config_error(", \"hidden_act\": \"gelu\"", "field 'hidden_act'");
  expect_config_error(", \"attention_bias\": true", "'attention_bias' (true) and 'mlp_bias' (false) differ");
  expect_config_error(", \"rope_scaling\": {\"rope_type\": \"yarn\", \"factor\": 4}", "rope_type \"yarn\"");
  expect_config_error(", \"head_dim\": 32", "field 'head_dim' is 32");
  expect_config_error(", \"num_key_value_heads\": 3", "n_kv_head (3) must divide n_head (4)");
  expect_config_error(", \"pretraining_tp\": 0", "field 'pretraining_tp' is 0");
  // Rotary settings that transformers reads otherwise than a missing field: a null rope_theta
  // (not 10000), transformers 5's rope_parameters against rope_theta, a llama3 scaling missing a
  // key (transformers' KeyError; it was 0: no scaling), a partial rotation, a quantized model.
  expect_config_error(", \"rope_theta\": null", "field 'rope_theta' is null");
  expect_config_error(", \"rope_theta\": 10000, \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 500000}",
                      "fields 'rope_theta' (10000) and 'rope_parameters.rope_theta' (500000) differ");
  expect_config_error(", \"rope_scaling\": {\"rope_type\": \"llama3\", \"low_freq_factor\": 1, \"high_freq_factor\": 4, "
                      "\"original_max_position_embeddings\": 32}",
                      "field 'rope_scaling.factor' must be a number (llama3 scaling needs it)");
  expect_config_error(", \"rope_parameters\": {\"rope_type\": \"llama3\", \"rope_theta\": 500000, \"factor\": 8, "
                      "\"high_freq_factor\": 4, \"original_max_position_embeddings\": 32}",
                      "field 'rope_parameters.low_freq_factor' must be a number");
  expect_config_error(", \"rope_parameters\": {\"rope_type\": \"linear\", \"rope_theta\": 10000, \"factor\": 2}",
                      "field 'rope_parameters' has rope_type \"linear\"");
  expect_config_error(", \"partial_rotary_factor\": 0.5", "field 'partial_rotary_factor' is 0.5");
  expect_config_error(", \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 10000, \"partial_rotary_factor\": 0.5}",
                      "field 'rope_parameters.partial_rotary_factor' is 0.5");
  expect_config_error(", \"quantization_config\": {\"quant_method\": \"bitsandbytes\"}", "field 'quantization_config'");
  // What transformers reads as loom's model: 5's rope_parameters (theta and a llama3 scaling, the
  // original context as a float), "swish", a default rope_type, pretraining_tp > 1.
  auto read = [&](const std::string& extra) {
    return model::read_hf_config(write_text(d / "config.json", "{" + base + extra + "}"));
  };
  const GPTConfig v5 = read(", \"rope_parameters\": {\"rope_type\": \"llama3\", \"rope_theta\": 500000.0, \"factor\": 8.0, "
                            "\"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0, "
                            "\"original_max_position_embeddings\": 32.0}, \"hidden_act\": \"swish\", \"pretraining_tp\": 2");
  EXPECT_EQ(v5.rope_theta, 500000.0);
  EXPECT_EQ(v5.rope_scaling_factor, 8.0);
  EXPECT_EQ(v5.rope_original_max_position, 32);
  const GPTConfig plain = read(", \"rope_theta\": null, \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 1e6}");
  EXPECT_EQ(plain.rope_theta, 1e6);
  EXPECT_EQ(plain.rope_scaling_factor, 0.0);
  // A model that is neither family has no Hugging Face config.
  GPTConfig mixed = c;
  mixed.norm = model::Norm::layernorm;
  EXPECT_THROW((void)model::hf_config_json(mixed), Error);
}

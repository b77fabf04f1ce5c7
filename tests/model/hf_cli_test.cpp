// The loom executable end to end: `loom convert` both ways on the committed Hugging Face dump,
// `loom generate` with and without the KV cache, and bad input answered by a one-line error naming
// the file and the tensor, a non-zero exit, and the earlier output left as it was. Skips when the
// loom executable has not been built next to the tests.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <fstream>
#include <sstream>

#include <cmath>

#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "data/shard.h"
#include "model/gpt.h"
#include "train/checkpoint_io.h"
#include "train/safetensors.h"

namespace fs = std::filesystem;

namespace {

using loom::test::CliRun;
using loom::test::kLoom;

CliRun loom_cli(const std::string& args, const fs::path& dir) { return loom::test::loom_cli(args, dir, "OMP_NUM_THREADS=1"); }

struct TmpDir {
  fs::path p = fs::temp_directory_path() / ("loom_hf_cli_" + std::to_string(::getpid()));
  TmpDir() {
    fs::remove_all(p);
    fs::create_directories(p);
  }
  ~TmpDir() { fs::remove_all(p); }
};

}  // namespace

TEST(HfCli, ConvertGenerateAndErrors) {
  LOOM_REQUIRE_LOOM();
  const fs::path dump = fs::path(LOOM_SOURCE_DIR) / "tests/model/hf_gpt2_tiny";
  TmpDir d;
  const std::string run = (d.p / "run").string(), hf = (d.p / "hf").string();

  CliRun r = loom_cli("convert --from hf --to loom '" + (dump / "model.safetensors").string() + "' '" + run + "'", d.p);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(fs::exists(d.p / "run/latest"));

  // Cached and recomputed sampling print the same tokens.
  const std::string gen = "generate '" + run + "' --ids --prompt '5 17 200' --tokens 25 --top-k 20 --seed 4 --quiet";
  const CliRun cached = loom_cli(gen, d.p), recomputed = loom_cli(gen + " --no-cache", d.p);
  ASSERT_EQ(cached.code, 0) << cached.err;
  ASSERT_EQ(recomputed.code, 0) << recomputed.err;
  EXPECT_EQ(cached.out, recomputed.out);
  EXPECT_EQ(cached.out.rfind("5 17 200 |", 0), 0u) << cached.out;
  // Temperature 0 is greedy: top-k 1 whatever --top-k and the seed say.
  const CliRun greedy = loom_cli("generate '" + run + "' --ids --prompt '5 17' --tokens 6 --temperature 0 --seed 3", d.p);
  const CliRun top1 = loom_cli("generate '" + run + "' --ids --prompt '5 17' --tokens 6 --top-k 1 --seed 9", d.p);
  ASSERT_EQ(greedy.code, 0) << greedy.err;
  EXPECT_EQ(greedy.out, top1.out);
  // Flags out of range are refused naming the flag: an infinite temperature (it sampled), a
  // negative seed (it wrapped to 2^64 - 1) and one past 2^64 - 1; the largest seed is taken.
  for (const auto& [flags, why] : std::vector<std::pair<std::string, std::string>>{
           {"--temperature inf", "--temperature must be a finite number >= 0 (0: greedy), got inf"},
           {"--temperature nan", "--temperature must be a finite number >= 0 (0: greedy), got nan"},
           {"--temperature -1", "--temperature must be a finite number >= 0 (0: greedy), got -1"},
           {"--seed -1", "--seed: must be a whole number from 0 to 18446744073709551615, got -1"},
           {"--seed 18446744073709551616", "--seed: must be a whole number"},
           {"--stop-id 99999", "--stop-id 99999 is outside the model's vocabulary"},
           {"--stop-id -5", "--stop-id -5 is outside the model's vocabulary"}}) {
    const CliRun bad = loom_cli("generate '" + run + "' --ids --prompt '5 17' --tokens 2 " + flags, d.p);
    EXPECT_NE(bad.code, 0) << flags;
    EXPECT_NE(bad.err.find(why), std::string::npos) << flags << ": " << bad.err;
  }
  EXPECT_EQ(loom_cli("generate '" + run + "' --ids --prompt '5 17' --tokens 2 --seed 18446744073709551615", d.p).code,
            0);
  // A seed is decimal: 010 is 10 (CLI11 alone read it as octal 8).
  const std::string few = "generate '" + run + "' --ids --prompt '5 17' --tokens 6 --quiet --seed ";
  EXPECT_EQ(loom_cli(few + "010", d.p).out, loom_cli(few + "10", d.p).out);
  EXPECT_NE(loom_cli(few + "010", d.p).out, loom_cli(few + "8", d.p).out);

  r = loom_cli("convert --from loom --to hf '" + run + "' '" + hf + "'", d.p);
  ASSERT_EQ(r.code, 0) << r.err;
  loom::train::SafetensorsReader in((dump / "model.safetensors").string()), out(hf + "/model.safetensors");
  for (const auto& e : out.entries()) EXPECT_EQ(out.read_f32(e.name), in.read_f32(e.name)) << e.name;

  // A file with a transposed projection: one line naming the file and tensor, exit 1, and the
  // earlier export and run untouched.
  const auto before = fs::file_size(hf + "/model.safetensors");
  loom::train::SafetensorsWriter w;
  std::vector<std::vector<float>> keep;
  for (const auto& e : in.entries()) {
    keep.push_back(in.read_f32(e.name));
    loom::Shape s = e.shape;
    if (e.name == "h.0.attn.c_attn.weight") std::swap(s[0], s[1]);
    w.add(e.name, loom::DType::f32, s, keep.back().data());
  }
  fs::create_directories(d.p / "bad");
  w.write((d.p / "bad/model.safetensors").string());
  fs::copy_file(dump / "config.json", d.p / "bad/config.json");
  r = loom_cli("convert --from hf --to loom '" + (d.p / "bad/model.safetensors").string() + "' '" + run + "2'", d.p);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find((d.p / "bad/model.safetensors").string()), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("h.0.attn.c_attn.weight"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_FALSE(fs::exists(run + "2/latest"));
  // A weight that is not finite is refused naming the file, the tensor and the element; an index
  // file where a GPT-2 model's one file belongs is named as such.
  {
    loom::train::SafetensorsWriter wn;
    std::vector<std::vector<float>> vals;
    for (const auto& e : in.entries()) {
      vals.push_back(in.read_f32(e.name));
      if (e.name == "h.0.ln_1.weight") vals.back()[3] = std::numeric_limits<float>::quiet_NaN();
      wn.add(e.name, loom::DType::f32, e.shape, vals.back().data());
    }
    fs::create_directories(d.p / "nan");
    wn.write((d.p / "nan/model.safetensors").string());
    fs::copy_file(dump / "config.json", d.p / "nan/config.json");
    r = loom_cli("convert --from hf --to loom '" + (d.p / "nan").string() + "' '" + run + "4'", d.p);
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.err.find((d.p / "nan/model.safetensors").string() + ": tensor 'h.0.ln_1.weight' holds nan at index 3"),
              std::string::npos)
        << r.err;
    std::ofstream(d.p / "nan/model.safetensors.index.json") << "{}";
    r = loom_cli("convert --from hf --to loom '" + (d.p / "nan/model.safetensors.index.json").string() + "' '" + run +
                     "5'",
                 d.p);
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.err.find("an index of sharded weights, and a GPT-2 model is read from one model.safetensors"),
              std::string::npos)
        << r.err;
  }
  // A config.json of more layers or a larger vocabulary than the weights hold is refused naming it
  // before a model is allocated from it (10^12 layers ran out of memory).
  for (const auto& [key, value] : std::vector<std::pair<std::string, int64_t>>{{"n_layer", 1'000'000'000'000},
                                                                              {"vocab_size", 2147483647}}) {
    nlohmann::json cfg = nlohmann::json::parse(std::ifstream(dump / "config.json"));
    cfg[key] = value;
    fs::create_directories(d.p / "big");
    fs::copy_file(dump / "model.safetensors", d.p / "big/model.safetensors", fs::copy_options::overwrite_existing);
    std::ofstream(d.p / "big/config.json", std::ios::trunc) << cfg.dump();
    r = loom_cli("convert --from hf --to loom '" + (d.p / "big").string() + "' '" + run + "3'", d.p);
    EXPECT_EQ(r.code, 1) << key;
    EXPECT_NE(r.err.find((d.p / "big/config.json").string() + ": the model "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("but the weights hold"), std::string::npos) << r.err;
  }
  // A tensor the config's model needs and the file lacks is named, where the counts find the file
  // short (not only counted); the causal-mask buffers (h.N.attn.bias) left out too, so that they
  // do not make up the count.
  {
    const loom::train::SafetensorsReader src((dump / "model.safetensors").string());
    std::vector<std::vector<float>> keep;
    loom::train::SafetensorsWriter w;
    std::string dropped;
    for (const loom::train::SafetensorsEntry& e : src.entries()) {
      if (dropped.empty() && e.name.find("h.0.mlp.c_fc.bias") != std::string::npos) {
        dropped = e.name;
        continue;
      }
      if (e.name.ends_with(".attn.bias")) continue;
      keep.push_back(src.read_f32(e.name));
      w.add(e.name, loom::DType::f32, e.shape, keep.back().data());
    }
    ASSERT_FALSE(dropped.empty());
    fs::create_directories(d.p / "short");
    w.write((d.p / "short/model.safetensors").string());
    fs::copy_file(dump / "config.json", d.p / "short/config.json", fs::copy_options::overwrite_existing);
    r = loom_cli("convert --from hf --to loom '" + (d.p / "short").string() + "' '" + run + "6'", d.p);
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.err.find("but the weights hold"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("tensor 'h.0.mlp.c_fc.bias' is in none of them"), std::string::npos) << r.err;
  }

  // Converting into a run that already has checkpoints is refused; exporting over an export from
  // a checkpoint that does not exist leaves the export.
  r = loom_cli("convert --from hf --to loom '" + (dump / "model.safetensors").string() + "' '" + run + "'", d.p);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("already holds a run ("), std::string::npos) << r.err;
  r = loom_cli("convert --from loom --to hf '" + (d.p / "missing").string() + "' '" + hf + "'", d.p);
  EXPECT_EQ(r.code, 1);
  EXPECT_EQ(fs::file_size(hf + "/model.safetensors"), before);
  // An export into a directory that holds a model already (its weights would mix with the new
  // ones, e.g. Llama shards beside a GPT-2 model.safetensors) is refused naming them; other files
  // there (a tokenizer) are no obstacle.
  r = loom_cli("convert --from loom --to hf '" + run + "' '" + hf + "'", d.p);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find(hf + ": already holds a model (config.json, model.safetensors)"), std::string::npos) << r.err;
  EXPECT_EQ(fs::file_size(hf + "/model.safetensors"), before);
  fs::create_directories(d.p / "tok");
  std::ofstream(d.p / "tok/tokenizer.json") << "{}";
  r = loom_cli("convert --from loom --to hf '" + run + "' '" + (d.p / "tok").string() + "'", d.p);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(fs::exists(d.p / "tok/model.safetensors"));

  // A generate without a tokenizer says how to give one.
  r = loom_cli("generate '" + run + "' --prompt 'hello' --tokens 3", d.p);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("--tokenizer"), std::string::npos) << r.err;
}

// The Llama family through the CLI: the PyTorch reference's Hugging Face checkpoint (a directory
// of two shards and an index) converts into a run, loom eval gives the loss of every window of a
// token shard as the model's forward does window by window (the windows' shared boundary tokens,
// a shorter last window, several windows per batch), the run exports back to shards, and eval's
// bad arguments are one-line errors.
TEST(HfCli, LlamaConvertEvalAndExport) {
  LOOM_REQUIRE_LOOM();
  const fs::path dir = fs::path(LOOM_SOURCE_DIR) / "tests/model/hf_llama_tiny";
  TmpDir d;
  const std::string run = (d.p / "run").string(), hf = (d.p / "hf").string();
  CliRun r = loom_cli("convert --from hf --to loom '" + dir.string() + "' '" + run + "'", d.p);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("n_kv_head=2"), std::string::npos) << r.out;

  // 1000 tokens: windows of 64 predictions share their boundary token; 999 = 15 x 64 + 39.
  std::vector<uint32_t> ids(1000);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = uint32_t((i * 7919 + 13) % 503);
  const std::string shard = (d.p / "val_000.bin").string();
  loom::data::write_shard(shard, ids, 503);
  r = loom_cli("eval '" + run + "' --tokens '" + shard + "' --seq 64 --batch 4 --json", d.p);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("predicted"), 999);
  EXPECT_EQ(j.at("windows"), 16);
  // The same windows one at a time through the model.
  loom::MemoryPool pool("cpu:0");
  const std::string ckpt = loom::model::resolve_checkpoint(run);
  loom::model::GPT gpt(loom::model::checkpoint_model_config(ckpt), pool);
  loom::model::load_checkpoint_params(ckpt, gpt);
  double sum = 0;
  for (int64_t start = 0; start < 999; start += 64) {
    const int64_t L = std::min<int64_t>(64, 999 - start);
    loom::Tensor x = loom::Tensor::empty({1, L}, loom::DType::i32, loom::MemTag::workspace, pool);
    loom::Tensor y = loom::Tensor::empty({1, L}, loom::DType::i32, loom::MemTag::workspace, pool);
    for (int64_t t = 0; t < L; ++t) x.i32()[t] = int32_t(ids[size_t(start + t)]), y.i32()[t] = int32_t(ids[size_t(start + t + 1)]);
    sum += double(gpt.forward(x, y)) * double(L);
  }
  EXPECT_NEAR(j.at("loss").get<double>(), sum / 999, 1e-5 * sum / 999);
  EXPECT_NEAR(j.at("perplexity").get<double>(), std::exp(sum / 999), 1e-4 * std::exp(sum / 999));
  // With --stride 48 (Hugging Face's perplexity recipe): windows of 64 predictions start every 48
  // tokens and each counts only the tokens no earlier window predicted, so every token after the
  // first 64 is predicted with at least 16 before it, and each token once: the window at 48 counts
  // its last 48 predictions (targets 65-112), and so on; the last, at 960, predicts 961-999 and
  // counts 977-999.
  r = loom_cli("eval '" + run + "' --tokens '" + shard + "' --seq 64 --batch 4 --stride 48 --json", d.p);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto js = nlohmann::json::parse(r.out);
  EXPECT_EQ(js.at("predicted"), 999);
  EXPECT_EQ(js.at("windows"), 21);
  EXPECT_EQ(js.at("stride"), 48);
  double strided = 0;
  int64_t done = 0;
  for (int64_t start = 0;; start += 48) {
    const int64_t L = std::min<int64_t>(64, 999 - start);
    loom::Tensor x = loom::Tensor::empty({1, L}, loom::DType::i32, loom::MemTag::workspace, pool);
    loom::Tensor y = loom::Tensor::empty({1, L}, loom::DType::i32, loom::MemTag::workspace, pool);
    for (int64_t t = 0; t < L; ++t) x.i32()[t] = int32_t(ids[size_t(start + t)]), y.i32()[t] = int32_t(ids[size_t(start + t + 1)]);
    gpt.forward(x, y);
    const float* losses = gpt.losses().f32();  // per position
    for (int64_t t = done - start; t < L; ++t) strided += double(losses[t]);
    done = start + L;
    if (done == 999) break;
  }
  EXPECT_NEAR(js.at("loss").get<double>(), strided / 999, 1e-5 * strided / 999);
  // On a device (the emulated one: weights uploaded, bf16 compute copies and activations), within
  // 1e-2 of the f32 loss: one bf16 rounding (2^-9 relative) of every weight and activation moves
  // the mean loss by about 1e-3.
  r = loom_cli("eval '" + run + "' --tokens '" + shard + "' --seq 64 --batch 4 --json --device emu", d.p);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto je = nlohmann::json::parse(r.out);
  EXPECT_EQ(je.at("device"), "emu");
  EXPECT_EQ(je.at("predicted"), 999);
  EXPECT_NEAR(je.at("loss").get<double>(), sum / 999, 1e-2 * sum / 999);
  EXPECT_NE(je.at("loss").get<double>(), j.at("loss").get<double>()) << "bf16 on the device gave the f32 loss exactly";

  r = loom_cli("convert --from loom --to hf '" + run + "' '" + hf + "' --max-shard-mb 0.2", d.p);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(fs::exists(hf + "/model.safetensors.index.json"));

  for (const auto& [args, want] : std::vector<std::pair<std::string, std::string>>{
           {"eval '" + run + "'", "give one of --text FILE"},
           {"eval '" + run + "' --tokens '" + shard + "' --text x", "give one of --text FILE"},
           {"eval '" + run + "' --tokens '" + shard + "' --seq 65", "--seq 65 exceeds the model's block_size 64"},
           {"eval '" + run + "' --tokens '" + shard + "' --seq 32 --stride 33", "--stride 33 exceeds the window"},
           {"eval '" + run + "' --tokens '" + (d.p / "none.bin").string() + "'", "none.bin"},
           {"eval '" + run + "' --text '" + shard + "'", "no tokenizer found"}}) {
    r = loom_cli(args, d.p);
    EXPECT_EQ(r.code, 1) << args;
    EXPECT_NE(r.err.find(want), std::string::npos) << args << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

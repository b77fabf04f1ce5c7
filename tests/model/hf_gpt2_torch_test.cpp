// Logits of a Hugging Face-layout GPT-2 imported by loom against PyTorch: runs
// scripts/torch_hf_gpt2.py with Debian's python3-torch into the build directory (a fresh random
// model, "transformer."-prefixed keys) and compares at ||l - l_ref|| / ||l_ref|| <= 1e-5.
// Skips when /usr/bin/python3 cannot import torch.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "model/gpt.h"
#include "train/hf_gpt2.h"
#include "train/safetensors.h"

namespace fs = std::filesystem;
using namespace loom;

namespace {

constexpr const char* kPython = "/usr/bin/python3";

double imported_logits_error(const fs::path& dir) {
  const model::GPTConfig c = model::read_hf_config((dir / "config.json").string());
  MemoryPool pool("cpu:0");
  model::GPT gpt(c, pool, 1);
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
  return std::sqrt(num / den);
}

}  // namespace

TEST(HfGpt2Torch, ImportedLogitsMatchPyTorch) {
  if (std::system((std::string(kPython) + " -c 'import torch' >/dev/null 2>&1").c_str()) != 0)
    GTEST_SKIP() << kPython << " cannot import torch (install Debian's python3-torch)";
  struct Case {
    const char* args;
  };
  for (const Case& k : {Case{"--n-layer 2 --n-head 4 --n-embd 64 --vocab 500 --block 64 --batch 2 --seq 64 --seed 99 "
                             "--prefix"},
                        Case{"--n-layer 3 --n-head 2 --n-embd 48 --vocab 257 --block 40 --batch 3 --seq 33 --seed 5"}}) {
    const fs::path dir = fs::path(LOOM_BINARY_DIR) / "hf_gpt2_torch_dump";
    fs::remove_all(dir);
    const std::string cmd = std::string(kPython) + " " + LOOM_SOURCE_DIR + "/scripts/torch_hf_gpt2.py --out " +
                            dir.string() + " " + k.args;
    ASSERT_EQ(std::system(cmd.c_str()), 0) << "failed: " << cmd;
    const double rel = imported_logits_error(dir);
    std::printf("%s: ||l - l_ref|| / ||l_ref|| = %.3e\n", k.args, rel);
    EXPECT_LE(rel, 1e-5) << k.args;
  }
}

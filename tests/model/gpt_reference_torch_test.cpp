// Parity with PyTorch at GPT-2 124M shapes (B=2, T=64): runs scripts/torch_reference.py with
// Debian's python3-torch into the build directory (about 1 GB, regenerated when missing or of an
// older version) and compares. Skips when /usr/bin/python3 cannot import torch.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "model/reference_util.h"
#include "train/safetensors.h"

namespace {

constexpr const char* kPython = "/usr/bin/python3";

bool dump_is_current(const std::string& path) {
  if (!std::filesystem::exists(path)) return false;
  try {
    loom::train::SafetensorsReader r(path);
    return r.meta("version") == loom::test::kReferenceVersion && r.meta("model") == "gpt2-124m";
  } catch (const loom::Error&) {
    return false;
  }
}

}  // namespace

TEST(GPTReferenceTorch, Gpt2_124mMatchesPyTorch) {
  if (std::system((std::string(kPython) + " -c 'import torch' >/dev/null 2>&1").c_str()) != 0)
    GTEST_SKIP() << kPython << " cannot import torch (install Debian's python3-torch)";
  const std::string path = std::string(LOOM_BINARY_DIR) + "/gpt2_124m_reference.safetensors";
  if (!dump_is_current(path)) {
    const std::string cmd = std::string(kPython) + " " + LOOM_SOURCE_DIR +
                            "/scripts/torch_reference.py --model gpt2-124m --out " + path;
    ASSERT_EQ(std::system(cmd.c_str()), 0) << "failed: " << cmd;
  }
  loom::test::ReferenceTolerance tol;
  tol.step_loss_abs = 1e-3;  // loss 1e-5 rel, logits 1e-5, grads 1e-4 as for the tiny model
  loom::test::check_gpt_reference(path, tol);
}

// The Llama family at a larger shape than the committed dump (L=4, 8 query heads on 2 key/value
// heads, C=256, SwiGLU 688, V=1000, B=2, T=64), drawn fresh by scripts/torch_llama_reference.py.
TEST(LlamaReferenceTorch, SmallMatchesPyTorch) {
  if (std::system((std::string(kPython) + " -c 'import torch' >/dev/null 2>&1").c_str()) != 0)
    GTEST_SKIP() << kPython << " cannot import torch (install Debian's python3-torch)";
  const std::string path = std::string(LOOM_BINARY_DIR) + "/llama_small_reference.safetensors";
  const std::string cmd = std::string("cd ") + LOOM_SOURCE_DIR + "/scripts && " + kPython +
                          " torch_llama_reference.py --model llama-small --seed 77 --out " + path + " > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "failed: " << cmd;
  loom::test::ReferenceTolerance tol;  // loss 1e-5 rel, logits 1e-5, grads 1e-4, step losses 1e-4 abs
  loom::test::check_gpt_reference(path, tol);
}

// Parity with PyTorch on the committed tiny dump (L=2, H=4, C=64, V=503, B=4, T=32), written by
// scripts/torch_reference.py --model gpt2-tiny.
#include <gtest/gtest.h>

#include <filesystem>

#include "model/reference_util.h"

TEST(GPTReference, TinyMatchesPyTorch) {
  const std::string path = std::string(LOOM_SOURCE_DIR) + "/tests/data/gpt2_tiny_reference.safetensors";
  ASSERT_TRUE(std::filesystem::exists(path)) << path << " is missing (scripts/torch_reference.py writes it)";
  loom::test::ReferenceTolerance tol;  // loss 1e-5 rel, logits 1e-5, grads 1e-4, step losses 1e-4 abs
  loom::test::check_gpt_reference(path, tol);
}

// The Llama family (RMSNorm, rotary embeddings, grouped-query attention with 2 key/value heads for
// 4 query heads, SwiGLU of width 176, no biases, untied lm_head) against PyTorch on the committed
// dump written by scripts/torch_llama_reference.py --model llama-tiny (L=2, C=64, V=503, B=4,
// T=32), at the GPT-2 reference's tolerances.
TEST(LlamaReference, TinyMatchesPyTorch) {
  const std::string path = std::string(LOOM_SOURCE_DIR) + "/tests/data/llama_tiny_reference.safetensors";
  ASSERT_TRUE(std::filesystem::exists(path)) << path << " is missing (scripts/torch_llama_reference.py writes it)";
  loom::test::ReferenceTolerance tol;  // loss 1e-5 rel, logits 1e-5, grads 1e-4, step losses 1e-4 abs
  loom::test::check_gpt_reference(path, tol);
}

// Both dumps on the emulated device (bf16 compute copies and activations in its memory, weights
// uploaded, AdamW steps through train::StepRunner) at the CUDA model's tolerances
// (tests/model/gpt_cuda_backend_test.cu): loss 5e-3 relative, logits 2e-2, gradients 5e-2, the
// gradient norm 2e-2, step losses 2e-2 absolute, bounds for one bf16 rounding (2^-9) of every
// weight and stored activation against PyTorch's f32.
TEST(GPTReference, TinyMatchesPyTorchOnTheEmulatedDeviceInBf16) {
  const loom::test::ReferenceTolerance bf16{
      .loss_rel = 5e-3, .logits_rel = 2e-2, .grad_rel = 5e-2, .grad_norm_rel = 2e-2, .step_loss_abs = 2e-2};
  for (const char* name : {"gpt2_tiny_reference", "llama_tiny_reference"}) {
    SCOPED_TRACE(name);
    const std::string path = std::string(LOOM_SOURCE_DIR) + "/tests/data/" + name + ".safetensors";
    ASSERT_TRUE(std::filesystem::exists(path)) << path << " is missing";
    loom::test::check_gpt_reference(path, bf16, loom::Device::emu);
  }
}

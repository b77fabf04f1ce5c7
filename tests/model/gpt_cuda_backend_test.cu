// The one GPT (model/gpt.h, the chain blocks over core/backend.h) on the CUDA backend: the same
// model code the CPU runs, here in bf16 with f32 master weights, against the PyTorch reference
// dump (tests/data/gpt2_tiny_reference.safetensors, written by scripts/torch_reference.py) and
// against itself through the KV-cache decoder. Host code only (compiled by the C++ compiler);
// skipped without a GPU. Tolerances are those of the bf16 model (bf16 activations compounded over
// the network): loss 5e-3 relative, logits 2e-2 (norm), every parameter gradient 5e-2 (norm), the
// global gradient norm 2e-2, AdamW step losses 2e-2 absolute; decoder logits against the full
// forward's 2e-2 (norm: the same bf16 ops on other row counts). Tensor / sequence parallel ranks
// sharing the GPU are held to the same bounds against the CPU model.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "comm/nccl_comm.h"
#include "comm/threads.h"
#include "core/backend.h"
#include "core/error.h"
#include "kernels/cuda/cudnn_attention.cuh"
#include "model/gpt.h"
#include "model/kv_cache.h"
#include "model/device_model_check.h"
#include "model/reference_util.h"

using namespace loom;

namespace {

#define REQUIRE_CUDA_BACKEND()                                                    \
  do {                                                                            \
    std::string why_;                                                             \
    if (!backend_available(Device::cuda, &why_)) GTEST_SKIP() << "cuda backend: " << why_; \
  } while (0)

}  // namespace

// The reference check the CPU model passes (model/reference_util.h), on CUDA with the bf16 model's
// tolerances (its AdamW steps through train::StepRunner, as CUDA graphs).
TEST(GPTOnCuda, MatchesPyTorchReference) {
  REQUIRE_CUDA_BACKEND();
  const std::string path = std::string(LOOM_SOURCE_DIR) + "/tests/data/gpt2_tiny_reference.safetensors";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is missing (scripts/torch_reference.py writes it)";
  test::check_gpt_reference(
      path, {.loss_rel = 5e-3, .logits_rel = 2e-2, .grad_rel = 5e-2, .grad_norm_rel = 2e-2, .step_loss_abs = 2e-2},
      Device::cuda);
}

// Head size 64 (the flash and cuDNN kernels), every attention kernel the CUDA backend has.
TEST(GPTOnCuda, MatchesTheCpuModelWithEveryAttentionKernel) {
  REQUIRE_CUDA_BACKEND();
  test::check_against_cpu(test::device_check_gpt(2), Device::cuda,
                          {AttnKernel::automatic, AttnKernel::flash, AttnKernel::gemm});
}

// The Llama family (RMSNorm, rotary embeddings, SwiGLU, no biases, untied head) with grouped-query
// attention (4 query heads on 2 key/value heads, head size 64: cuDNN's graphs, which automatic
// picks where cuDNN is built in, and loom's flash kernels) and, separately, with multi-head
// attention on every kernel.
TEST(LlamaOnCuda, MatchesTheCpuModel) {
  REQUIRE_CUDA_BACKEND();
  const model::GPTConfig gqa = test::device_check_llama(2);
  test::check_against_cpu(gqa, Device::cuda, {AttnKernel::automatic, AttnKernel::flash});
  if (loom::cuda::cudnn_available()) test::check_against_cpu(gqa, Device::cuda, {AttnKernel::cudnn});
  test::check_against_cpu(test::device_check_llama(4), Device::cuda,
                          {AttnKernel::automatic, AttnKernel::flash, AttnKernel::gemm});
}

// tp 2 and 4, with and without sequence parallelism.
TEST(GPTOnCuda, TensorParallelRanksSharingTheGpuMatchTheCpuModel) {
  REQUIRE_CUDA_BACKEND();
  for (int tp : {2, 4})
    for (bool sp : {false, true}) test::check_model_parallel(test::device_check_gpt(4), Device::cuda, tp, sp);
}

// Key/value heads split over tp 2, replicated under tp 4.
TEST(LlamaOnCuda, TensorParallelRanksSharingTheGpuMatchTheCpuModel) {
  REQUIRE_CUDA_BACKEND();
  for (int tp : {2, 4})
    for (bool sp : {false, true}) test::check_model_parallel(test::device_check_llama(2), Device::cuda, tp, sp);
}

// Context parallelism (ring attention) on CUDA, alone, with tp + sp, over 4 ranks (T = 48: chunks
// of 6 positions), and for the Llama family (rotary positions of each rank's two chunks, GQA).
TEST(GPTOnCuda, ContextParallelRanksSharingTheGpuMatchTheCpuModel) {
  REQUIRE_CUDA_BACKEND();
  test::check_model_parallel(test::device_check_gpt(4), Device::cuda, 1, false, 2);
  test::check_model_parallel(test::device_check_gpt(4), Device::cuda, 1, false, 4);
  test::check_model_parallel(test::device_check_gpt(4), Device::cuda, 2, true, 2);
}

TEST(LlamaOnCuda, ContextParallelRanksSharingTheGpuMatchTheCpuModel) {
  REQUIRE_CUDA_BACKEND();
  test::check_model_parallel(test::device_check_llama(2), Device::cuda, 1, false, 2);
  test::check_model_parallel(test::device_check_llama(2), Device::cuda, 2, false, 2);
}

// A tp or cp group whose communicator takes host memory only is refused by name on the GPU.
TEST(GPTOnCuda, LayoutsWithoutDeviceCollectivesAreRefusedByName) {
  REQUIRE_CUDA_BACKEND();
  test::check_host_groups_refused(Device::cuda);
}

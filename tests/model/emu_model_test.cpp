// The one model on the emulated device (kernels/emu/backend.h: bf16 compute copies and
// activations in its memory, the CPU's kernels) against the CPU's f32 model, with the CUDA test's
// configurations and bounds (model/device_model_check.h): loss, every gradient, and the KV-cache
// decoder on the device against the device's full forward; tensor, sequence and context parallel
// ranks against the CPU model.
#include <gtest/gtest.h>

#include "model/device_model_check.h"

using namespace loom;

TEST(GPTOnEmu, MatchesTheCpuModel) {
  test::check_against_cpu(test::device_check_gpt(2), Device::emu, {AttnKernel::automatic});
}

// Grouped-query attention (4 query heads on 2 key/value heads) and multi-head attention.
TEST(LlamaOnEmu, MatchesTheCpuModel) {
  for (int64_t kv_heads : {2, 4})
    test::check_against_cpu(test::device_check_llama(kv_heads), Device::emu, {AttnKernel::automatic});
}

// Tensor (+ sequence) and context parallel ranks as threads, each on an emulated device of its
// own over communicators that take its buffers, against the CPU model: the CUDA test's layouts.
TEST(GPTOnEmu, ModelParallelRanksMatchTheCpuModel) {
  for (int tp : {2, 4})
    for (bool sp : {false, true}) test::check_model_parallel(test::device_check_gpt(4), Device::emu, tp, sp);
  test::check_model_parallel(test::device_check_gpt(4), Device::emu, 1, false, 2);
  test::check_model_parallel(test::device_check_gpt(4), Device::emu, 1, false, 4);
  test::check_model_parallel(test::device_check_gpt(4), Device::emu, 2, true, 2);
}

// Key/value heads split over tp 2, replicated under tp 4; ring attention with rotary positions.
TEST(LlamaOnEmu, ModelParallelRanksMatchTheCpuModel) {
  for (int tp : {2, 4})
    for (bool sp : {false, true}) test::check_model_parallel(test::device_check_llama(2), Device::emu, tp, sp);
  test::check_model_parallel(test::device_check_llama(2), Device::emu, 1, false, 2);
  test::check_model_parallel(test::device_check_llama(2), Device::emu, 2, false, 2);
}

// A tp or cp group whose communicator takes host memory only is refused by name, as on a GPU.
TEST(GPTOnEmu, LayoutsWithoutDeviceCollectivesAreRefusedByName) {
  test::check_host_groups_refused(Device::emu);
}

// The step runner suite (step_runner_suite.h) on the CPU backend, and on the emulated device (bf16
// compute, as the CUDA replica engine's step runs).
#include "step_runner_suite.h"

namespace loom::test {
INSTANTIATE_TEST_SUITE_P(Cpu, StepRunnerSuite, ::testing::Values(Device::cpu));
INSTANTIATE_TEST_SUITE_P(Emu, StepRunnerSuite, ::testing::Values(Device::emu));
}  // namespace loom::test

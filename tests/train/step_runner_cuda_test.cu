// The step runner suite (step_runner_suite.h) on the CUDA backend (host code only: compiled by the
// C++ compiler). Skipped without a GPU.
#include "step_runner_suite.h"

namespace loom::test {
INSTANTIATE_TEST_SUITE_P(Cuda, StepRunnerSuite, ::testing::Values(Device::cuda));
}  // namespace loom::test

// The step runner suite (step_runner_suite.h) on the CPU backend.
#include "step_runner_suite.h"

namespace loom::test {
INSTANTIATE_TEST_SUITE_P(Cpu, StepRunnerSuite, ::testing::Values(Device::cpu));
}  // namespace loom::test

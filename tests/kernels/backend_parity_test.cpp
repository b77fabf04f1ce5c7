// The backend op-parity suite (backend_parity.h) on the CPU backend.
#include "backend_parity.h"

namespace loom::test {
INSTANTIATE_TEST_SUITE_P(Cpu, BackendParity, ::testing::Values(ParityCase{Device::cpu, DType::f32}), parity_case_name);
}  // namespace loom::test

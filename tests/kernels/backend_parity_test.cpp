// The backend op-parity suite (backend_parity.h) on the CPU backend, and on the emulated device
// (kernels/emu/backend.h) in both of its compute dtypes.
#include "backend_parity.h"

namespace loom::test {
INSTANTIATE_TEST_SUITE_P(Cpu, BackendParity, ::testing::Values(ParityCase{Device::cpu, DType::f32}), parity_case_name);
INSTANTIATE_TEST_SUITE_P(Emu, BackendParity,
                         ::testing::Values(ParityCase{Device::emu, DType::bf16}, ParityCase{Device::emu, DType::f32}),
                         parity_case_name);
}  // namespace loom::test

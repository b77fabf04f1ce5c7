// The backend op-parity suite (backend_parity.h) on the CPU backend.
#include "backend_parity.h"

namespace loom::test {
INSTANTIATE_TEST_SUITE_P(Cpu, BackendParity, ::testing::Values(Device::cpu));
}  // namespace loom::test

// The backend op-parity suite (backend_parity.h) on the CUDA backend (host code only: compiled by
// the C++ compiler). Skipped without a GPU.
#include "../backend_parity.h"

namespace loom::test {
INSTANTIATE_TEST_SUITE_P(Cuda, BackendParity, ::testing::Values(Device::cuda));
}  // namespace loom::test

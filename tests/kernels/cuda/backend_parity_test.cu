// The backend op-parity suite (backend_parity.h) on the CUDA backend (host code only: compiled by
// the C++ compiler). Skipped without a GPU.
#include "../backend_parity.h"

namespace loom::test {
// bf16 (train.precision bf16, the default) and f16 (fp16, with loss scaling): the same ops.
INSTANTIATE_TEST_SUITE_P(Cuda, BackendParity,
                         ::testing::Values(ParityCase{Device::cuda, DType::bf16}, ParityCase{Device::cuda, DType::f16}),
                         parity_case_name);
}  // namespace loom::test

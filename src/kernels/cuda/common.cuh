// Shared by every CUDA op: error checks with file:line, bf16 helpers, launch arithmetic.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/error.h"

#define LOOM_CUDA_CHECK(expr)                                                              \
  do {                                                                                     \
    cudaError_t err_ = (expr);                                                             \
    if (err_ != cudaSuccess) LOOM_FAIL("CUDA error {} ({}) in {}", int(err_), cudaGetErrorString(err_), #expr); \
  } while (0)

// After a kernel launch: launch-configuration errors surface here, not at the next sync.
#define LOOM_CUDA_LAUNCH_CHECK() LOOM_CUDA_CHECK(cudaGetLastError())

namespace loom::cuda {

using bf16 = __nv_bfloat16;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace loom::cuda

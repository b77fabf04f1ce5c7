// Shared by every CUDA op: error checks with file:line, the two 16-bit compute types (bf16 and
// f16) with their conversions and 16-byte vectors, launch arithmetic and block reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"
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
using f16 = __half;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// 16 bytes of a 16-bit type (8 elements) for vectorised loads and stores.
template <class T>
struct alignas(16) Vec8 {
  T v[8];
};
using bf16x8 = Vec8<bf16>;

// The kernels' element types are bf16 and f16 (train.precision bf16 and fp16); both compute in f32.
__host__ __device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
__host__ __device__ __forceinline__ float to_f32(f16 x) { return __half2float(x); }
template <class T>
__host__ __device__ __forceinline__ T from_f32(float x);
template <>
__host__ __device__ __forceinline__ bf16 from_f32<bf16>(float x) {
  return __float2bfloat16(x);
}
template <>
__host__ __device__ __forceinline__ f16 from_f32<f16>(float x) {
  return __float2half(x);
}

// Runs `body` (a generic lambda taking a T* tag) for the 16-bit type of `dtype` (bf16 or f16).
#define LOOM_CUDA_DISPATCH_16(dtype, what, ...)                                                         \
  do {                                                                                                   \
    auto loom_body_ = __VA_ARGS__;                                                                       \
    if ((dtype) == ::loom::DType::bf16)                                                                  \
      loom_body_(static_cast<::loom::cuda::bf16*>(nullptr));                                            \
    else if ((dtype) == ::loom::DType::f16)                                                              \
      loom_body_(static_cast<::loom::cuda::f16*>(nullptr));                                             \
    else                                                                                                 \
      LOOM_FAIL("{}: {} is not a CUDA compute type (bf16 or f16)", what, ::loom::dtype_name(dtype));     \
  } while (0)

// Device code only: host sources (compiled by the C++ compiler) may include this header for the
// checks and types above.
#ifdef __CUDACC__
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `shared` holds at least 32 floats. Fixed order, so the result is repeatable.
__device__ __forceinline__ float block_sum(float x, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  x = warp_sum(x);
  __syncthreads();
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  float r = lane < nwarps ? shared[lane] : 0.f;
  return warp_sum(r);
}

__device__ __forceinline__ float block_max(float x, float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  x = warp_max(x);
  __syncthreads();
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  float r = lane < nwarps ? shared[lane] : -INFINITY;
  return warp_max(r);
}
#endif  // __CUDACC__

// The number of streaming multiprocessors of the current device (cached per device).
int num_sms();

// Whether `stream` is being captured into a CUDA graph.
bool stream_capturing(cudaStream_t stream);

}  // namespace loom::cuda

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gelu.cuh"

namespace loom::cuda {
namespace {

constexpr float kS = 0.7978845608028654f;  // sqrt(2 / pi)

__device__ __forceinline__ float gelu(float x) {
  const float u = kS * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.f + tanhf(u));
}

__device__ __forceinline__ float gelu_grad(float x) {
  const float u = kS * (x + 0.044715f * x * x * x);
  const float t = tanhf(u);
  const float du = kS * (1.f + 3.f * 0.044715f * x * x);
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * du;
}

// Each thread handles 8 elements with 16-byte accesses; the tail (n % 8) element-wise.
template <class T>
__global__ void gelu_forward_kernel(T* out, const T* inp, int64_t n) {
  const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (i + 8 <= n) {
    Vec8<T> v = *reinterpret_cast<const Vec8<T>*>(inp + i);
#pragma unroll
    for (int k = 0; k < 8; ++k) v.v[k] = from_f32<T>(gelu(to_f32(v.v[k])));
    *reinterpret_cast<Vec8<T>*>(out + i) = v;
  } else {
    for (int64_t j = i; j < n; ++j) out[j] = from_f32<T>(gelu(to_f32(inp[j])));
  }
}

template <class T>
__global__ void gelu_backward_kernel(T* dinp, const T* inp, const T* dout, int64_t n) {
  const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (i + 8 <= n) {
    Vec8<T> x = *reinterpret_cast<const Vec8<T>*>(inp + i);
    Vec8<T> g = *reinterpret_cast<const Vec8<T>*>(dout + i);
#pragma unroll
    for (int k = 0; k < 8; ++k)
      g.v[k] = from_f32<T>(to_f32(g.v[k]) * gelu_grad(to_f32(x.v[k])));
    *reinterpret_cast<Vec8<T>*>(dinp + i) = g;
  } else {
    for (int64_t j = i; j < n; ++j)
      dinp[j] = from_f32<T>(to_f32(dout[j]) * gelu_grad(to_f32(inp[j])));
  }
}

void check_aligned(const char* what, const void* p) {
  LOOM_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "{}: pointer {} is not 16-byte aligned", what, p);
}

}  // namespace

template <class T>
void gelu_forward(T* out, const T* inp, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  check_aligned("gelu_forward", out);
  check_aligned("gelu_forward", inp);
  gelu_forward_kernel<T><<<unsigned(ceil_div(ceil_div(n, 8), 256)), 256, 0, stream>>>(out, inp, n);
  LOOM_CUDA_LAUNCH_CHECK();
}

template <class T>
void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  check_aligned("gelu_backward", dinp);
  check_aligned("gelu_backward", inp);
  check_aligned("gelu_backward", dout);
  gelu_backward_kernel<T><<<unsigned(ceil_div(ceil_div(n, 8), 256)), 256, 0, stream>>>(dinp, inp, dout, n);
  LOOM_CUDA_LAUNCH_CHECK();
}

template void gelu_forward<bf16>(bf16*, const bf16*, int64_t, cudaStream_t);
template void gelu_forward<f16>(f16*, const f16*, int64_t, cudaStream_t);
template void gelu_backward<bf16>(bf16*, const bf16*, const bf16*, int64_t, cudaStream_t);
template void gelu_backward<f16>(f16*, const f16*, const f16*, int64_t, cudaStream_t);

}  // namespace loom::cuda

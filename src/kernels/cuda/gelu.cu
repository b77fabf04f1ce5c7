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
__global__ void gelu_forward_kernel(bf16* out, const bf16* inp, int64_t n) {
  const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (i + 8 <= n) {
    bf16x8 v = *reinterpret_cast<const bf16x8*>(inp + i);
#pragma unroll
    for (int k = 0; k < 8; ++k) v.v[k] = __float2bfloat16(gelu(__bfloat162float(v.v[k])));
    *reinterpret_cast<bf16x8*>(out + i) = v;
  } else {
    for (int64_t j = i; j < n; ++j) out[j] = __float2bfloat16(gelu(__bfloat162float(inp[j])));
  }
}

__global__ void gelu_backward_kernel(bf16* dinp, const bf16* inp, const bf16* dout, int64_t n) {
  const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (i + 8 <= n) {
    bf16x8 x = *reinterpret_cast<const bf16x8*>(inp + i);
    bf16x8 g = *reinterpret_cast<const bf16x8*>(dout + i);
#pragma unroll
    for (int k = 0; k < 8; ++k)
      g.v[k] = __float2bfloat16(__bfloat162float(g.v[k]) * gelu_grad(__bfloat162float(x.v[k])));
    *reinterpret_cast<bf16x8*>(dinp + i) = g;
  } else {
    for (int64_t j = i; j < n; ++j)
      dinp[j] = __float2bfloat16(__bfloat162float(dout[j]) * gelu_grad(__bfloat162float(inp[j])));
  }
}

void check_aligned(const char* what, const void* p) {
  LOOM_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0, "{}: pointer {} is not 16-byte aligned", what, p);
}

}  // namespace

void gelu_forward(bf16* out, const bf16* inp, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  check_aligned("gelu_forward", out);
  check_aligned("gelu_forward", inp);
  gelu_forward_kernel<<<unsigned(ceil_div(ceil_div(n, 8), 256)), 256, 0, stream>>>(out, inp, n);
  LOOM_CUDA_LAUNCH_CHECK();
}

void gelu_backward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  check_aligned("gelu_backward", dinp);
  check_aligned("gelu_backward", inp);
  check_aligned("gelu_backward", dout);
  gelu_backward_kernel<<<unsigned(ceil_div(ceil_div(n, 8), 256)), 256, 0, stream>>>(dinp, inp, dout, n);
  LOOM_CUDA_LAUNCH_CHECK();
}

}  // namespace loom::cuda

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/llama.cuh"

namespace loom::cuda {
namespace {

struct RopeFreqs {
  double f[kRopeMaxHead / 2];
};

// One thread per (row, pair index i): the angle's sine and cosine once, then every head of the row.
__global__ void rope_kernel(bf16* x, int64_t rows, int64_t T, int64_t NH, int64_t HS, int64_t stride, RopeFreqs fr,
                            int64_t pos0, const int32_t* positions, bool inverse) {
  const int64_t half = HS / 2;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * half) return;
  const int64_t r = idx / half, i = idx % half, t = r % T;
  const double p = positions ? double(positions[t]) : double(pos0 + t);
  double s = 0, c = 0;
  sincos(p * fr.f[i], &s, &c);
  const float cf = float(c), sf = float(inverse ? -s : s);
  bf16* row = x + r * stride;
  for (int64_t h = 0; h < NH; ++h) {
    bf16* lo = row + h * HS + i;
    bf16* hi = lo + half;
    const float x0 = __bfloat162float(*lo), x1 = __bfloat162float(*hi);
    *lo = __float2bfloat16(x0 * cf - x1 * sf);
    *hi = __float2bfloat16(x1 * cf + x0 * sf);
  }
}

__device__ __forceinline__ float sigmoid(float a) {
  const float e = __expf(-fabsf(a));
  return a >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
}

__global__ void swiglu_forward_kernel(bf16* out, const bf16* inp, int64_t N, int64_t H) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * H) return;
  const int64_t n = idx / H, j = idx % H;
  const float g = __bfloat162float(inp[n * 2 * H + j]), u = __bfloat162float(inp[n * 2 * H + H + j]);
  out[idx] = __float2bfloat16(g * sigmoid(g) * u);
}

__global__ void swiglu_backward_kernel(bf16* dinp, const bf16* dout, const bf16* inp, int64_t N, int64_t H) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * H) return;
  const int64_t n = idx / H, j = idx % H;
  const float g = __bfloat162float(inp[n * 2 * H + j]), u = __bfloat162float(inp[n * 2 * H + H + j]);
  const float d = __bfloat162float(dout[idx]), s = sigmoid(g);
  // Both read before either is written: dinp may alias inp.
  dinp[n * 2 * H + j] = __float2bfloat16(d * u * s * (1.f + g * (1.f - s)));
  dinp[n * 2 * H + H + j] = __float2bfloat16(d * g * s);
}

}  // namespace

void rope(bf16* x, int64_t B, int64_t T, int64_t NH, int64_t HS, int64_t stride, const double* inv_freq, int64_t pos0,
          const int32_t* positions, bool inverse, cudaStream_t stream) {
  LOOM_CHECK(B >= 0 && T >= 0 && NH > 0 && HS > 0 && HS % 2 == 0 && HS <= kRopeMaxHead && stride >= NH * HS,
             "cuda rope: bad shape B={} T={} NH={} HS={} (even, at most {}) stride={}", B, T, NH, HS, kRopeMaxHead,
             stride);
  LOOM_CHECK(inv_freq, "cuda rope: inv_freq is null");
  if (B * T == 0) return;
  RopeFreqs fr{};
  for (int64_t i = 0; i < HS / 2; ++i) fr.f[i] = inv_freq[i];
  const int64_t n = B * T * (HS / 2);
  rope_kernel<<<unsigned(ceil_div(n, 256)), 256, 0, stream>>>(x, B * T, T, NH, HS, stride, fr, pos0, positions,
                                                                inverse);
  LOOM_CUDA_LAUNCH_CHECK();
}

void swiglu_forward(bf16* out, const bf16* inp, int64_t N, int64_t H, cudaStream_t stream) {
  LOOM_CHECK(N >= 0 && H > 0, "cuda swiglu_forward: bad size N={} H={}", N, H);
  if (N == 0) return;
  swiglu_forward_kernel<<<unsigned(ceil_div(N * H, 256)), 256, 0, stream>>>(out, inp, N, H);
  LOOM_CUDA_LAUNCH_CHECK();
}

void swiglu_backward(bf16* dinp, const bf16* dout, const bf16* inp, int64_t N, int64_t H, cudaStream_t stream) {
  LOOM_CHECK(N >= 0 && H > 0, "cuda swiglu_backward: bad size N={} H={}", N, H);
  if (N == 0) return;
  swiglu_backward_kernel<<<unsigned(ceil_div(N * H, 256)), 256, 0, stream>>>(dinp, dout, inp, N, H);
  LOOM_CUDA_LAUNCH_CHECK();
}

}  // namespace loom::cuda

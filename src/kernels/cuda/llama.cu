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

// Vectorised (HS a multiple of 16, the row stride of 8 elements, x 16-byte aligned): one thread per
// (row, group of 8 consecutive pair indices), 16-byte accesses to each head's halves. The same
// arithmetic per element as rope_kernel.
__global__ void rope_kernel8(bf16* x, int64_t rows, int64_t T, int64_t NH, int64_t HS, int64_t stride, RopeFreqs fr,
                             int64_t pos0, const int32_t* positions, bool inverse) {
  const int64_t half = HS / 2, groups = half / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * groups) return;
  const int64_t r = idx / groups, i0 = (idx % groups) * 8, t = r % T;
  const double p = positions ? double(positions[t]) : double(pos0 + t);
  float cf[8], sf[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    double s = 0, c = 0;
    sincos(p * fr.f[i0 + j], &s, &c);
    cf[j] = float(c);
    sf[j] = float(inverse ? -s : s);
  }
  bf16* row = x + r * stride;
  for (int64_t h = 0; h < NH; ++h) {
    bf16x8* lo = reinterpret_cast<bf16x8*>(row + h * HS + i0);
    bf16x8* hi = reinterpret_cast<bf16x8*>(row + h * HS + i0 + half);
    const bf16x8 a = *lo, b = *hi;
    bf16x8 oa, ob;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float x0 = __bfloat162float(a.v[j]), x1 = __bfloat162float(b.v[j]);
      oa.v[j] = __float2bfloat16(x0 * cf[j] - x1 * sf[j]);
      ob.v[j] = __float2bfloat16(x1 * cf[j] + x0 * sf[j]);
    }
    *lo = oa;
    *hi = ob;
  }
}

__device__ __forceinline__ float sigmoid(float a) {
  const float e = __expf(-fabsf(a));
  return a >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
}

__device__ __forceinline__ float swiglu_value(float g, float u) { return g * sigmoid(g) * u; }

// d(gate), d(up) from d(out), gate and up.
__device__ __forceinline__ void swiglu_grad(float d, float g, float u, float& dg, float& du) {
  const float s = sigmoid(g);
  dg = d * u * s * (1.f + g * (1.f - s));
  du = d * g * s;
}

// Vectorised: each thread 8 consecutive columns of a row (H a multiple of 8, 16-byte aligned
// buffers); a memory-bound pass at 16-byte accesses.
__global__ void swiglu_forward_kernel8(bf16* out, const bf16* inp, int64_t N, int64_t H) {
  const int64_t groups = H / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * groups) return;
  const int64_t n = idx / groups, j = (idx % groups) * 8;
  const bf16x8 g = *reinterpret_cast<const bf16x8*>(inp + n * 2 * H + j);
  const bf16x8 u = *reinterpret_cast<const bf16x8*>(inp + n * 2 * H + H + j);
  bf16x8 o;
#pragma unroll
  for (int i = 0; i < 8; ++i) o.v[i] = __float2bfloat16(swiglu_value(__bfloat162float(g.v[i]), __bfloat162float(u.v[i])));
  *reinterpret_cast<bf16x8*>(out + n * H + j) = o;
}

__global__ void swiglu_backward_kernel8(bf16* dinp, const bf16* dout, const bf16* inp, int64_t N, int64_t H) {
  const int64_t groups = H / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * groups) return;
  const int64_t n = idx / groups, j = (idx % groups) * 8;
  // Both read before either is written: dinp may alias inp.
  const bf16x8 g = *reinterpret_cast<const bf16x8*>(inp + n * 2 * H + j);
  const bf16x8 u = *reinterpret_cast<const bf16x8*>(inp + n * 2 * H + H + j);
  const bf16x8 d = *reinterpret_cast<const bf16x8*>(dout + n * H + j);
  bf16x8 dg, du;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float a, b;
    swiglu_grad(__bfloat162float(d.v[i]), __bfloat162float(g.v[i]), __bfloat162float(u.v[i]), a, b);
    dg.v[i] = __float2bfloat16(a);
    du.v[i] = __float2bfloat16(b);
  }
  *reinterpret_cast<bf16x8*>(dinp + n * 2 * H + j) = dg;
  *reinterpret_cast<bf16x8*>(dinp + n * 2 * H + H + j) = du;
}

// Any H or alignment: one element per thread.
__global__ void swiglu_forward_kernel(bf16* out, const bf16* inp, int64_t N, int64_t H) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * H) return;
  const int64_t n = idx / H, j = idx % H;
  out[idx] = __float2bfloat16(swiglu_value(__bfloat162float(inp[n * 2 * H + j]), __bfloat162float(inp[n * 2 * H + H + j])));
}

__global__ void swiglu_backward_kernel(bf16* dinp, const bf16* dout, const bf16* inp, int64_t N, int64_t H) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * H) return;
  const int64_t n = idx / H, j = idx % H;
  float dg, du;
  swiglu_grad(__bfloat162float(dout[idx]), __bfloat162float(inp[n * 2 * H + j]), __bfloat162float(inp[n * 2 * H + H + j]),
              dg, du);
  dinp[n * 2 * H + j] = __float2bfloat16(dg);
  dinp[n * 2 * H + H + j] = __float2bfloat16(du);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

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
  if (HS % 16 == 0 && stride % 8 == 0 && aligned16(x)) {
    const int64_t n = B * T * (HS / 16);
    rope_kernel8<<<unsigned(ceil_div(n, 256)), 256, 0, stream>>>(x, B * T, T, NH, HS, stride, fr, pos0, positions,
                                                                   inverse);
  } else {
    const int64_t n = B * T * (HS / 2);
    rope_kernel<<<unsigned(ceil_div(n, 256)), 256, 0, stream>>>(x, B * T, T, NH, HS, stride, fr, pos0, positions,
                                                                  inverse);
  }
  LOOM_CUDA_LAUNCH_CHECK();
}

void swiglu_forward(bf16* out, const bf16* inp, int64_t N, int64_t H, cudaStream_t stream) {
  LOOM_CHECK(N >= 0 && H > 0, "cuda swiglu_forward: bad size N={} H={}", N, H);
  if (N == 0) return;
  if (H % 8 == 0 && aligned16(out) && aligned16(inp))
    swiglu_forward_kernel8<<<unsigned(ceil_div(N * H / 8, 256)), 256, 0, stream>>>(out, inp, N, H);
  else
    swiglu_forward_kernel<<<unsigned(ceil_div(N * H, 256)), 256, 0, stream>>>(out, inp, N, H);
  LOOM_CUDA_LAUNCH_CHECK();
}

void swiglu_backward(bf16* dinp, const bf16* dout, const bf16* inp, int64_t N, int64_t H, cudaStream_t stream) {
  LOOM_CHECK(N >= 0 && H > 0, "cuda swiglu_backward: bad size N={} H={}", N, H);
  if (N == 0) return;
  if (H % 8 == 0 && aligned16(dinp) && aligned16(dout) && aligned16(inp))
    swiglu_backward_kernel8<<<unsigned(ceil_div(N * H / 8, 256)), 256, 0, stream>>>(dinp, dout, inp, N, H);
  else
    swiglu_backward_kernel<<<unsigned(ceil_div(N * H, 256)), 256, 0, stream>>>(dinp, dout, inp, N, H);
  LOOM_CUDA_LAUNCH_CHECK();
}

}  // namespace loom::cuda

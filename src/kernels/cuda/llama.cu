#include "kernels/cuda/common.cuh"
#include "kernels/cuda/llama.cuh"

namespace loom::cuda {
namespace {

struct RopeFreqs {
  double f[kRopeMaxHead / 2];
};

// One thread per (row, pair index i): the angle's sine and cosine once, then every head of the row.
template <class E>
__global__ void rope_kernel(E* x, int64_t rows, int64_t T, int64_t NH, int64_t HS, int64_t stride, RopeFreqs fr,
                            int64_t pos0, const int32_t* positions, bool inverse) {
  const int64_t half = HS / 2;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * half) return;
  const int64_t r = idx / half, i = idx % half, t = r % T;
  const double p = positions ? double(positions[t]) : double(pos0 + t);
  double s = 0, c = 0;
  sincos(p * fr.f[i], &s, &c);
  const float cf = float(c), sf = float(inverse ? -s : s);
  E* row = x + r * stride;
  for (int64_t h = 0; h < NH; ++h) {
    E* lo = row + h * HS + i;
    E* hi = lo + half;
    const float x0 = to_f32(*lo), x1 = to_f32(*hi);
    *lo = from_f32<E>(x0 * cf - x1 * sf);
    *hi = from_f32<E>(x1 * cf + x0 * sf);
  }
}

// Vectorised (HS a multiple of 16, the row stride of 8 elements, x 16-byte aligned): one thread per
// (row, group of 8 consecutive pair indices), 16-byte accesses to each head's halves. The same
// arithmetic per element as rope_kernel.
template <class E>
__global__ void rope_kernel8(E* x, int64_t rows, int64_t T, int64_t NH, int64_t HS, int64_t stride, RopeFreqs fr,
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
  E* row = x + r * stride;
  for (int64_t h = 0; h < NH; ++h) {
    Vec8<E>* lo = reinterpret_cast<Vec8<E>*>(row + h * HS + i0);
    Vec8<E>* hi = reinterpret_cast<Vec8<E>*>(row + h * HS + i0 + half);
    const Vec8<E> a = *lo, b = *hi;
    Vec8<E> oa, ob;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float x0 = to_f32(a.v[j]), x1 = to_f32(b.v[j]);
      oa.v[j] = from_f32<E>(x0 * cf[j] - x1 * sf[j]);
      ob.v[j] = from_f32<E>(x1 * cf[j] + x0 * sf[j]);
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
template <class T>
__global__ void swiglu_forward_kernel8(T* out, const T* inp, int64_t N, int64_t H) {
  const int64_t groups = H / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * groups) return;
  const int64_t n = idx / groups, j = (idx % groups) * 8;
  const Vec8<T> g = *reinterpret_cast<const Vec8<T>*>(inp + n * 2 * H + j);
  const Vec8<T> u = *reinterpret_cast<const Vec8<T>*>(inp + n * 2 * H + H + j);
  Vec8<T> o;
#pragma unroll
  for (int i = 0; i < 8; ++i) o.v[i] = from_f32<T>(swiglu_value(to_f32(g.v[i]), to_f32(u.v[i])));
  *reinterpret_cast<Vec8<T>*>(out + n * H + j) = o;
}

template <class T>
__global__ void swiglu_backward_kernel8(T* dinp, const T* dout, const T* inp, int64_t N, int64_t H) {
  const int64_t groups = H / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * groups) return;
  const int64_t n = idx / groups, j = (idx % groups) * 8;
  // Both read before either is written: dinp may alias inp.
  const Vec8<T> g = *reinterpret_cast<const Vec8<T>*>(inp + n * 2 * H + j);
  const Vec8<T> u = *reinterpret_cast<const Vec8<T>*>(inp + n * 2 * H + H + j);
  const Vec8<T> d = *reinterpret_cast<const Vec8<T>*>(dout + n * H + j);
  Vec8<T> dg, du;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float a, b;
    swiglu_grad(to_f32(d.v[i]), to_f32(g.v[i]), to_f32(u.v[i]), a, b);
    dg.v[i] = from_f32<T>(a);
    du.v[i] = from_f32<T>(b);
  }
  *reinterpret_cast<Vec8<T>*>(dinp + n * 2 * H + j) = dg;
  *reinterpret_cast<Vec8<T>*>(dinp + n * 2 * H + H + j) = du;
}

// Any H or alignment: one element per thread.
template <class T>
__global__ void swiglu_forward_kernel(T* out, const T* inp, int64_t N, int64_t H) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * H) return;
  const int64_t n = idx / H, j = idx % H;
  out[idx] = from_f32<T>(swiglu_value(to_f32(inp[n * 2 * H + j]), to_f32(inp[n * 2 * H + H + j])));
}

template <class T>
__global__ void swiglu_backward_kernel(T* dinp, const T* dout, const T* inp, int64_t N, int64_t H) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= N * H) return;
  const int64_t n = idx / H, j = idx % H;
  float dg, du;
  swiglu_grad(to_f32(dout[idx]), to_f32(inp[n * 2 * H + j]), to_f32(inp[n * 2 * H + H + j]), dg, du);
  dinp[n * 2 * H + j] = from_f32<T>(dg);
  dinp[n * 2 * H + H + j] = from_f32<T>(du);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

template <class E>
void rope(E* x, int64_t B, int64_t T, int64_t NH, int64_t HS, int64_t stride, const double* inv_freq, int64_t pos0,
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
    rope_kernel8<E><<<unsigned(ceil_div(n, 256)), 256, 0, stream>>>(x, B * T, T, NH, HS, stride, fr, pos0, positions,
                                                                   inverse);
  } else {
    const int64_t n = B * T * (HS / 2);
    rope_kernel<E><<<unsigned(ceil_div(n, 256)), 256, 0, stream>>>(x, B * T, T, NH, HS, stride, fr, pos0, positions,
                                                                  inverse);
  }
  LOOM_CUDA_LAUNCH_CHECK();
}

template <class T>
void swiglu_forward(T* out, const T* inp, int64_t N, int64_t H, cudaStream_t stream) {
  LOOM_CHECK(N >= 0 && H > 0, "cuda swiglu_forward: bad size N={} H={}", N, H);
  if (N == 0) return;
  if (H % 8 == 0 && aligned16(out) && aligned16(inp))
    swiglu_forward_kernel8<T><<<unsigned(ceil_div(N * H / 8, 256)), 256, 0, stream>>>(out, inp, N, H);
  else
    swiglu_forward_kernel<T><<<unsigned(ceil_div(N * H, 256)), 256, 0, stream>>>(out, inp, N, H);
  LOOM_CUDA_LAUNCH_CHECK();
}

template <class T>
void swiglu_backward(T* dinp, const T* dout, const T* inp, int64_t N, int64_t H, cudaStream_t stream) {
  LOOM_CHECK(N >= 0 && H > 0, "cuda swiglu_backward: bad size N={} H={}", N, H);
  if (N == 0) return;
  if (H % 8 == 0 && aligned16(dinp) && aligned16(dout) && aligned16(inp))
    swiglu_backward_kernel8<T><<<unsigned(ceil_div(N * H / 8, 256)), 256, 0, stream>>>(dinp, dout, inp, N, H);
  else
    swiglu_backward_kernel<T><<<unsigned(ceil_div(N * H, 256)), 256, 0, stream>>>(dinp, dout, inp, N, H);
  LOOM_CUDA_LAUNCH_CHECK();
}

#define LOOM_LLAMA_INSTANTIATE(T)                                                                              \
  template void rope<T>(T*, int64_t, int64_t, int64_t, int64_t, int64_t, const double*, int64_t, const int32_t*, bool, \
                        cudaStream_t);                                                                          \
  template void swiglu_forward<T>(T*, const T*, int64_t, int64_t, cudaStream_t);                              \
  template void swiglu_backward<T>(T*, const T*, const T*, int64_t, int64_t, cudaStream_t);
LOOM_LLAMA_INSTANTIATE(bf16)
LOOM_LLAMA_INSTANTIATE(f16)
#undef LOOM_LLAMA_INSTANTIATE

}  // namespace loom::cuda

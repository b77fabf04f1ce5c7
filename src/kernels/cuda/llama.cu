#include "kernels/cuda/common.cuh"
#include "kernels/cuda/llama.cuh"

#include <algorithm>
#include <cstdint>

namespace loom::cuda {
namespace {

struct RopeFreqs {
  double f[kRopeMaxHead / 2];
};

// Elements i and i + HS / 2 of a head rotated by the angle whose cosine and sine are c and s. Both
// kernels below call it, so that they give the same bits.
// Each rounding is spelled out: left to the compiler, the two kernels fused different products.
__device__ __forceinline__ void rotate(float x0, float x1, float c, float s, float& o0, float& o1) {
  o0 = fmaf(x0, c, -__fmul_rn(x1, s));
  o1 = fmaf(x1, c, __fmul_rn(x0, s));
}

// The angle of pair i at row r (row t = r % T of its sequence), in double, as cosine and sine in
// f32 (the sine negated for the inverse).
__device__ __forceinline__ void rope_angle(const RopeFreqs& fr, int64_t t, int64_t i, int64_t pos0,
                                           const int32_t* positions, bool inverse, float& c, float& s) {
  const double p = positions ? double(positions[t]) : double(pos0 + t);
  double sd = 0, cd = 0;
  sincos(p * fr.f[i], &sd, &cd);
  c = float(cd);
  s = float(inverse ? -sd : sd);
}

// Any HS and alignment: one thread per (row, pair index i), every head of the row.
template <class E>
__global__ void rope_kernel(E* x, int64_t rows, int64_t T, int64_t NH, int64_t HS, int64_t stride, RopeFreqs fr,
                            int64_t pos0, const int32_t* positions, bool inverse) {
  const int64_t half = HS / 2;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * half) return;
  const int64_t r = idx / half, i = idx % half;
  float c, s;
  rope_angle(fr, r % T, i, pos0, positions, inverse, c, s);
  E* row = x + r * stride;
  for (int64_t h = 0; h < NH; ++h) {
    E* lo = row + h * HS + i;
    E* hi = lo + half;
    float o0, o1;
    rotate(to_f32(*lo), to_f32(*hi), c, s, o0, o1);
    *lo = from_f32<E>(o0);
    *hi = from_f32<E>(o1);
  }
}

// Vectorised (HS a multiple of 16, the row stride a multiple of 8 elements, x 16-byte aligned). A
// block takes rows_per_block rows: its threads first work out the rows' cosines and sines once per
// (row, pair) into shared memory, then each thread rotates (row, head, 8 consecutive pairs) items,
// 16-byte accesses to each half of a head. Every head of a row is in flight at once (a thread per
// row and 8 pairs walking the heads in turn left three quarters of an H200's thread slots empty
// at SmolLM's shapes, 59% of the memory bandwidth).
constexpr int kRopeThreads = 256;
static_assert(kRopeMaxHead / 2 <= kRopeThreads, "a block holds at least one row's cosines and sines");

template <class E>
__global__ void __launch_bounds__(kRopeThreads)
    rope_kernel8(E* x, int64_t rows, int64_t T, int64_t NH, int64_t HS, int64_t stride, RopeFreqs fr, int64_t pos0,
                 const int32_t* positions, bool inverse, int rows_per_block) {
  extern __shared__ float cs[];  // [rows_per_block][half] cosines, then as many sines
  // Indices within the block in 32 bits (HS at most kRopeMaxHead, at most kRopeThreads pairs).
  const int half = int(HS / 2), groups = half / 8, heads = int(NH);
  const int64_t r0 = int64_t(blockIdx.x) * rows_per_block;
  const int nr = rows - r0 < rows_per_block ? int(rows - r0) : rows_per_block;
  float* sn = cs + rows_per_block * half;
  for (int k = threadIdx.x; k < nr * half; k += blockDim.x)
    rope_angle(fr, (r0 + k / half) % T, k % half, pos0, positions, inverse, cs[k], sn[k]);
  __syncthreads();
  const int per_row = heads * groups;
  for (int k = threadIdx.x; k < nr * per_row; k += blockDim.x) {
    const int rl = k / per_row, h = (k % per_row) / groups, i0 = (k % groups) * 8;
    E* head = x + (r0 + rl) * stride + int64_t(h) * HS;
    Vec8<E>* lo = reinterpret_cast<Vec8<E>*>(head + i0);
    Vec8<E>* hi = reinterpret_cast<Vec8<E>*>(head + i0 + half);
    const Vec8<E> a = *lo, b = *hi;
    const float* c = cs + rl * half + i0;
    const float* s = sn + rl * half + i0;
    Vec8<E> oa, ob;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float o0, o1;
      rotate(to_f32(a.v[j]), to_f32(b.v[j]), c[j], s[j], o0, o1);
      oa.v[j] = from_f32<E>(o0);
      ob.v[j] = from_f32<E>(o1);
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

// d(gate), d(up) from d(out), gate and up. (The one product that meets a sum is fused explicitly,
// so that the vector and element kernels agree bit for bit whatever the compiler fuses.)
__device__ __forceinline__ void swiglu_grad(float d, float g, float u, float& dg, float& du) {
  const float s = sigmoid(g);
  dg = d * u * s * fmaf(g, 1.f - s, 1.f);
  du = d * g * s;
}

// Vectorised (H a multiple of 8, 16-byte aligned buffers): a block per row, each thread 8
// consecutive columns at a time; a memory-bound pass at 16-byte accesses. (A thread per 8 columns
// of the whole [N, H] found its row and column by 64-bit division, about as many instructions as
// the rest of the thread: 71% of an H200's memory bandwidth in the forward.)
template <class T>
__global__ void swiglu_forward_kernel8(T* out, const T* inp, int64_t H) {
  const int64_t n = blockIdx.x;
  const T* g_row = inp + n * 2 * H;
  const T* u_row = g_row + H;
  T* o_row = out + n * H;
  for (int64_t j = int64_t(threadIdx.x) * 8; j < H; j += int64_t(blockDim.x) * 8) {
    const Vec8<T> g = *reinterpret_cast<const Vec8<T>*>(g_row + j);
    const Vec8<T> u = *reinterpret_cast<const Vec8<T>*>(u_row + j);
    Vec8<T> o;
#pragma unroll
    for (int i = 0; i < 8; ++i) o.v[i] = from_f32<T>(swiglu_value(to_f32(g.v[i]), to_f32(u.v[i])));
    *reinterpret_cast<Vec8<T>*>(o_row + j) = o;
  }
}

template <class T>
__global__ void swiglu_backward_kernel8(T* dinp, const T* dout, const T* inp, int64_t H) {
  const int64_t n = blockIdx.x;
  const T* g_row = inp + n * 2 * H;
  const T* u_row = g_row + H;
  const T* d_row = dout + n * H;
  T* dg_row = dinp + n * 2 * H;
  T* du_row = dg_row + H;
  for (int64_t j = int64_t(threadIdx.x) * 8; j < H; j += int64_t(blockDim.x) * 8) {
    // Both read before either is written: dinp may alias inp.
    const Vec8<T> g = *reinterpret_cast<const Vec8<T>*>(g_row + j);
    const Vec8<T> u = *reinterpret_cast<const Vec8<T>*>(u_row + j);
    const Vec8<T> d = *reinterpret_cast<const Vec8<T>*>(d_row + j);
    Vec8<T> dg, du;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float a, b;
      swiglu_grad(to_f32(d.v[i]), to_f32(g.v[i]), to_f32(u.v[i]), a, b);
      dg.v[i] = from_f32<T>(a);
      du.v[i] = from_f32<T>(b);
    }
    *reinterpret_cast<Vec8<T>*>(dg_row + j) = dg;
    *reinterpret_cast<Vec8<T>*>(du_row + j) = du;
  }
}

// The vector kernels' block: a thread per 8 columns of the row, in whole warps, at most 256.
unsigned swiglu_block(int64_t H) { return unsigned(std::min<int64_t>(256, ceil_div(H / 8, 32) * 32)); }

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
    // One cosine and sine per thread: rows_per_block rows of HS / 2 pairs (HS / 2 at most 128).
    const int rows_per_block = int(kRopeThreads / (HS / 2));
    const size_t shmem = 2 * size_t(rows_per_block) * size_t(HS / 2) * sizeof(float);
    rope_kernel8<E><<<unsigned(ceil_div(B * T, rows_per_block)), kRopeThreads, shmem, stream>>>(
        x, B * T, T, NH, HS, stride, fr, pos0, positions, inverse, rows_per_block);
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
  if (H % 8 == 0 && N <= INT32_MAX && aligned16(out) && aligned16(inp))
    swiglu_forward_kernel8<T><<<unsigned(N), swiglu_block(H), 0, stream>>>(out, inp, H);
  else
    swiglu_forward_kernel<T><<<unsigned(ceil_div(N * H, 256)), 256, 0, stream>>>(out, inp, N, H);
  LOOM_CUDA_LAUNCH_CHECK();
}

template <class T>
void swiglu_backward(T* dinp, const T* dout, const T* inp, int64_t N, int64_t H, cudaStream_t stream) {
  LOOM_CHECK(N >= 0 && H > 0, "cuda swiglu_backward: bad size N={} H={}", N, H);
  if (N == 0) return;
  if (H % 8 == 0 && N <= INT32_MAX && aligned16(dinp) && aligned16(dout) && aligned16(inp))
    swiglu_backward_kernel8<T><<<unsigned(N), swiglu_block(H), 0, stream>>>(dinp, dout, inp, H);
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

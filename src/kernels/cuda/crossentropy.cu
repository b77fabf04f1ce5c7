#include "kernels/cuda/common.cuh"
#include "kernels/cuda/crossentropy.cuh"

#include <algorithm>
#include <map>
#include <mutex>

namespace loom::cuda {
namespace {

constexpr int kThreads = 512;

// The gradient of the 8 logits v at columns c..c+7 of a row with max M and 1 / sum of exp inv_s:
// dloss (softmax - onehot(target)) over the real columns; 0 in the padding (col >= V) and in an
// ignored row (target -1); NaN over the real columns for any other target outside [0, V).
template <class T>
__device__ __forceinline__ Vec8<T> dlogits_chunk(const Vec8<T>& v, int64_t c, float M, float inv_s, float dloss,
                                                int32_t target, int64_t V) {
  const bool ignored = target == -1;
  const bool valid = target >= 0 && target < V;
  Vec8<T> o;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t col = c + i;
    float g = 0.f;
    if (!ignored && col < V) {
      const float p = __expf(to_f32(v.v[i]) - M) * inv_s;
      g = valid ? dloss * (p - (col == target ? 1.f : 0.f)) : NAN;
    }
    o.v[i] = from_f32<T>(g);
  }
  return o;
}

// One block per row. Pass 1: per-thread online max / sum of exp over the row's first V columns,
// combined over the block. Pass 2 (with dlogits): writes the gradient over all Vp columns.
template <class T>
__global__ void __launch_bounds__(kThreads) crossentropy_kernel(float* losses, T* dlogits, const T* logits,
                                                               const int32_t* targets, float dloss, int64_t V,
                                                               int64_t Vp) {
  __shared__ float sh[32];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * Vp;
  const int32_t target = targets[row];
  float m = -INFINITY, s = 0.f;
  for (int64_t c = int64_t(threadIdx.x) * 8; c < Vp; c += kThreads * 8) {
    Vec8<T> v = *reinterpret_cast<const Vec8<T>*>(x + c);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (c + i >= V) break;
      const float f = to_f32(v.v[i]);
      if (f > m) {
        s = s * __expf(m - f) + 1.f;
        m = f;
      } else {
        s += __expf(f - m);
      }
    }
  }
  const float M = block_max(m, sh);
  const float S = block_sum(m == -INFINITY ? 0.f : s * __expf(m - M), sh);
  const float lse = M + logf(S);
  const bool ignored = target == -1;
  const bool valid = target >= 0 && target < V;
  if (threadIdx.x == 0 && losses) {
    losses[row] = ignored ? 0.f : (valid ? lse - to_f32(x[target]) : NAN);
  }
  if (!dlogits) return;
  // In place (dlogits == logits): each thread rewrites only the elements it reads itself below;
  // the one element another thread reads (the target's logit, by thread 0 above) is read before
  // this barrier.
  __syncthreads();
  T* dx = dlogits + row * Vp;
  const float inv_s = 1.f / S;
  for (int64_t c = int64_t(threadIdx.x) * 8; c < Vp; c += kThreads * 8) {
    Vec8<T> v = *reinterpret_cast<const Vec8<T>*>(x + c);
    const Vec8<T> o = dlogits_chunk<T>(v, c, M, inv_s, dloss, target, V);
    *reinterpret_cast<Vec8<T>*>(dx + c) = o;
  }
}

// Where the row fits in shared memory (both entry points, so that they give the same losses): the
// row is read from device memory once and kept in shared memory (Vp x 2 bytes) for the max,
// the sum of exponentials and the gradient, three passes with two block reductions between them.
// crossentropy_kernel reads each row twice: the second read comes from L2 at best, and with
// GPT-2's 50304 columns the rows in flight are about as large as an H100's L2. Same arithmetic per
// element as crossentropy_kernel but for the max, taken exactly before the exponentials instead
// of online.
template <class T>
__global__ void __launch_bounds__(kThreads) crossentropy_staged_kernel(float* losses, T* dlogits,
                                                                      const T* logits, const int32_t* targets,
                                                                      float dloss, int64_t V, int64_t Vp) {
  extern __shared__ __align__(16) unsigned char staged[];
  T* xs = reinterpret_cast<T*>(staged);
  __shared__ float sh[32];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * Vp;
  const int32_t target = targets[row];
  // kBatch 16-byte loads in flight per thread before the first is stored (one at a time, each
  // store would wait for its load).
  constexpr int kBatch = 4;
  float m = -INFINITY;
  for (int64_t c0 = int64_t(threadIdx.x) * 8; c0 < Vp; c0 += int64_t(kThreads) * 8 * kBatch) {
    Vec8<T> v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t c = c0 + int64_t(b) * kThreads * 8;
      if (c < Vp) v[b] = *reinterpret_cast<const Vec8<T>*>(x + c);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int64_t c = c0 + int64_t(b) * kThreads * 8;
      if (c >= Vp) break;
      *reinterpret_cast<Vec8<T>*>(xs + c) = v[b];
      if (c + 8 <= V) {
#pragma unroll
        for (int i = 0; i < 8; ++i) m = fmaxf(m, to_f32(v[b].v[i]));
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (c + i < V) m = fmaxf(m, to_f32(v[b].v[i]));
      }
    }
  }
  const float M = block_max(m, sh);
  // Each thread reads back only the chunks it wrote; block_max's barriers order the target's read.
  float s = 0.f;
  for (int64_t c = int64_t(threadIdx.x) * 8; c < Vp; c += kThreads * 8) {
    const Vec8<T> v = *reinterpret_cast<const Vec8<T>*>(xs + c);
    if (c + 8 <= V) {  // every chunk but the one holding column V: no per-element test
#pragma unroll
      for (int i = 0; i < 8; ++i) s += __expf(to_f32(v.v[i]) - M);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (c + i < V) s += __expf(to_f32(v.v[i]) - M);
    }
  }
  const float S = block_sum(s, sh);
  const float lse = M + logf(S);
  const bool ignored = target == -1;
  const bool valid = target >= 0 && target < V;
  if (threadIdx.x == 0 && losses) losses[row] = ignored ? 0.f : (valid ? lse - to_f32(xs[target]) : NAN);
  if (!dlogits) return;
  T* dx = dlogits + row * Vp;
  const float inv_s = 1.f / S;
  for (int64_t c = int64_t(threadIdx.x) * 8; c < Vp; c += kThreads * 8) {
    const Vec8<T> v = *reinterpret_cast<const Vec8<T>*>(xs + c);
    Vec8<T> o;
    if (valid && c + 8 <= V) {
      // A chunk of real columns in a row with a target: dloss p, then the target's own element.
#pragma unroll
      for (int i = 0; i < 8; ++i) o.v[i] = from_f32<T>(dloss * (__expf(to_f32(v.v[i]) - M) * inv_s));
      if (target >= c && target < c + 8) {
#pragma unroll
        for (int i = 0; i < 8; ++i)  // constant indices: o stays in registers
          if (c + i == target) o.v[i] = from_f32<T>(dloss * (__expf(to_f32(v.v[i]) - M) * inv_s - 1.f));
      }
    } else {
      o = dlogits_chunk<T>(v, c, M, inv_s, dloss, target, V);
    }
    *reinterpret_cast<Vec8<T>*>(dx + c) = o;
  }
}

// Whether crossentropy_staged_kernel takes rows of Vp columns on the current device (raising its
// shared memory limit there the first time).
template <class T>
bool staged_fits(int64_t Vp) {
  static std::mutex mu;
  static std::map<int, int64_t> raised;  // device -> bytes the kernel's limit allows
  const size_t bytes = size_t(Vp) * sizeof(T);
  int device = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard lk(mu);
  int64_t& limit = raised[device];
  if (int64_t(bytes) <= limit) return true;
  int optin = 0;
  LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (bytes + 32 * sizeof(float) > size_t(optin)) return false;
  LOOM_CUDA_CHECK(
      cudaFuncSetAttribute(crossentropy_staged_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  limit = int64_t(bytes);
  return true;
}

void check_args(const char* what, int64_t V, int64_t Vp) {
  LOOM_CHECK(V > 0 && V <= Vp && Vp % 8 == 0, "{}: need 0 < V <= Vp with Vp a multiple of 8 (V = {}, Vp = {})", what, V,
             Vp);
}

// The vocabulary-parallel passes (Backend::vocab_crossentropy): one block per row of a shard's
// Vs columns, nv of them real; element loads one at a time (any Vs).
constexpr int kVocabThreads = 256;

template <class T>
__global__ void __launch_bounds__(kVocabThreads) vocab_ce_max_kernel(float* stats, const T* logits, int64_t Vs,
                                                                     int64_t nv) {
  __shared__ float sh[32];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * Vs;
  float m = -INFINITY;
  for (int64_t c = threadIdx.x; c < nv; c += kVocabThreads) m = fmaxf(m, to_f32(x[c]));
  const float M = block_max(m, sh);
  if (threadIdx.x == 0) stats[row] = M;
}

template <class T>
__global__ void __launch_bounds__(kVocabThreads) vocab_ce_sums_kernel(float* stats, const T* logits,
                                                                      const int32_t* targets, int64_t N, int64_t Vs,
                                                                      int64_t v0, int64_t nv) {
  __shared__ float sh[32];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * Vs;
  const float M = stats[row];
  float s = 0.f;
  for (int64_t c = threadIdx.x; c < nv; c += kVocabThreads) s += expf(to_f32(x[c]) - M);
  const float S = block_sum(s, sh);
  if (threadIdx.x == 0) {
    const int64_t t = int64_t(targets[row]) - v0;
    stats[N + row] = S;
    stats[2 * N + row] = (targets[row] >= 0 && t >= 0 && t < nv) ? to_f32(x[t]) : 0.f;
  }
}

// In place (dlogits == logits): each thread rewrites only the elements it reads.
template <class T>
__global__ void __launch_bounds__(kVocabThreads) vocab_ce_finish_kernel(float* losses, T* dlogits, const T* logits,
                                                                        const int32_t* targets, const float* stats,
                                                                        float dloss, int64_t N, int64_t Vs,
                                                                        int64_t v0, int64_t nv) {
  const int64_t row = blockIdx.x;
  const bool counted = targets[row] >= 0;
  const float M = stats[row], S = stats[N + row];
  const double lse = double(M) + log(double(S));
  const float loss = counted ? float(lse - double(stats[2 * N + row])) : 0.f;
  if (threadIdx.x == 0 && losses) losses[row] = loss;
  if (!dlogits) return;
  const T* x = logits + row * Vs;
  T* d = dlogits + row * Vs;
  const int64_t t = int64_t(targets[row]) - v0;
  const float scale = float(double(dloss) / double(S));
  for (int64_t c = threadIdx.x; c < Vs; c += kVocabThreads) {
    float g = 0.f;
    if (counted && c < nv) g = c == t ? float(double(dloss) * expm1(-double(loss))) : scale * expf(to_f32(x[c]) - M);
    d[c] = from_f32<T>(g);
  }
}

}  // namespace

template <class T>
void vocab_crossentropy(int pass, float* losses, T* dlogits, const T* logits, const int32_t* targets, float* stats,
                        float dloss, int64_t N, int64_t Vs, int64_t v0, int64_t V, cudaStream_t stream) {
  LOOM_CHECK(Vs > 0 && v0 >= 0 && V > 0, "vocab_crossentropy: columns [{}, {} + {}) of a vocabulary of {}", v0, v0, Vs,
             V);
  LOOM_CHECK(pass >= 0 && pass <= 2, "vocab_crossentropy: pass {} (0 max, 1 sums, 2 finish)", pass);
  if (N == 0) return;
  const int64_t nv = std::clamp<int64_t>(V - v0, 0, Vs);  // real columns of this shard
  if (pass == 0)
    vocab_ce_max_kernel<T><<<unsigned(N), kVocabThreads, 0, stream>>>(stats, logits, Vs, nv);
  else if (pass == 1)
    vocab_ce_sums_kernel<T><<<unsigned(N), kVocabThreads, 0, stream>>>(stats, logits, targets, N, Vs, v0, nv);
  else
    vocab_ce_finish_kernel<T>
        <<<unsigned(N), kVocabThreads, 0, stream>>>(losses, dlogits, logits, targets, stats, dloss, N, Vs, v0, nv);
  LOOM_CUDA_LAUNCH_CHECK();
}

template <class T>
void crossentropy_forward(float* losses, const T* logits, const int32_t* targets, int64_t N, int64_t V, int64_t Vp,
                          cudaStream_t stream) {
  check_args("crossentropy_forward", V, Vp);
  if (N == 0) return;
  if (staged_fits<T>(Vp)) {
    crossentropy_staged_kernel<T><<<unsigned(N), kThreads, size_t(Vp) * sizeof(T), stream>>>(losses, nullptr, logits,
                                                                                           targets, 0.f, V, Vp);
  } else {
    crossentropy_kernel<T><<<unsigned(N), kThreads, 0, stream>>>(losses, nullptr, logits, targets, 0.f, V, Vp);
  }
  LOOM_CUDA_LAUNCH_CHECK();
}

template <class T>
void crossentropy_forward_backward(float* losses, T* dlogits, const T* logits, const int32_t* targets, float dloss,
                                   int64_t N, int64_t V, int64_t Vp, cudaStream_t stream) {
  check_args("crossentropy_forward_backward", V, Vp);
  LOOM_CHECK(dlogits, "crossentropy_forward_backward: dlogits is null");
  if (N == 0) return;
  if (staged_fits<T>(Vp)) {
    crossentropy_staged_kernel<T><<<unsigned(N), kThreads, size_t(Vp) * sizeof(T), stream>>>(losses, dlogits, logits,
                                                                                           targets, dloss, V, Vp);
  } else {
    crossentropy_kernel<T><<<unsigned(N), kThreads, 0, stream>>>(losses, dlogits, logits, targets, dloss, V, Vp);
  }
  LOOM_CUDA_LAUNCH_CHECK();
}

#define LOOM_CE_INSTANTIATE(T)                                                                                  \
  template void crossentropy_forward<T>(float*, const T*, const int32_t*, int64_t, int64_t, int64_t, cudaStream_t);   \
  template void crossentropy_forward_backward<T>(float*, T*, const T*, const int32_t*, float, int64_t, int64_t,       \
                                                 int64_t, cudaStream_t);                                              \
  template void vocab_crossentropy<T>(int, float*, T*, const T*, const int32_t*, float*, float, int64_t, int64_t,     \
                                      int64_t, int64_t, cudaStream_t);
LOOM_CE_INSTANTIATE(bf16)
LOOM_CE_INSTANTIATE(f16)
#undef LOOM_CE_INSTANTIATE

}  // namespace loom::cuda

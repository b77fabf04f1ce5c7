#include "kernels/cuda/common.cuh"
#include "kernels/cuda/attn_gemm.cuh"

#include <cublas_v2.h>

#include <cmath>
#include <type_traits>

#include "kernels/cuda/matmul.cuh"

#define LOOM_CUBLAS_V2_CHECK(expr)                                                                 \
  do {                                                                                             \
    cublasStatus_t st_ = (expr);                                                                   \
    if (st_ != CUBLAS_STATUS_SUCCESS) LOOM_FAIL("cuBLAS error {} ({}) in {}", int(st_), cublasGetStatusString(st_), #expr); \
  } while (0)

namespace loom::cuda {
namespace {

// Row-major batched GEMM C[M, N] = alpha op(A) op(B), batch stride per operand, through the
// column-major library (C^T = op(B)^T op(A)^T).
template <class E>
void batched_gemm(Blas& blas, cudaStream_t stream, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const E* A, int64_t lda, int64_t sa, const E* B, int64_t ldb, int64_t sb, void* C, int64_t ldc,
                  int64_t sc, bool c_f32, int64_t batch) {
  cublasHandle_t handle = blas.cublas();
  LOOM_CUBLAS_V2_CHECK(cublasSetStream(handle, stream));
  // cublasSetStream resets the handle to cuBLAS's own workspace pool: point it at loom's again,
  // so the GEMMs (and a CUDA graph capturing them) use the pool's fixed buffer.
  LOOM_CUBLAS_V2_CHECK(cublasSetWorkspace(handle, blas.cublas_workspace(), kBlasCublasWorkspaceBytes));
  const float beta = 0.f;
  const cudaDataType h = std::is_same_v<E, f16> ? CUDA_R_16F : CUDA_R_16BF;
  LOOM_CUBLAS_V2_CHECK(cublasGemmStridedBatchedEx(
      handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, int(N), int(M), int(K),
      &alpha, B, h, int(ldb), sb, A, h, int(lda), sa, &beta, C, c_f32 ? CUDA_R_32F : h,
      int(ldc), sc, int(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// qkv [B, T, 3, NH, HS] -> q, k, v [B, NH, T, HS]; one thread per 8 elements.
template <class E>
__global__ void split_heads_kernel(E* q, E* k, E* v, const E* qkv, int64_t B, int64_t T, int64_t NH,
                                   int64_t HS) {
  const int64_t C = NH * HS, g = HS / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= B * NH * T * g) return;
  const int64_t d = (idx % g) * 8;
  const int64_t t = (idx / g) % T;
  const int64_t h = (idx / (g * T)) % NH;
  const int64_t b = idx / (g * T * NH);
  const E* src = qkv + (b * T + t) * 3 * C + h * HS + d;
  const int64_t dst = ((b * NH + h) * T + t) * HS + d;
  *reinterpret_cast<Vec8<E>*>(q + dst) = *reinterpret_cast<const Vec8<E>*>(src);
  *reinterpret_cast<Vec8<E>*>(k + dst) = *reinterpret_cast<const Vec8<E>*>(src + C);
  *reinterpret_cast<Vec8<E>*>(v + dst) = *reinterpret_cast<const Vec8<E>*>(src + 2 * C);
}

// x [B, NH, T, HS] -> out rows of width `stride` at column offset h * HS (+ out's own offset).
template <class E>
__global__ void merge_heads_kernel(E* out, int64_t stride, const E* x, int64_t B, int64_t T, int64_t NH,
                                   int64_t HS) {
  const int64_t g = HS / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= B * NH * T * g) return;
  const int64_t d = (idx % g) * 8;
  const int64_t t = (idx / g) % T;
  const int64_t h = (idx / (g * T)) % NH;
  const int64_t b = idx / (g * T * NH);
  *reinterpret_cast<Vec8<E>*>(out + (b * T + t) * stride + h * HS + d) =
      *reinterpret_cast<const Vec8<E>*>(x + ((b * NH + h) * T + t) * HS + d);
}

// dout [B, T, C] -> [B, NH, T, HS]
template <class E>
__global__ void split_one_kernel(E* dst, const E* src, int64_t B, int64_t T, int64_t NH, int64_t HS) {
  const int64_t g = HS / 8, C = NH * HS;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= B * NH * T * g) return;
  const int64_t d = (idx % g) * 8;
  const int64_t t = (idx / g) % T;
  const int64_t h = (idx / (g * T)) % NH;
  const int64_t b = idx / (g * T * NH);
  *reinterpret_cast<Vec8<E>*>(dst + ((b * NH + h) * T + t) * HS + d) =
      *reinterpret_cast<const Vec8<E>*>(src + (b * T + t) * C + h * HS + d);
}

// One warp per row (b, h, t) of the scaled scores f32 [T]: probabilities for j <= t, 0 above.
template <class E>
__global__ void causal_softmax_kernel(E* att, const float* scores, int64_t rows, int64_t T) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t t = row % T;
  const float* s = scores + row * T;
  float m = -INFINITY, sum = 0.f;
  for (int64_t j = lane; j <= t; j += 32) {
    const float x = s[j];
    if (x > m) {
      sum = sum * __expf(m - x) + 1.f;
      m = x;
    } else {
      sum += __expf(x - m);
    }
  }
  const float M = warp_max(m);
  sum = warp_sum(m == -INFINITY ? 0.f : sum * __expf(m - M));
  const float inv = 1.f / sum;
  E* a = att + row * T;
  for (int64_t j = lane; j < T; j += 32) a[j] = from_f32<E>(j <= t ? __expf(s[j] - M) * inv : 0.f);
}

// dS = scale * P * (dP - sum_j P dP) for j <= t, 0 above; written over P (16-bit).
template <class E>
__global__ void causal_softmax_backward_kernel(E* att, const float* dprob, int64_t rows, int64_t T, float scale) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const int64_t t = row % T;
  E* p = att + row * T;
  const float* dp = dprob + row * T;
  float dot = 0.f;
  for (int64_t j = lane; j <= t; j += 32) dot += to_f32(p[j]) * dp[j];
  dot = warp_sum(dot);
  for (int64_t j = lane; j < T; j += 32) {
    const float v = j <= t ? scale * to_f32(p[j]) * (dp[j] - dot) : 0.f;
    p[j] = from_f32<E>(v);
  }
}

template <class E>
struct Work {
  E *q, *k, *v, *y;         // [B, NH, T, HS] each (y holds dy in the backward)
  E *dq, *dk, *dv;          // [B, NH, T, HS] each
  float* scores;            // f32 [B, NH, T, T]
};

template <class E>
Work<E> carve(void* ws, const AttnGemmShape& s) {
  const int64_t n = s.B * s.NH * s.T * s.HS;
  E* p = static_cast<E*>(ws);
  Work<E> w;
  w.q = p;
  w.k = p + n;
  w.v = p + 2 * n;
  w.y = p + 3 * n;
  w.dq = p + 4 * n;
  w.dk = p + 5 * n;
  w.dv = p + 6 * n;
  size_t off = (size_t(7 * n) * sizeof(E) + 255) / 256 * 256;
  w.scores = reinterpret_cast<float*>(static_cast<char*>(ws) + off);
  return w;
}

void check_shape(const char* what, const AttnGemmShape& s) {
  LOOM_CHECK(s.B > 0 && s.T > 0 && s.NH > 0 && s.HS > 0 && s.HS % 8 == 0,
             "{}: bad shape B={} T={} NH={} HS={} (HS must be a multiple of 8)", what, s.B, s.T, s.NH, s.HS);
}

unsigned blocks_for(int64_t n, int per) { return unsigned(ceil_div(n, per)); }

}  // namespace

size_t attn_gemm_workspace_bytes(const AttnGemmShape& s) {
  const int64_t n = s.B * s.NH * s.T * s.HS;
  static_assert(sizeof(bf16) == sizeof(f16));  // the same bytes for either 16-bit type
  return (size_t(7 * n) * sizeof(bf16) + 255) / 256 * 256 + size_t(s.B * s.NH * s.T * s.T) * sizeof(float);
}

template <class E>
void attn_gemm_forward(Blas& blas, E* out, E* att, const E* qkv, const AttnGemmShape& s, void* workspace,
                       cudaStream_t stream) {
  check_shape("attn_gemm_forward", s);
  Work<E> w = carve<E>(workspace, s);
  const int64_t BH = s.B * s.NH, T = s.T, HS = s.HS, C = s.NH * s.HS;
  const int64_t vec = BH * T * HS / 8;
  split_heads_kernel<E><<<blocks_for(vec, 256), 256, 0, stream>>>(w.q, w.k, w.v, qkv, s.B, T, s.NH, HS);
  LOOM_CUDA_LAUNCH_CHECK();
  const float scale = 1.f / std::sqrt(float(HS));
  // scores[T, T] = scale * q k^T
  batched_gemm<E>(blas, stream, false, true, T, T, HS, scale, w.q, HS, T * HS, w.k, HS, T * HS, w.scores, T, T * T,
                  true, BH);
  causal_softmax_kernel<E><<<blocks_for(BH * T, 8), 256, 0, stream>>>(att, w.scores, BH * T, T);
  LOOM_CUDA_LAUNCH_CHECK();
  // y[T, HS] = att v
  batched_gemm<E>(blas, stream, false, false, T, HS, T, 1.f, att, T, T * T, w.v, HS, T * HS, w.y, HS, T * HS, false,
                  BH);
  merge_heads_kernel<E><<<blocks_for(vec, 256), 256, 0, stream>>>(out, C, w.y, s.B, T, s.NH, HS);
  LOOM_CUDA_LAUNCH_CHECK();
}

template <class E>
void attn_gemm_backward(Blas& blas, E* dqkv, E* att, const E* dout, const E* qkv, const AttnGemmShape& s,
                        void* workspace, cudaStream_t stream) {
  check_shape("attn_gemm_backward", s);
  Work<E> w = carve<E>(workspace, s);
  const int64_t BH = s.B * s.NH, T = s.T, HS = s.HS, C = s.NH * s.HS;
  const int64_t vec = BH * T * HS / 8;
  split_heads_kernel<E><<<blocks_for(vec, 256), 256, 0, stream>>>(w.q, w.k, w.v, qkv, s.B, T, s.NH, HS);
  LOOM_CUDA_LAUNCH_CHECK();
  split_one_kernel<E><<<blocks_for(vec, 256), 256, 0, stream>>>(w.y, dout, s.B, T, s.NH, HS);
  LOOM_CUDA_LAUNCH_CHECK();
  // dP[T, T] = dy v^T (f32)
  batched_gemm<E>(blas, stream, false, true, T, T, HS, 1.f, w.y, HS, T * HS, w.v, HS, T * HS, w.scores, T, T * T,
                  true, BH);
  // dv[T, HS] = P^T dy
  batched_gemm<E>(blas, stream, true, false, T, HS, T, 1.f, att, T, T * T, w.y, HS, T * HS, w.dv, HS, T * HS, false,
                  BH);
  const float scale = 1.f / std::sqrt(float(HS));
  causal_softmax_backward_kernel<E><<<blocks_for(BH * T, 8), 256, 0, stream>>>(att, w.scores, BH * T, T, scale);
  LOOM_CUDA_LAUNCH_CHECK();
  // dq[T, HS] = dS k; dk[T, HS] = dS^T q
  batched_gemm<E>(blas, stream, false, false, T, HS, T, 1.f, att, T, T * T, w.k, HS, T * HS, w.dq, HS, T * HS, false,
                  BH);
  batched_gemm<E>(blas, stream, true, false, T, HS, T, 1.f, att, T, T * T, w.q, HS, T * HS, w.dk, HS, T * HS, false,
                  BH);
  merge_heads_kernel<E><<<blocks_for(vec, 256), 256, 0, stream>>>(dqkv, 3 * C, w.dq, s.B, T, s.NH, HS);
  LOOM_CUDA_LAUNCH_CHECK();
  merge_heads_kernel<E><<<blocks_for(vec, 256), 256, 0, stream>>>(dqkv + C, 3 * C, w.dk, s.B, T, s.NH, HS);
  LOOM_CUDA_LAUNCH_CHECK();
  merge_heads_kernel<E><<<blocks_for(vec, 256), 256, 0, stream>>>(dqkv + 2 * C, 3 * C, w.dv, s.B, T, s.NH, HS);
  LOOM_CUDA_LAUNCH_CHECK();
}

#define LOOM_ATTN_GEMM_INSTANTIATE(E)                                                                           \
  template void attn_gemm_forward<E>(Blas&, E*, E*, const E*, const AttnGemmShape&, void*, cudaStream_t);          \
  template void attn_gemm_backward<E>(Blas&, E*, E*, const E*, const E*, const AttnGemmShape&, void*, cudaStream_t);
LOOM_ATTN_GEMM_INSTANTIATE(bf16)
LOOM_ATTN_GEMM_INSTANTIATE(f16)
#undef LOOM_ATTN_GEMM_INSTANTIATE

}  // namespace loom::cuda

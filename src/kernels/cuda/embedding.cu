#include "kernels/cuda/common.cuh"
#include "kernels/cuda/embedding.cuh"

namespace loom::cuda {
namespace {

template <class E>
__global__ void embedding_forward_kernel(E* out, const int32_t* tokens, const E* wte, const E* wpe, int64_t BT,
                                         int64_t T, int64_t C, int64_t V, EmbeddingRows r) {
  const int64_t groups = C / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= BT * groups) return;
  const int64_t bt = idx / groups, c = (idx % groups) * 8;
  const int64_t t = bt % T;
  const int32_t tok = tokens[bt];
  Vec8<E> o;
  if (tok < 0 || tok >= V) {
#pragma unroll
    for (int i = 0; i < 8; ++i) o.v[i] = from_f32<E>(NAN);
  } else {
    // The table's row, or under a vocabulary split a zero row for another shard's token.
    const int64_t row = int64_t(tok) - r.v0;
    Vec8<E> a;
    if (r.Vs == 0 || (row >= 0 && row < r.Vs)) {
      a = *reinterpret_cast<const Vec8<E>*>(wte + row * C + c);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) a.v[i] = from_f32<E>(0.f);
    }
    if (wpe) {
      const int64_t pos = r.positions ? int64_t(r.positions[t]) : r.pos0 + t;
      Vec8<E> p = *reinterpret_cast<const Vec8<E>*>(wpe + pos * C + c);
#pragma unroll
      for (int i = 0; i < 8; ++i) o.v[i] = from_f32<E>(to_f32(a.v[i]) + to_f32(p.v[i]));
    } else {
      o = a;  // rotary positions: the blocks add no table
    }
  }
  *reinterpret_cast<Vec8<E>*>(out + bt * C + c) = o;
}

template <class E>
__global__ void embedding_backward_wte_kernel(float* dwte, const E* dout, const int32_t* tokens, int64_t BT,
                                              int64_t C, int64_t V, int64_t v0, int64_t Vs) {
  const int64_t groups = C / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= BT * groups) return;
  const int64_t bt = idx / groups, c = (idx % groups) * 8;
  const int32_t tok = tokens[bt];
  if (tok < 0 || tok >= V) return;
  const int64_t row = int64_t(tok) - v0;
  if (Vs > 0 && (row < 0 || row >= Vs)) return;  // another shard's token
  Vec8<E> g = *reinterpret_cast<const Vec8<E>*>(dout + bt * C + c);
  float* dst = dwte + row * C + c;
#pragma unroll
  for (int i = 0; i < 8; ++i) atomicAdd(dst + i, to_f32(g.v[i]));
}

template <class E>
__global__ void embedding_backward_wpe_kernel(float* dwpe, const E* dout, int64_t B, int64_t T, int64_t C,
                                              int64_t pos0, const int32_t* positions) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= T * C) return;
  const int64_t t = idx / C, c = idx % C;
  float s = 0.f;
  for (int64_t b = 0; b < B; ++b) s += to_f32(dout[(b * T + t) * C + c]);
  const int64_t pos = positions ? int64_t(positions[t]) : pos0 + t;  // (distinct positions: no race)
  dwpe[pos * C + c] += s;
}

}  // namespace

void check_token_ids(const int32_t* tokens, int64_t n, int64_t V, const char* what) {
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= V)
      throw Error(fmt::format("{}: token id {} at position {} is outside the vocabulary [0, {})", what, tokens[i], i, V));
}

template <class E>
void embedding_forward(E* out, const int32_t* tokens, const E* wte, const E* wpe, int64_t B, int64_t T,
                       int64_t C, int64_t V, cudaStream_t stream, const EmbeddingRows& r) {
  LOOM_CHECK(C % 8 == 0, "embedding_forward: C = {} must be a multiple of 8", C);
  LOOM_CHECK(r.Vs >= 0 && r.v0 >= 0, "embedding_forward: vocabulary rows [{}, {} + {})", r.v0, r.v0, r.Vs);
  const int64_t work = B * T * (C / 8);
  if (work == 0) return;
  embedding_forward_kernel<E><<<unsigned(ceil_div(work, 256)), 256, 0, stream>>>(out, tokens, wte, wpe, B * T, T, C, V,
                                                                             r);
  LOOM_CUDA_LAUNCH_CHECK();
}

template <class E>
void embedding_backward(float* dwte, float* dwpe, const E* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, int64_t V, cudaStream_t stream, const EmbeddingRows& r) {
  LOOM_CHECK(C % 8 == 0, "embedding_backward: C = {} must be a multiple of 8", C);
  if (B * T == 0) return;
  if (dwte) {
    const int64_t work = B * T * (C / 8);
    embedding_backward_wte_kernel<E>
        <<<unsigned(ceil_div(work, 256)), 256, 0, stream>>>(dwte, dout, tokens, B * T, C, V, r.v0, r.Vs);
    LOOM_CUDA_LAUNCH_CHECK();
  }
  if (dwpe) {
    embedding_backward_wpe_kernel<E><<<unsigned(ceil_div(T * C, 256)), 256, 0, stream>>>(dwpe, dout, B, T, C, r.pos0,
                                                                                          r.positions);
    LOOM_CUDA_LAUNCH_CHECK();
  }
}

#define LOOM_EMBEDDING_INSTANTIATE(E)                                                                           \
  template void embedding_forward<E>(E*, const int32_t*, const E*, const E*, int64_t, int64_t, int64_t, int64_t,     \
                                     cudaStream_t, const EmbeddingRows&);                                           \
  template void embedding_backward<E>(float*, float*, const E*, const int32_t*, int64_t, int64_t, int64_t, int64_t, \
                                      cudaStream_t, const EmbeddingRows&);
LOOM_EMBEDDING_INSTANTIATE(bf16)
LOOM_EMBEDDING_INSTANTIATE(f16)
#undef LOOM_EMBEDDING_INSTANTIATE

}  // namespace loom::cuda

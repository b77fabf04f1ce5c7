#include "kernels/cuda/common.cuh"
#include "kernels/cuda/embedding.cuh"

namespace loom::cuda {
namespace {

__global__ void embedding_forward_kernel(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe, int64_t BT,
                                         int64_t T, int64_t C, int64_t V, int64_t pos0) {
  const int64_t groups = C / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= BT * groups) return;
  const int64_t bt = idx / groups, c = (idx % groups) * 8;
  const int64_t t = bt % T;
  const int32_t tok = tokens[bt];
  bf16x8 o;
  if (tok < 0 || tok >= V) {
#pragma unroll
    for (int i = 0; i < 8; ++i) o.v[i] = __float2bfloat16(NAN);
  } else {
    bf16x8 a = *reinterpret_cast<const bf16x8*>(wte + int64_t(tok) * C + c);
    if (wpe) {
      bf16x8 p = *reinterpret_cast<const bf16x8*>(wpe + (pos0 + t) * C + c);
#pragma unroll
      for (int i = 0; i < 8; ++i) o.v[i] = __float2bfloat16(__bfloat162float(a.v[i]) + __bfloat162float(p.v[i]));
    } else {
      o = a;  // rotary positions: the blocks add no table
    }
  }
  *reinterpret_cast<bf16x8*>(out + bt * C + c) = o;
}

__global__ void embedding_backward_wte_kernel(float* dwte, const bf16* dout, const int32_t* tokens, int64_t BT,
                                              int64_t C, int64_t V) {
  const int64_t groups = C / 8;
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= BT * groups) return;
  const int64_t bt = idx / groups, c = (idx % groups) * 8;
  const int32_t tok = tokens[bt];
  if (tok < 0 || tok >= V) return;
  bf16x8 g = *reinterpret_cast<const bf16x8*>(dout + bt * C + c);
  float* dst = dwte + int64_t(tok) * C + c;
#pragma unroll
  for (int i = 0; i < 8; ++i) atomicAdd(dst + i, __bfloat162float(g.v[i]));
}

__global__ void embedding_backward_wpe_kernel(float* dwpe, const bf16* dout, int64_t B, int64_t T, int64_t C,
                                              int64_t pos0) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= T * C) return;
  const int64_t t = idx / C, c = idx % C;
  float s = 0.f;
  for (int64_t b = 0; b < B; ++b) s += __bfloat162float(dout[(b * T + t) * C + c]);
  dwpe[(pos0 + t) * C + c] += s;
}

}  // namespace

void check_token_ids(const int32_t* tokens, int64_t n, int64_t V, const char* what) {
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= V)
      throw Error(fmt::format("{}: token id {} at position {} is outside the vocabulary [0, {})", what, tokens[i], i, V));
}

void embedding_forward(bf16* out, const int32_t* tokens, const bf16* wte, const bf16* wpe, int64_t B, int64_t T,
                       int64_t C, int64_t V, cudaStream_t stream, int64_t pos0) {
  LOOM_CHECK(C % 8 == 0, "embedding_forward: C = {} must be a multiple of 8", C);
  const int64_t work = B * T * (C / 8);
  if (work == 0) return;
  embedding_forward_kernel<<<unsigned(ceil_div(work, 256)), 256, 0, stream>>>(out, tokens, wte, wpe, B * T, T, C, V,
                                                                             pos0);
  LOOM_CUDA_LAUNCH_CHECK();
}

void embedding_backward(float* dwte, float* dwpe, const bf16* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, int64_t V, cudaStream_t stream, int64_t pos0) {
  LOOM_CHECK(C % 8 == 0, "embedding_backward: C = {} must be a multiple of 8", C);
  if (B * T == 0) return;
  if (dwte) {
    const int64_t work = B * T * (C / 8);
    embedding_backward_wte_kernel<<<unsigned(ceil_div(work, 256)), 256, 0, stream>>>(dwte, dout, tokens, B * T, C, V);
    LOOM_CUDA_LAUNCH_CHECK();
  }
  if (dwpe) {
    embedding_backward_wpe_kernel<<<unsigned(ceil_div(T * C, 256)), 256, 0, stream>>>(dwpe, dout, B, T, C, pos0);
    LOOM_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace loom::cuda

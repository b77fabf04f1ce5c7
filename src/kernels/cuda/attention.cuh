// loom's flash attention on the GPU: causal multi-head attention in bf16 or f16 (the element type
// T of q, k, v, out and their gradients; train.precision bf16 and fp16) with f32 accumulation,
// tiled with an online softmax (FlashAttention-2 work partitioning: each thread block owns a tile
// of queries of one (batch, head); backward parallel over key tiles), saving only the per-row
// log-sum-exp. Layout as the CPU op (kernels/cpu/attention.h): element (b, t, h, d) of X at
// X[(b * T + t) * stride + h * HS + d].
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {

// The head sizes the kernels are built for (their tiles are specialised per head size).
constexpr bool flash_head_size_supported(int64_t HS) { return HS == 64 || HS == 128; }

struct AttnArgs {
  int64_t B = 0, NH = 0, HS = 0;   // flash_head_size_supported(HS)
  int64_t Tq = 0, Tkv = 0;
  int64_t q_stride = 0, kv_stride = 0, o_stride = 0;
  int64_t q_pos0 = 0, kv_pos0 = 0;
  bool causal = true;
  float scale = 0;                  // 0 means 1 / sqrt(HS)
  int64_t NKV = 0;                  // key/value heads (grouped-query attention, dividing NH); 0: NH
};

// Grouped-query attention: query head h reads key/value head h / (NH / NKV); dk and dv sum over
// the query heads of their key/value head (each written once, no atomics).
// Requirements (checked, loom::Error otherwise): HS 64 or 128; row strides at least NH * HS (kv:
// NKV * HS) and multiples of 8 elements; q, k, v, out, dout, dq, dk, dv and the workspace 16-byte aligned.
// Causal mask: key position kv_pos0 + s is visible to query position q_pos0 + t iff
// kv_pos0 + s <= q_pos0 + t. A query row with no visible key gets out = 0, lse = -inf, dq = 0.

// out T (o_stride) = softmax(q k^T scale) v, T bf16 or f16; lse f32 [B, NH, Tq] (natural log of
// the row's sum of exp of scaled scores). Deterministic.
template <class T>
void attention_forward(T* out, float* lse, const T* q, const T* k, const T* v, const AttnArgs& a,
                       cudaStream_t stream);

// dq (q_stride), dk, dv (kv_stride) T (written; T bf16 or f16, as the forward's), from dout
// (o_stride), q, k, v, out, lse. `workspace` holds at least attention_backward_workspace_bytes(a)
// bytes (the same for both types): f32 D = rowsum(dout * out) [B, NH, Tq] and the f32 dq
// accumulator [B, NH, Tq, HS] (dq is summed with atomics, so its last bits may differ between
// runs; dk and dv are deterministic).
size_t attention_backward_workspace_bytes(const AttnArgs& a);
template <class T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const T* out,
                        const float* lse, const AttnArgs& a, void* workspace, cudaStream_t stream);

// Defined (instantiated) in attention.cu for these two types only.
extern template void attention_forward<bf16>(bf16*, float*, const bf16*, const bf16*, const bf16*, const AttnArgs&,
                                             cudaStream_t);
extern template void attention_forward<f16>(f16*, float*, const f16*, const f16*, const f16*, const AttnArgs&,
                                            cudaStream_t);
extern template void attention_backward<bf16>(bf16*, bf16*, bf16*, const bf16*, const bf16*, const bf16*, const bf16*,
                                              const bf16*, const float*, const AttnArgs&, void*, cudaStream_t);
extern template void attention_backward<f16>(f16*, f16*, f16*, const f16*, const f16*, const f16*, const f16*,
                                             const f16*, const float*, const AttnArgs&, void*, cudaStream_t);

}  // namespace loom::cuda

// Token + position embedding, bf16 or f16 tables and activations, f32 gradients.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {

// Row t's position is positions[t] (i32 [T], device; null: pos0 + t), and wte holds rows
// [v0, v0 + Vs) of the table (Vs = 0: all V rows): a token outside them gives a zero row before
// the position's (a vocabulary split under tensor parallelism), and no gradient.
struct EmbeddingRows {
  int64_t pos0 = 0;
  const int32_t* positions = nullptr;
  int64_t v0 = 0, Vs = 0;
};

// out bf16 [B, T, C] = wte[tokens[b, t]] + wpe[position of t]; tokens i32 [B, T] (device), wte bf16
// [V, C] (or [Vs, C]), wpe bf16 [maxT, C] (null: no position table). C must be a multiple of 8.
// Token ids are validated by the caller (they come from the host); a row whose id is outside
// [0, V) is written as NaN, never read out of bounds.
template <class E>  // bf16 or f16
void embedding_forward(E* out, const int32_t* tokens, const E* wte, const E* wpe, int64_t B, int64_t T,
                       int64_t C, int64_t V, cudaStream_t stream, const EmbeddingRows& r = {});

// dwte f32 [V, C] (or [Vs, C]) += scatter of dout by token (f32 atomics: the summation order of
// repeated tokens varies between runs, by rounding only); dwpe f32 [maxT, C] += sum over the batch
// (fixed order; positions must be distinct). Either gradient may be null.
template <class E>
void embedding_backward(float* dwte, float* dwpe, const E* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, int64_t V, cudaStream_t stream, const EmbeddingRows& r = {});

// Host-side check used before tokens are uploaded: throws loom::Error naming `what` and the first
// offending position when an id is outside [0, V).
void check_token_ids(const int32_t* tokens, int64_t n, int64_t V, const char* what);

}  // namespace loom::cuda

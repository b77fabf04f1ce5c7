// Token + position embedding, bf16 or f16 tables and activations, f32 gradients.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {

// out bf16 [B, T, C] = wte[tokens[b, t]] + wpe[pos0 + t]; tokens i32 [B, T] (device), wte bf16
// [V, C], wpe bf16 [maxT, C] (null: no position table). C must be a multiple of 8. Token ids are validated by the caller
// (they come from the host); a row whose id is outside [0, V) is written as NaN, never read out of
// bounds.
template <class E>  // bf16 or f16
void embedding_forward(E* out, const int32_t* tokens, const E* wte, const E* wpe, int64_t B, int64_t T,
                       int64_t C, int64_t V, cudaStream_t stream, int64_t pos0 = 0);

// dwte f32 [V, C] += scatter of dout by token (f32 atomics: the summation order of repeated tokens
// varies between runs, by rounding only); dwpe f32 [maxT, C] += sum over the batch (fixed order).
// Either gradient may be null.
template <class E>
void embedding_backward(float* dwte, float* dwpe, const E* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, int64_t V, cudaStream_t stream, int64_t pos0 = 0);

// Host-side check used before tokens are uploaded: throws loom::Error naming `what` and the first
// offending position when an id is outside [0, V).
void check_token_ids(const int32_t* tokens, int64_t n, int64_t V, const char* what);

}  // namespace loom::cuda

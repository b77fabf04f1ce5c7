// LayerNorm on bf16 or f16 rows with f32 statistics, optionally fused with the residual add that feeds it
// (GPT-2: x2 = x + attn_proj; ln_2 = LayerNorm(x2) in one pass). With rms, RMSNorm (the Llama
// family's): out = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps); mean and bias null.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {

// out [N, C] = (inp - mean) * rstd * weight + bias; mean, rstd f32 [N] (saved for the
// backward). C must be a multiple of 8.
template <class T>  // bf16 or f16
void layernorm_forward(T* out, float* mean, float* rstd, const T* inp, const T* weight, const T* bias,
                       int64_t N, int64_t C, cudaStream_t stream, float eps = 1e-5f, bool rms = false);

// residual [N, C] = a + b (rounded to T), then out = LayerNorm(residual) as above.
// residual may alias a or b.
template <class T>  // bf16 or f16
void residual_layernorm_forward(T* residual, T* out, float* mean, float* rstd, const T* a, const T* b,
                                const T* weight, const T* bias, int64_t N, int64_t C, cudaStream_t stream,
                                float eps = 1e-5f, bool rms = false);

// dinp [N, C] (= or += by accumulate), dweight f32 [C] +=, dbias f32 [C] += (deterministic:
// per-block partial sums reduced in a fixed order). inp is the LayerNorm's input. scratch holds at
// least layernorm_backward_scratch_floats(C) floats.
int64_t layernorm_backward_scratch_floats(int64_t C);
template <class T>  // bf16 or f16
void layernorm_backward(T* dinp, float* dweight, float* dbias, const T* dout, const T* inp,
                        const T* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                        bool accumulate, float* scratch, cudaStream_t stream, bool rms = false);

}  // namespace loom::cuda

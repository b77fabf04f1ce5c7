// Causal multi-head attention through cuBLAS batched GEMMs and a fused softmax: the probability
// matrix ([B, NH, T, T]) is materialised and saved for the backward. A simple, exact
// reference path for the GPU and a fallback for the model; loom's flash attention
// (attention.cuh) is the fast path. Layout of the packed input as GPT-2's c_attn output:
// qkv [B, T, 3C] with q, k, v at column offsets 0, C, 2C and head h at h * HS.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/matmul.cuh"

namespace loom::cuda {

struct AttnGemmShape {
  int64_t B = 0, T = 0, NH = 0, HS = 0;  // C = NH * HS; HS a multiple of 8
};

// Scratch shared by the forward and backward (reusable across layers): bytes needed.
size_t attn_gemm_workspace_bytes(const AttnGemmShape& s);

// out [B, T, C]; att [B, NH, T, T] (softmax probabilities, zero above the diagonal,
// saved for the backward); qkv [B, T, 3C].
template <class E>  // bf16 or f16
void attn_gemm_forward(Blas& blas, E* out, E* att, const E* qkv, const AttnGemmShape& s, void* workspace,
                       cudaStream_t stream);

// dqkv [B, T, 3C] written; dout [B, T, C]; att as saved by the forward (overwritten:
// it holds the scores' gradient afterwards).
template <class E>  // bf16 or f16
void attn_gemm_backward(Blas& blas, E* dqkv, E* att, const E* dout, const E* qkv, const AttnGemmShape& s,
                        void* workspace, cudaStream_t stream);

// The batched products run on blas.cublas() (make it before capturing a CUDA graph).

}  // namespace loom::cuda

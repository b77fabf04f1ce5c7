// GELU, tanh form (as GPT-2): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), bf16 in and out,
// f32 arithmetic. The model fuses GELU into the GEMM epilogue (matmul.cuh); these are the
// standalone ops.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {

// out, inp bf16 [n]; out may alias inp.
void gelu_forward(bf16* out, const bf16* inp, int64_t n, cudaStream_t stream);
// dinp bf16 [n] = dout * gelu'(inp); dinp may alias dout.
void gelu_backward(bf16* dinp, const bf16* inp, const bf16* dout, int64_t n, cudaStream_t stream);

}  // namespace loom::cuda

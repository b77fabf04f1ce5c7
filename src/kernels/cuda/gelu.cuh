// GELU, tanh form (as GPT-2): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), bf16 or f16 in and out,
// f32 arithmetic. The model fuses GELU into the GEMM epilogue (matmul.cuh); these are the
// standalone ops.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {

// out, inp [n]; out may alias inp.
template <class T>  // bf16 or f16
void gelu_forward(T* out, const T* inp, int64_t n, cudaStream_t stream);
// dinp [n] = dout * gelu'(inp); dinp may alias dout.
template <class T>
void gelu_backward(T* dinp, const T* inp, const T* dout, int64_t n, cudaStream_t stream);

}  // namespace loom::cuda

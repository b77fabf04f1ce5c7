// The Llama family's element-wise ops on bf16 or f16 (T) with f32 arithmetic: rotary position embeddings and
// SwiGLU (RMSNorm is the LayerNorm kernels' rms form, layernorm.cuh). Same definitions as the CPU
// kernels (kernels/cpu/rope.h, swiglu.h).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {

// The largest head size rope takes (its frequencies travel with the launch).
constexpr int64_t kRopeMaxHead = 256;

// Rotates in place the NH heads of HS elements at x[(b * T + t) * stride + h * HS + d]: elements
// i and i + HS / 2 by the angle (pos0 + t, or positions[t], i32 [T] on the device) * inv_freq[i]
// (host, [HS / 2]), or by its opposite with inverse. Angles and their sines in double.
template <class E>  // bf16 or f16
void rope(E* x, int64_t B, int64_t T, int64_t NH, int64_t HS, int64_t stride, const double* inv_freq, int64_t pos0,
          const int32_t* positions, bool inverse, cudaStream_t stream);

// out [N, H] = silu(gate) * up with inp [N, 2 H] = gate | up per row.
template <class T>
void swiglu_forward(T* out, const T* inp, int64_t N, int64_t H, cudaStream_t stream);
// dinp [N, 2 H] (may alias inp) from dout [N, H] and the forward's inp.
template <class T>
void swiglu_backward(T* dinp, const T* dout, const T* inp, int64_t N, int64_t H, cudaStream_t stream);

}  // namespace loom::cuda

#pragma once
#include <cstdint>

namespace loom::cpu {

// SwiGLU (Shazeer 2020), the feed-forward of the Llama family: out [N, H] = silu(gate) * up, where
// inp [N, 2 H] holds gate in columns [0, H) and up in [H, 2 H) of each row (one GEMM computes
// both) and silu(a) = a * sigmoid(a).
void swiglu_forward(float* out, const float* inp, int64_t N, int64_t H);
// dinp [N, 2 H] from dout [N, H] and the forward's inp: dgate = dout * up * silu'(gate),
// dup = dout * silu(gate). dinp may alias inp.
void swiglu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int64_t H);

}  // namespace loom::cpu

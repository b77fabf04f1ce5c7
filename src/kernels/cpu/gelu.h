#pragma once
#include <cstdint>

namespace loom::cpu {

// GELU, tanh form: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). out, inp f32 [n].
// out may alias inp.
void gelu_forward(float* out, const float* inp, int64_t n);
// dinp = dout * gelu'(inp). dinp may alias dout.
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n);

}  // namespace loom::cpu

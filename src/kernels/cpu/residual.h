#pragma once
#include <cstdint>

namespace loom::cpu {

// out = a + b, f32 [n]; out may alias a or b.
void residual_forward(float* out, const float* a, const float* b, int64_t n);
// dst += src, f32 [n] (the backward of a residual add into an existing gradient).
void accumulate(float* dst, const float* src, int64_t n);

}  // namespace loom::cpu

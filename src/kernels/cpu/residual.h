#pragma once
#include <cstdint>

namespace loom::cpu {

// out = a + b, f32 [n]; out may alias a or b.
void residual_forward(float* out, const float* a, const float* b, int64_t n);

}  // namespace loom::cpu

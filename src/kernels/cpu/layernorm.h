#pragma once
#include <cstdint>

namespace loom::cpu {

// out f32 [N, C] = (inp - mean) * rstd * weight + bias; saves mean f32 [N] and rstd f32 [N]
// (either may be null when no backward follows); bias may be null. Statistics in double.
void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t N, int64_t C, float eps = 1e-5f);

// dinp [N, C] (= or +=), dweight [C] +=, dbias [C] +=; any of the three may be null to skip it.
// Deterministic: parameter gradients sum the rows in order for any thread count.
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                        bool accumulate_dinp = false);

}  // namespace loom::cpu

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

// RMSNorm (Zhang & Sennrich 2019), the Llama family's: out f32 [N, C] = inp * rstd * weight with
// rstd = 1 / sqrt(mean(inp^2) + eps) saved f32 [N] (may be null when no backward follows); the
// mean of squares in double.
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C,
                     float eps = 1e-5f);

// dinp [N, C] (= or +=) and dweight [C] +=; either may be null to skip it. Deterministic as
// layernorm_backward.
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C, bool accumulate_dinp = false);

}  // namespace loom::cpu

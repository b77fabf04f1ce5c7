#pragma once
#include <cstdint>

namespace loom::cpu {

// Rotary position embeddings (Su et al. 2021) in the Hugging Face Llama layout: within each head
// of HS elements, element i (i < HS / 2) and element i + HS / 2 form a pair rotated by the angle
// position * inv_freq[i] (rotate_half). Meta's original checkpoints pair (2i, 2i + 1) instead;
// converting them permutes the q and k projections' rows. inv_freq: loom::rope_inv_freq
// (core/backend.h).

// The largest head size rope_apply takes.
constexpr int64_t kRopeMaxHead = 512;

// Rotates in place the NH heads of HS elements at x[(b * T + t) * stride + h * HS + d] by the
// angle of position pos0 + t, or positions[t] where given (i32 [T]); with inverse, by the opposite
// angle (the backward: the rotation is orthogonal, so the input's gradient is the output's rotated
// back). Angles and their sines in double, rounded once to f32.
void rope_apply(float* x, int64_t B, int64_t T, int64_t NH, int64_t HS, int64_t stride, const double* inv_freq,
                int64_t pos0, const int32_t* positions, bool inverse);

}  // namespace loom::cpu

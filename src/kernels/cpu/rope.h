#pragma once
#include <cstdint>
#include <vector>

namespace loom::cpu {

// Rotary position embeddings (Su et al. 2021) in the Hugging Face Llama layout: within each head
// of HS elements, element i (i < HS / 2) and element i + HS / 2 form a pair rotated by the angle
// position * inv_freq[i] (rotate_half). Meta's original checkpoints pair (2i, 2i + 1) instead;
// converting them permutes the q and k projections' rows.

// Llama 3's frequency scaling (`rope_scaling` with rope_type "llama3" in a Hugging Face config);
// factor 0 leaves the frequencies as they are.
struct RopeScaling {
  double factor = 0;
  double low_freq_factor = 1, high_freq_factor = 4;
  int64_t original_max_position = 8192;
};

// inv_freq [HS / 2] = base^(-2 i / HS), then scaled as Llama 3 does. HS must be even.
std::vector<double> rope_inv_freq(int64_t HS, double base, const RopeScaling& scaling = {});

// Rotates in place the NH heads of HS elements at x[(b * T + t) * stride + h * HS + d] by the
// angle of position pos0 + t, or positions[t] where given (i32 [T]); with inverse, by the opposite
// angle (the backward: the rotation is orthogonal, so the input's gradient is the output's rotated
// back). Angles and their sines in double, rounded once to f32.
void rope_apply(float* x, int64_t B, int64_t T, int64_t NH, int64_t HS, int64_t stride, const double* inv_freq,
                int64_t pos0, const int32_t* positions, bool inverse);

}  // namespace loom::cpu

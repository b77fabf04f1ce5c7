// Rotary position embeddings: per position, its cosines and sines (computed in double, rounded
// once, on the stack), then every head of every row at that position rotated with them: a
// rotation costs two multiplies and an add per element, and the call allocates nothing.
#include "kernels/cpu/rope.h"

#include <cmath>

#include "core/error.h"

namespace loom::cpu {

void rope_apply(float* x, int64_t B, int64_t T, int64_t NH, int64_t HS, int64_t stride, const double* inv_freq,
                int64_t pos0, const int32_t* positions, bool inverse) {
  LOOM_CHECK(B >= 0 && T >= 0 && NH > 0 && HS > 0 && HS % 2 == 0 && HS <= kRopeMaxHead && stride >= NH * HS,
             "rope: bad shape B={} T={} NH={} HS={} (even, at most {}) stride={}", B, T, NH, HS, kRopeMaxHead, stride);
  const int64_t half = HS / 2;
  const double sign = inverse ? -1.0 : 1.0;
  // Each position's cosines and sines once, on the stack, for every row and head at it.
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float c[kRopeMaxHead / 2], s[kRopeMaxHead / 2];
    const double p = positions ? double(positions[t]) : double(pos0 + t);
    for (int64_t i = 0; i < half; ++i) {
      const double a = p * inv_freq[i];
      c[i] = float(std::cos(a));
      s[i] = float(sign * std::sin(a));
    }
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < NH; ++h) {
        float* lo = x + (b * T + t) * stride + h * HS;
        float* hi = lo + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x0 = lo[i], x1 = hi[i];
          lo[i] = x0 * c[i] - x1 * s[i];
          hi[i] = x1 * c[i] + x0 * s[i];
        }
      }
  }
}

}  // namespace loom::cpu

// Rotary position embeddings: a table of cos/sin per (position, pair) for the call's positions,
// then every head of every row rotated with it. The table is computed in double and rounded once,
// so a rotation costs two multiplies and an add per element.
#include "kernels/cpu/rope.h"

#include <cmath>
#include <vector>

#include "core/error.h"

namespace loom::cpu {

void rope_apply(float* x, int64_t B, int64_t T, int64_t NH, int64_t HS, int64_t stride, const double* inv_freq,
                int64_t pos0, const int32_t* positions, bool inverse) {
  LOOM_CHECK(B >= 0 && T >= 0 && NH > 0 && HS > 0 && HS % 2 == 0 && stride >= NH * HS,
             "rope: bad shape B={} T={} NH={} HS={} stride={}", B, T, NH, HS, stride);
  const int64_t half = HS / 2;
  std::vector<float> cs(static_cast<size_t>(T * half)), sn(static_cast<size_t>(T * half));
  const double sign = inverse ? -1.0 : 1.0;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const double p = positions ? double(positions[t]) : double(pos0 + t);
    for (int64_t i = 0; i < half; ++i) {
      const double a = p * inv_freq[i];
      cs[size_t(t * half + i)] = float(std::cos(a));
      sn[size_t(t * half + i)] = float(sign * std::sin(a));
    }
  }
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const float* c = cs.data() + t * half;
      const float* s = sn.data() + t * half;
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

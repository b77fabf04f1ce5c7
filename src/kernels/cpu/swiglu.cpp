// SwiGLU forward and backward, row by row; the sigmoid in f32 through exp of a non-positive
// argument, so it neither overflows nor loses the small tail.
#include "kernels/cpu/swiglu.h"

#include <cmath>

#include "core/error.h"

namespace loom::cpu {
namespace {

inline float sigmoid(float a) {
  const float e = std::exp(-std::fabs(a));  // in (0, 1]
  return a >= 0 ? 1.f / (1.f + e) : e / (1.f + e);
}

}  // namespace

void swiglu_forward(float* out, const float* inp, int64_t N, int64_t H) {
  LOOM_CHECK(N >= 0 && H > 0, "swiglu_forward: bad size N={} H={}", N, H);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = inp + n * 2 * H;
    const float* u = g + H;
    float* y = out + n * H;
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) y[j] = g[j] * sigmoid(g[j]) * u[j];
  }
}

void swiglu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int64_t H) {
  LOOM_CHECK(N >= 0 && H > 0, "swiglu_backward: bad size N={} H={}", N, H);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = inp + n * 2 * H;
    const float* u = g + H;
    const float* dy = dout + n * H;
    float* dg = dinp + n * 2 * H;
    float* du = dg + H;
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) {
      const float a = g[j], b = u[j], s = sigmoid(a);
      const float silu = a * s;
      // silu'(a) = s (1 + a (1 - s))
      const float dga = dy[j] * b * (s * (1.f + a * (1.f - s)));
      du[j] = dy[j] * silu;
      dg[j] = dga;
    }
  }
}

}  // namespace loom::cpu

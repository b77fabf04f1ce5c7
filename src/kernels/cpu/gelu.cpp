// GELU, tanh form, vectorised with AVX2. 0.5 (1 + tanh(u)) is the logistic sigmoid of 2u, so
//   gelu(x)  = x * s,                       s = 1 / (1 + exp(-2u)), u = k (x + a x^3)
//   gelu'(x) = s + 2 x s (1 - s) k (1 + 3 a x^2)
// with one exp per element and no cancellation near u = 0.
#include "kernels/cpu/gelu.h"

#include <immintrin.h>

#include <algorithm>

#include "core/error.h"
#include "kernels/cpu/vec_math.h"

namespace loom::cpu {

namespace {

constexpr float kK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kA = 0.044715f;
constexpr int64_t kChunk = 4096;  // elements per parallel work item (a multiple of 8)

// s = sigmoid(2u) for 8 inputs.
inline __m256 sigmoid_2u(__m256 x, __m256 x2) {
  const __m256 one = _mm256_set1_ps(1.f);
  __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(kA), x2), x, x);  // x + a x^3
  __m256 m2u = _mm256_mul_ps(_mm256_set1_ps(-2.f * kK), inner);
  return _mm256_div_ps(one, _mm256_add_ps(one, vec::exp(m2u)));
}

inline __m256 gelu8(__m256 x) { return _mm256_mul_ps(x, sigmoid_2u(x, _mm256_mul_ps(x, x))); }

inline __m256 gelu_grad8(__m256 x, __m256 dy) {
  const __m256 one = _mm256_set1_ps(1.f);
  __m256 x2 = _mm256_mul_ps(x, x);
  __m256 s = sigmoid_2u(x, x2);
  __m256 du = _mm256_mul_ps(_mm256_set1_ps(kK), _mm256_fmadd_ps(_mm256_set1_ps(3.f * kA), x2, one));
  // s + 2 x s (1 - s) du
  __m256 t = _mm256_mul_ps(_mm256_mul_ps(_mm256_add_ps(x, x), _mm256_mul_ps(s, _mm256_sub_ps(one, s))), du);
  return _mm256_mul_ps(dy, _mm256_add_ps(s, t));
}

}  // namespace

void gelu_forward(float* out, const float* inp, int64_t n) {
  LOOM_CHECK(n >= 0, "gelu_forward: negative size {}", n);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i0 = c * kChunk, i1 = std::min(n, i0 + kChunk);
    int64_t i = i0;
    for (; i + vec::kWidth <= i1; i += vec::kWidth) _mm256_storeu_ps(out + i, gelu8(_mm256_loadu_ps(inp + i)));
    if (i < i1) vec::store_tail(out + i, gelu8(vec::load_tail(inp + i, i1 - i, 0.f)), i1 - i);
  }
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n) {
  LOOM_CHECK(n >= 0, "gelu_backward: negative size {}", n);
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i0 = c * kChunk, i1 = std::min(n, i0 + kChunk);
    int64_t i = i0;
    for (; i + vec::kWidth <= i1; i += vec::kWidth)
      _mm256_storeu_ps(dinp + i, gelu_grad8(_mm256_loadu_ps(inp + i), _mm256_loadu_ps(dout + i)));
    if (i < i1) {
      const int64_t r = i1 - i;
      vec::store_tail(dinp + i, gelu_grad8(vec::load_tail(inp + i, r, 0.f), vec::load_tail(dout + i, r, 0.f)), r);
    }
  }
}

}  // namespace loom::cpu

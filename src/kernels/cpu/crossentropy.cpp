// Fused softmax + cross-entropy, one row per work item. The row's log-sum-exp is computed online
// in chunks that stay in L1: the chunk's max, then the chunk's sum of exp(x - running max) with
// one exp per element, the running sum rescaled only when the max grows and accumulated in
// double. With gradients, a second sweep over the row (now in L2) writes
// dloss * (softmax - onehot). Padding columns [V, Vp) are never read; their gradient is zero.
#include "kernels/cpu/crossentropy.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "kernels/cpu/vec_math.h"

namespace loom::cpu {

namespace {

constexpr int64_t kChunk = 2048;  // floats per online step (8 KiB), a multiple of 8

void check_args(const char* op, const int32_t* targets, int64_t N, int64_t V, int64_t Vp) {
  LOOM_CHECK(N >= 0 && V > 0 && Vp >= V, "{}: bad size N={} V={} Vp={} (need 0 < V <= Vp)", op, N, V, Vp);
  for (int64_t i = 0; i < N; ++i)
    if (targets[i] < -1 || targets[i] >= V) [[unlikely]]
      LOOM_FAIL("{}: target {} at row {} is outside [-1, {}) (-1 means ignored)", op, targets[i], i, V);
}

float chunk_max(const float* x, int64_t len) {
  const float ninf = -std::numeric_limits<float>::infinity();
  __m256 m = _mm256_set1_ps(ninf);
  int64_t i = 0;
  for (; i + vec::kWidth <= len; i += vec::kWidth) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  if (i < len) m = _mm256_max_ps(m, vec::load_tail(x + i, len - i, ninf));
  return vec::hmax(m);
}

// Sum of exp(x - shift) over x [len], in float within the chunk.
float chunk_sum_exp(const float* x, int64_t len, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 2 * vec::kWidth <= len; i += 2 * vec::kWidth) {
    a0 = _mm256_add_ps(a0, vec::exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
    a1 = _mm256_add_ps(a1, vec::exp(_mm256_sub_ps(_mm256_loadu_ps(x + i + vec::kWidth), s)));
  }
  for (; i + vec::kWidth <= len; i += vec::kWidth)
    a0 = _mm256_add_ps(a0, vec::exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), s)));
  if (i < len) {
    const int64_t r = len - i;
    __m256 e = vec::exp(_mm256_sub_ps(vec::load_tail(x + i, r, 0.f), s));
    a0 = _mm256_add_ps(a0, _mm256_and_ps(e, _mm256_castsi256_ps(vec::tail_mask(r))));
  }
  return vec::hsum(_mm256_add_ps(a0, a1));
}

void scaled_exp_avx(float* d, const float* x, int64_t n, __m256 shift, __m256 scale) {
  int64_t i = 0;
  for (; i + vec::kWidth <= n; i += vec::kWidth)
    _mm256_storeu_ps(d + i, _mm256_mul_ps(scale, vec::exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift))));
  if (i < n) {
    const int64_t r = n - i;
    vec::store_tail(d + i, _mm256_mul_ps(scale, vec::exp(_mm256_sub_ps(vec::load_tail(x + i, r, 0.f), shift))), r);
  }
}

struct RowStats {
  float max;     // max of the row
  double sum;    // sum of exp(x - max)
};

RowStats row_logsumexp(const float* x, int64_t V) {
  float m = -std::numeric_limits<float>::infinity();
  double sum = 0.0;
  for (int64_t c0 = 0; c0 < V; c0 += kChunk) {
    const int64_t len = std::min(kChunk, V - c0);
    const float cm = chunk_max(x + c0, len);
    if (cm > m) {
      if (sum > 0.0) sum *= std::exp(double(m) - double(cm));
      m = cm;
    }
    sum += double(chunk_sum_exp(x + c0, len, m));
  }
  return {m, sum};
}

// Loss of one row: log(sum) + max - x[target], in double.
float row_loss(const float* x, const RowStats& st, int32_t target) {
  return float(std::log(st.sum) + double(st.max) - double(x[target]));
}

}  // namespace

float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) m = std::max(m, chunk_max(x + c0, std::min(kChunk, n - c0)));
  return m;
}

double row_sum_exp(const float* x, int64_t n, float shift) {
  double sum = 0.0;
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) sum += double(chunk_sum_exp(x + c0, std::min(kChunk, n - c0), shift));
  return sum;
}

void scaled_exp(float* d, const float* x, int64_t n, float shift, float scale) {
  scaled_exp_avx(d, x, n, _mm256_set1_ps(shift), _mm256_set1_ps(scale));
}

void crossentropy_forward(float* losses, const float* logits, const int32_t* targets, int64_t N, int64_t V,
                          int64_t Vp) {
  check_args("crossentropy_forward", targets, N, V, Vp);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int32_t t = targets[n];
    if (t < 0) {
      losses[n] = 0.f;
      continue;
    }
    const float* x = logits + n * Vp;  // f32 [Vp], read up to V
    losses[n] = row_loss(x, row_logsumexp(x, V), t);
  }
}

void crossentropy_forward_backward(float* losses, float* dlogits, const float* logits, const int32_t* targets,
                                   float dloss, int64_t N, int64_t V, int64_t Vp) {
  check_args("crossentropy_forward_backward", targets, N, V, Vp);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int32_t t = targets[n];
    const float* x = logits + n * Vp;  // f32 [Vp]
    float* d = dlogits + n * Vp;       // f32 [Vp], may be x
    if (t < 0) {
      if (losses) losses[n] = 0.f;
      std::fill(d, d + Vp, 0.f);
      continue;
    }
    const RowStats st = row_logsumexp(x, V);
    const float loss = row_loss(x, st, t);
    const float x_target = x[t];  // read before an in-place write overwrites it
    if (losses) losses[n] = loss;
    // d = dloss * exp(x - max) / sum, then the target column gets -dloss.
    const __m256 shift = _mm256_set1_ps(st.max);
    const __m256 scale = _mm256_set1_ps(float(double(dloss) / st.sum));
    scaled_exp_avx(d, x, V, shift, scale);
    // softmax(x_t) - 1, from the loss (p_t = exp(-loss)) for accuracy when p_t is close to 1.
    d[t] = float(double(dloss) * std::expm1(-(std::log(st.sum) + double(st.max) - double(x_target))));
    std::fill(d + V, d + Vp, 0.f);
  }
}

}  // namespace loom::cpu

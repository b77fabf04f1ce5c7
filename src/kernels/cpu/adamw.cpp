// AdamW in the order of operations of torch.optim.AdamW (PyTorch 1.13, single-tensor path):
//   p.mul_(1 - lr*wd); m.mul_(b1).add_(g, alpha=1-b1); v.mul_(b2).addcmul_(g, g, value=1-b2);
//   denom = (v.sqrt() / sqrt(1 - b2^t)).add_(eps); p.addcdiv_(m, denom, value=-lr/(1 - b1^t))
// with each scalar formed in double and rounded to float, and each tensor op rounded to float.
// PyTorch's vectorised CPU kernels fuse add_(alpha) into fma(g, 1-b1, m*b1) and addcmul_ into
// fma((1-b2)*g, g, v*b2); written out here the same way, 10 steps agree with torch 1.13 bitwise
// (tests/kernels/cpu/adamw_torch_test.cpp).
#include "kernels/cpu/adamw.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/vec_math.h"

namespace loom::cpu {

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWArgs& a) {
  LOOM_CHECK(n >= 0, "adamw_update: negative size {}", n);
  LOOM_CHECK(a.step >= 1, "adamw_update: step must be >= 1 (1-based), got {}", a.step);
  LOOM_CHECK(a.lr >= 0 && a.eps >= 0 && a.weight_decay >= 0, "adamw_update: lr={}, eps={}, weight_decay={} must be >= 0",
             a.lr, a.eps, a.weight_decay);
  LOOM_CHECK(a.beta1 >= 0 && a.beta1 < 1 && a.beta2 >= 0 && a.beta2 < 1,
             "adamw_update: betas ({}, {}) must be in [0, 1)", a.beta1, a.beta2);
  const double t = double(a.step);
  const float decay = float(1.0 - a.lr * a.weight_decay);
  const float b1 = float(a.beta1), one_minus_b1 = float(1.0 - a.beta1);
  const float b2 = float(a.beta2), one_minus_b2 = float(1.0 - a.beta2);
  const float bc2_sqrt = float(std::sqrt(1.0 - std::pow(a.beta2, t)));
  const float neg_step_size = float(-(a.lr / (1.0 - std::pow(a.beta1, t))));
  const float eps = float(a.eps);
  const float gs = a.grad_scale;
  // Explicit AVX2: every multiply, add, fma, sqrt and divide below is exactly one rounding, so
  // the compiler cannot fuse or split them differently from the order above.
  constexpr int64_t kChunk = 4096;  // elements per work item, a multiple of 8
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  const __m256 vdecay = _mm256_set1_ps(decay), vb1 = _mm256_set1_ps(b1), v1mb1 = _mm256_set1_ps(one_minus_b1);
  const __m256 vb2 = _mm256_set1_ps(b2), v1mb2 = _mm256_set1_ps(one_minus_b2), vbc2 = _mm256_set1_ps(bc2_sqrt);
  const __m256 veps = _mm256_set1_ps(eps), vstep = _mm256_set1_ps(neg_step_size), vgs = _mm256_set1_ps(gs);
  auto update8 = [&](__m256 p, __m256 g, __m256 m8, __m256 v8, __m256& p_out, __m256& m_out, __m256& v_out) {
    g = _mm256_mul_ps(g, vgs);
    p = _mm256_mul_ps(p, vdecay);
    asm("" : "+x"(p));  // p * decay is rounded on its own (PyTorch's p.mul_), never fused into the add below
    m_out = _mm256_fmadd_ps(g, v1mb1, _mm256_mul_ps(m8, vb1));
    v_out = _mm256_fmadd_ps(_mm256_mul_ps(v1mb2, g), g, _mm256_mul_ps(v8, vb2));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v_out), vbc2), veps);
    p_out = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(vstep, m_out), denom));
  };
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t i0 = c * kChunk, i1 = std::min(n, i0 + kChunk);
    int64_t i = i0;
    __m256 po, mo, vo;
    for (; i + vec::kWidth <= i1; i += vec::kWidth) {
      update8(_mm256_loadu_ps(param + i), _mm256_loadu_ps(grad + i), _mm256_loadu_ps(m + i), _mm256_loadu_ps(v + i), po,
              mo, vo);
      _mm256_storeu_ps(param + i, po);
      _mm256_storeu_ps(m + i, mo);
      _mm256_storeu_ps(v + i, vo);
    }
    if (i < i1) {
      const int64_t r = i1 - i;
      update8(vec::load_tail(param + i, r, 0.f), vec::load_tail(grad + i, r, 0.f), vec::load_tail(m + i, r, 0.f),
              vec::load_tail(v + i, r, 0.f), po, mo, vo);
      vec::store_tail(param + i, po, r);
      vec::store_tail(m + i, mo, r);
      vec::store_tail(v + i, vo, r);
    }
  }
}

double sum_squares(const float* x, int64_t n) {
  LOOM_CHECK(n >= 0, "sum_squares: negative size {}", n);
  // Fixed blocks, each summed in double, then the block sums added in block order: the same
  // result for any thread count.
  constexpr int64_t kBlock = 1 << 14;
  const int64_t nblocks = (n + kBlock - 1) / kBlock;
  std::vector<double> partial(size_t(nblocks), 0.0);
#pragma omp parallel for schedule(static) if (nblocks > 1)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t i0 = b * kBlock, i1 = std::min(n, i0 + kBlock);
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = i0; i < i1; ++i) s += double(x[i]) * double(x[i]);
    partial[size_t(b)] = s;
  }
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

float clip_scale(double global_norm, float max_norm) {
  LOOM_CHECK(!(global_norm < 0), "clip_scale: negative global norm {}", global_norm);
  if (max_norm <= 0.f) return 1.f;
  // A NaN norm gives a NaN scale, so non-finite gradients stay visible (as in PyTorch).
  if (std::isnan(global_norm)) return std::numeric_limits<float>::quiet_NaN();
  // PyTorch: clip_coef = max_norm / (total_norm + 1e-6), clamped to at most 1.
  return float(std::min(1.0, double(max_norm) / (global_norm + 1e-6)));
}

}  // namespace loom::cpu

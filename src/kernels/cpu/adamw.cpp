// AdamW in the order of operations of torch.optim.AdamW (PyTorch 1.13, single-tensor path):
//   p.mul_(1 - lr*wd); m.mul_(b1).add_(g, alpha=1-b1); v.mul_(b2).addcmul_(g, g, value=1-b2);
//   denom = (v.sqrt() / sqrt(1 - b2^t)).add_(eps); p.addcdiv_(m, denom, value=-lr/(1 - b1^t))
// with each scalar formed in double and rounded to float, and each tensor op rounded to float.
// PyTorch's vectorised CPU kernels fuse add_(alpha) into fma(g, 1-b1, m*b1) and addcmul_ into
// fma((1-b2)*g, g, v*b2); written out here the same way, 10 steps agree with torch 1.13 bitwise
// (tests/kernels/cpu/adamw_torch_test.cpp).
#include "kernels/cpu/adamw.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"

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
#pragma omp parallel for simd schedule(static) if (n >= (1 << 14))
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * gs;
    const float p = param[i] * decay;
    const float mi = std::fma(g, one_minus_b1, m[i] * b1);
    const float vi = std::fma(one_minus_b2 * g, g, v[i] * b2);
    const float denom = std::sqrt(vi) / bc2_sqrt + eps;
    m[i] = mi;
    v[i] = vi;
    param[i] = p + neg_step_size * mi / denom;
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

// LayerNorm and RMSNorm over the last dimension, one code for both (RMSNorm: no mean, no bias).
// Forward: one row per iteration, mean and variance (or the mean of squares) accumulated in double
// (two passes over a row that sits in L1). Backward: dinp row by row, then dweight/dbias by column
// blocks that walk the rows in order, so every sum has a fixed order whatever the thread count.
#include "kernels/cpu/layernorm.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace loom::cpu {
namespace {

template <bool kRms>
void norm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                  int64_t N, int64_t C, float eps) {
  LOOM_CHECK(N >= 0 && C > 0, "{}_forward: bad size N={} C={}", kRms ? "rmsnorm" : "layernorm", N, C);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = inp + n * C;  // f32 [C]
    float* y = out + n * C;        // f32 [C]
    double m = 0.0;
    if constexpr (!kRms) {
      double s = 0.0;
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < C; ++c) s += double(x[c]);
      m = s / double(C);
    }
    double v = 0.0;
#pragma omp simd reduction(+ : v)
    for (int64_t c = 0; c < C; ++c) {
      const double d = double(x[c]) - m;
      v += d * d;
    }
    const float mf = float(m);
    const float r = float(1.0 / std::sqrt(v / double(C) + double(eps)));
    if (bias) {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) y[c] = (x[c] - mf) * r * weight[c] + bias[c];
    } else {
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) y[c] = (x[c] - mf) * r * weight[c];
    }
    if (mean) mean[n] = mf;
    if (rstd) rstd[n] = r;
  }
}

template <bool kRms>
void norm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp, const float* weight,
                   const float* mean, const float* rstd, int64_t N, int64_t C, bool accumulate_dinp) {
  LOOM_CHECK(N >= 0 && C > 0, "{}_backward: bad size N={} C={}", kRms ? "rmsnorm" : "layernorm", N, C);
  auto mean_of = [&](int64_t n) { return kRms ? 0.f : mean[n]; };
  if (dinp) {
    // dinp = rstd * (dnorm - mean(dnorm) - xhat * mean(dnorm * xhat)), dnorm = dout * weight
    // (RMSNorm: no mean(dnorm) term, xhat = x * rstd).
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* x = inp + n * C;
      const float* dy = dout + n * C;
      float* dx = dinp + n * C;
      const float m = mean_of(n), r = rstd[n];
      float sum_dn = 0.f, sum_dn_xhat = 0.f;
#pragma omp simd reduction(+ : sum_dn, sum_dn_xhat)
      for (int64_t c = 0; c < C; ++c) {
        const float dn = dy[c] * weight[c];
        if constexpr (!kRms) sum_dn += dn;
        sum_dn_xhat += dn * ((x[c] - m) * r);
      }
      const float mean_dn = sum_dn / float(C), mean_dn_xhat = sum_dn_xhat / float(C);
      if (accumulate_dinp) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c)
          dx[c] += r * (dy[c] * weight[c] - mean_dn - ((x[c] - m) * r) * mean_dn_xhat);
      } else {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c)
          dx[c] = r * (dy[c] * weight[c] - mean_dn - ((x[c] - m) * r) * mean_dn_xhat);
      }
    }
  }
  if (dweight || dbias) {
    // dweight [C] += sum_n dout * xhat, dbias [C] += sum_n dout, by blocks of columns.
    constexpr int64_t kBlock = 64;
    const int64_t nblocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t c0 = b * kBlock, len = std::min(kBlock, C - c0);
      float acc_w[kBlock] = {}, acc_b[kBlock] = {};
      for (int64_t n = 0; n < N; ++n) {
        const float* x = inp + n * C + c0;
        const float* dy = dout + n * C + c0;
        const float m = mean_of(n), r = rstd[n];
#pragma omp simd
        for (int64_t c = 0; c < len; ++c) {
          acc_w[c] += dy[c] * ((x[c] - m) * r);
          acc_b[c] += dy[c];
        }
      }
      if (dweight)
        for (int64_t c = 0; c < len; ++c) dweight[c0 + c] += acc_w[c];
      if (dbias)
        for (int64_t c = 0; c < len; ++c) dbias[c0 + c] += acc_b[c];
    }
  }
}

}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int64_t N, int64_t C, float eps) {
  norm_forward<false>(out, mean, rstd, inp, weight, bias, N, C, eps);
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                        bool accumulate_dinp) {
  norm_backward<false>(dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, accumulate_dinp);
}

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C,
                     float eps) {
  norm_forward<true>(out, nullptr, rstd, inp, weight, nullptr, N, C, eps);
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C, bool accumulate_dinp) {
  norm_backward<true>(dinp, dweight, nullptr, dout, inp, weight, nullptr, rstd, N, C, accumulate_dinp);
}

}  // namespace loom::cpu

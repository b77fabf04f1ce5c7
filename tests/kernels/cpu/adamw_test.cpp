#include "kernels/cpu/adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/kernel_test_util.h"

using namespace loom;
using loom::test::all_close;
using loom::test::random_vec;
using loom::test::ScopedThreads;

namespace {

// torch.optim.AdamW, one step, in double.
void ref_adamw(std::vector<double>& p, const std::vector<double>& g, std::vector<double>& m, std::vector<double>& v,
               const cpu::AdamWArgs& a) {
  const double bc1 = 1 - std::pow(a.beta1, double(a.step)), bc2 = 1 - std::pow(a.beta2, double(a.step));
  for (size_t i = 0; i < p.size(); ++i) {
    const double gi = g[i] * a.grad_scale;
    p[i] *= 1 - a.lr * a.weight_decay;
    m[i] = a.beta1 * m[i] + (1 - a.beta1) * gi;
    v[i] = a.beta2 * v[i] + (1 - a.beta2) * gi * gi;
    p[i] -= (a.lr / bc1) * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + a.eps);
  }
}

}  // namespace

TEST(AdamW, TenStepsTrackDoubleReference) {
  const int64_t n = 1003;
  cpu::AdamWArgs a;
  a.lr = 1e-3;
  a.beta1 = 0.9;
  a.beta2 = 0.95;
  a.eps = 1e-8;
  a.weight_decay = 0.1;
  a.grad_scale = 0.75f;
  auto p = random_vec(n, 1);
  std::vector<float> m(size_t(n), 0.f), v(size_t(n), 0.f);
  auto pd = test::to_double(p);
  std::vector<double> md(size_t(n), 0.0), vd(size_t(n), 0.0);
  for (int64_t step = 1; step <= 10; ++step) {
    // Gradients of different scales per element, including tiny ones where eps matters.
    auto g = random_vec(n, 100 + uint64_t(step));
    for (int64_t i = 0; i < n; i += 5) g[size_t(i)] *= 1e-6f;
    a.step = step;
    cpu::adamw_update(p.data(), g.data(), m.data(), v.data(), n, a);
    ref_adamw(pd, test::to_double(g), md, vd, a);
  }
  // Each step moves a parameter by at most ~lr; float rounding of the update and of p stays far
  // below 1e-6 after 10 steps.
  EXPECT_TRUE(all_close(p, pd, 1e-6, 1e-6));
  EXPECT_TRUE(all_close(m, md, 1e-7, 1e-5));
  EXPECT_TRUE(all_close(v, vd, 1e-9, 1e-5));
}

TEST(AdamW, FirstStepMovesEachParameterByAboutLr) {
  // With m = v = 0, step 1 gives m_hat = g, v_hat = g^2: the update is lr * sign(g) (for |g| >> eps).
  const int64_t n = 257;
  cpu::AdamWArgs a;
  a.lr = 0.01;
  a.weight_decay = 0.0;
  auto p = random_vec(n, 2), g = random_vec(n, 3);
  auto p0 = p;
  std::vector<float> m(size_t(n), 0.f), v(size_t(n), 0.f);
  cpu::adamw_update(p.data(), g.data(), m.data(), v.data(), n, a);
  for (int64_t i = 0; i < n; ++i)
    EXPECT_NEAR(p[size_t(i)] - p0[size_t(i)], g[size_t(i)] > 0 ? -0.01 : 0.01, 1e-6) << i;
}

TEST(AdamW, ResultsIndependentOfThreadCountAndBadArgsThrow) {
  const int64_t n = 100003;  // takes the multithreaded path
  auto g = random_vec(n, 4);
  cpu::AdamWArgs a;
  a.weight_decay = 0.1;
  a.step = 3;
  auto run = [&](int threads) {
    ScopedThreads st(threads);
    auto p = random_vec(n, 5), m = random_vec(n, 6), v = random_vec(n, 7, 0.f, 1.f);
    cpu::adamw_update(p.data(), g.data(), m.data(), v.data(), n, a);
    return std::vector<std::vector<float>>{p, m, v};
  };
  EXPECT_EQ(run(1), run(2));
  std::vector<float> p(4), gg(4), m(4), v(4);
  a.step = 0;
  EXPECT_THROW(cpu::adamw_update(p.data(), gg.data(), m.data(), v.data(), 4, a), Error);
  a.step = 1;
  a.beta2 = 1.0;
  EXPECT_THROW(cpu::adamw_update(p.data(), gg.data(), m.data(), v.data(), 4, a), Error);
}

TEST(SumSquares, MatchesDoubleAndIndependentOfThreadCount) {
  for (int64_t n : {0, 1, 17, 16384, 100003, 1 << 20}) {
    auto x = random_vec(n, 8 + uint64_t(n), -3.f, 3.f);
    double want = 0;
    for (float f : x) want += double(f) * double(f);
    double s1, s2, s3;
    {
      ScopedThreads st(1);
      s1 = cpu::sum_squares(x.data(), n);
    }
    {
      ScopedThreads st(2);
      s2 = cpu::sum_squares(x.data(), n);
    }
    {
      ScopedThreads st(3);
      s3 = cpu::sum_squares(x.data(), n);
    }
    EXPECT_NEAR(s1, want, 1e-12 * want + 1e-300) << "n=" << n;  // double sums of products of floats
    EXPECT_EQ(s1, s2) << "n=" << n;
    EXPECT_EQ(s1, s3) << "n=" << n;
  }
}

TEST(ClipScale, PyTorchRule) {
  EXPECT_EQ(cpu::clip_scale(0.5, 1.f), 1.f);
  EXPECT_FLOAT_EQ(cpu::clip_scale(4.0, 1.f), float(1.0 / (4.0 + 1e-6)));
  EXPECT_EQ(cpu::clip_scale(1e9, 0.f), 1.f);  // disabled
  EXPECT_EQ(cpu::clip_scale(0.0, 1.f), 1.f);
  EXPECT_TRUE(std::isnan(cpu::clip_scale(NAN, 1.f)));
  EXPECT_THROW(cpu::clip_scale(-1.0, 1.f), Error);
}

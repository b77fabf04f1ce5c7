#include "kernels/cpu/layernorm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernels/cpu/kernel_test_util.h"

using namespace loom;
using loom::test::all_close;
using loom::test::random_vec;
using loom::test::ScopedThreads;

namespace {

constexpr double kEps = 1e-5;

struct RefForward {
  std::vector<double> out, mean, rstd;
};

// out [N, C] = (x - mean) * rstd * w + b in double.
RefForward ref_forward(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& b,
                       int64_t N, int64_t C) {
  RefForward r{std::vector<double>(size_t(N * C)), std::vector<double>(size_t(N)), std::vector<double>(size_t(N))};
  for (int64_t n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int64_t c = 0; c < C; ++c) m += x[size_t(n * C + c)];
    m /= double(C);
    for (int64_t c = 0; c < C; ++c) v += (x[size_t(n * C + c)] - m) * (x[size_t(n * C + c)] - m);
    v /= double(C);
    const double rs = 1.0 / std::sqrt(v + kEps);
    for (int64_t c = 0; c < C; ++c) r.out[size_t(n * C + c)] = (x[size_t(n * C + c)] - m) * rs * w[size_t(c)] + b[size_t(c)];
    r.mean[size_t(n)] = m;
    r.rstd[size_t(n)] = rs;
  }
  return r;
}

struct RefBackward {
  std::vector<double> dx, dw, db;
};

// Gradients of sum(out * dy) in double, written out term by term (not the kernel's formula).
RefBackward ref_backward(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& dy,
                         int64_t N, int64_t C) {
  RefForward f = ref_forward(x, w, std::vector<double>(size_t(C), 0.0), N, C);
  RefBackward g{std::vector<double>(size_t(N * C)), std::vector<double>(size_t(C)), std::vector<double>(size_t(C))};
  for (int64_t n = 0; n < N; ++n) {
    const double m = f.mean[size_t(n)], rs = f.rstd[size_t(n)];
    // xhat_c = (x_c - m) rs; d xhat_c / d x_k = rs (delta_ck - 1/C - xhat_c xhat_k / C)
    std::vector<double> xhat(static_cast<size_t>(C)), dxhat(static_cast<size_t>(C));
    for (int64_t c = 0; c < C; ++c) {
      xhat[size_t(c)] = (x[size_t(n * C + c)] - m) * rs;
      dxhat[size_t(c)] = dy[size_t(n * C + c)] * w[size_t(c)];
      g.dw[size_t(c)] += dy[size_t(n * C + c)] * xhat[size_t(c)];
      g.db[size_t(c)] += dy[size_t(n * C + c)];
    }
    for (int64_t k = 0; k < C; ++k) {
      double s = 0;
      for (int64_t c = 0; c < C; ++c)
        s += dxhat[size_t(c)] * rs * ((c == k ? 1.0 : 0.0) - 1.0 / double(C) - xhat[size_t(c)] * xhat[size_t(k)] / double(C));
      g.dx[size_t(n * C + k)] = s;
    }
  }
  return g;
}

struct Case {
  int64_t N, C;
};

}  // namespace

class LayerNormTest : public ::testing::TestWithParam<Case> {};

TEST_P(LayerNormTest, ForwardAndBackwardMatchDoubleReference) {
  const int64_t N = GetParam().N, C = GetParam().C;
  // Rows with an offset and a spread, so mean removal and scaling both matter.
  auto x = random_vec(N * C, 1, -2.f, 3.f), w = random_vec(C, 2, 0.5f, 1.5f), b = random_vec(C, 3);
  auto dy = random_vec(N * C, 4);
  std::vector<float> out(size_t(N * C)), mean(static_cast<size_t>(N)), rstd(static_cast<size_t>(N));
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, float(kEps));
  auto xd = test::to_double(x), wd = test::to_double(w), bd = test::to_double(b);
  RefForward rf = ref_forward(xd, wd, bd, N, C);
  // Normalised values are O(1); float rounding of (x - mean) * rstd * w + b stays below 1e-6.
  EXPECT_TRUE(all_close(out, rf.out, 2e-6, 1e-6));
  EXPECT_TRUE(all_close(mean, rf.mean, 1e-6, 1e-6));
  EXPECT_TRUE(all_close(rstd, rf.rstd, 0, 1e-6));

  RefBackward rb = ref_backward(xd, wd, test::to_double(dy), N, C);
  auto dx = random_vec(N * C, 5), dw = random_vec(C, 6), db = random_vec(C, 7);
  auto dx_acc = dx;
  std::vector<double> want_dx_acc(size_t(N * C)), want_dw(static_cast<size_t>(C)), want_db(static_cast<size_t>(C));
  for (size_t i = 0; i < dx.size(); ++i) want_dx_acc[i] = rb.dx[i] + dx[i];
  for (int64_t c = 0; c < C; ++c) {
    want_dw[size_t(c)] = rb.dw[size_t(c)] + dw[size_t(c)];
    want_db[size_t(c)] = rb.db[size_t(c)] + db[size_t(c)];
  }
  cpu::layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(), rstd.data(), N,
                          C);
  // dinp sums C products of O(1) terms; the parameter gradients sum N of them (float).
  EXPECT_TRUE(all_close(dx, rb.dx, 1e-5, 1e-5));
  EXPECT_TRUE(all_close(dw, want_dw, 1e-5, 1e-5));
  EXPECT_TRUE(all_close(db, want_db, 1e-5, 1e-5));
  cpu::layernorm_backward(dx_acc.data(), nullptr, nullptr, dy.data(), x.data(), w.data(), mean.data(), rstd.data(), N,
                          C, /*accumulate_dinp=*/true);
  EXPECT_TRUE(all_close(dx_acc, want_dx_acc, 1e-5, 1e-5));
}

INSTANTIATE_TEST_SUITE_P(Sizes, LayerNormTest,
                         ::testing::Values(Case{37, 67}, Case{5, 768}, Case{130, 3}, Case{1, 129}));

TEST(LayerNorm, GradientsMatchCentralDifferences) {
  // Central differences of loss = sum(ref_forward(x) * dy) in double (h = 1e-6, error ~1e-9)
  // against the kernel's float gradients.
  const int64_t N = 3, C = 11;
  auto x = random_vec(N * C, 11, -1.f, 2.f), w = random_vec(C, 12, 0.5f, 1.5f), b = random_vec(C, 13);
  auto dy = random_vec(N * C, 14);
  std::vector<float> out(size_t(N * C)), mean(static_cast<size_t>(N)), rstd(static_cast<size_t>(N));
  std::vector<float> dx(size_t(N * C)), dw(size_t(C), 0.f), db(size_t(C), 0.f);
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, float(kEps));
  cpu::layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(), rstd.data(), N,
                          C);
  auto xd = test::to_double(x), wd = test::to_double(w), bd = test::to_double(b), dyd = test::to_double(dy);
  auto loss = [&] {
    RefForward f = ref_forward(xd, wd, bd, N, C);
    double s = 0;
    for (size_t i = 0; i < f.out.size(); ++i) s += f.out[i] * dyd[i];
    return s;
  };
  const double h = 1e-6, tol = 2e-5;
  auto fd = [&](std::vector<double>& p, size_t i) {
    const double p0 = p[i];
    p[i] = p0 + h;
    const double lp = loss();
    p[i] = p0 - h;
    const double lm = loss();
    p[i] = p0;
    return (lp - lm) / (2 * h);
  };
  for (size_t i = 0; i < xd.size(); i += 2) EXPECT_NEAR(dx[i], fd(xd, i), tol) << "dx " << i;
  for (size_t i = 0; i < wd.size(); ++i) EXPECT_NEAR(dw[i], fd(wd, i), tol) << "dw " << i;
  for (size_t i = 0; i < bd.size(); ++i) EXPECT_NEAR(db[i], fd(bd, i), tol) << "db " << i;
}

TEST(LayerNorm, ResultsIndependentOfThreadCount) {
  const int64_t N = 203, C = 131;
  auto x = random_vec(N * C, 21), w = random_vec(C, 22), b = random_vec(C, 23), dy = random_vec(N * C, 24);
  auto run = [&](int threads) {
    ScopedThreads st(threads);
    std::vector<float> out(size_t(N * C)), mean(static_cast<size_t>(N)), rstd(static_cast<size_t>(N)), dx(size_t(N * C)), dw(size_t(C), 0.f),
        db(size_t(C), 0.f);
    cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    cpu::layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(), rstd.data(),
                            N, C);
    return std::vector<std::vector<float>>{out, mean, rstd, dx, dw, db};
  };
  const auto r1 = run(1);
  EXPECT_EQ(r1, run(2));
  EXPECT_EQ(r1, run(3));
}

TEST(LayerNorm, NullBiasAndNullStatistics) {
  const int64_t N = 9, C = 45;
  auto x = random_vec(N * C, 31), w = random_vec(C, 32);
  std::vector<double> zero(static_cast<size_t>(C), 0.0);
  RefForward rf = ref_forward(test::to_double(x), test::to_double(w), zero, N, C);
  std::vector<float> out(static_cast<size_t>(N * C));
  cpu::layernorm_forward(out.data(), nullptr, nullptr, x.data(), w.data(), nullptr, N, C, float(kEps));
  EXPECT_TRUE(all_close(out, rf.out, 2e-6, 1e-6));
}

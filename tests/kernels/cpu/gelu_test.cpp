#include "kernels/cpu/gelu.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "kernels/cpu/kernel_test_util.h"

using namespace loom;
using loom::test::all_close;
using loom::test::random_vec;
using loom::test::ScopedThreads;

namespace {

// The tanh form, literally, in double.
double ref_gelu(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  return 0.5 * x * (1.0 + std::tanh(k * (x + 0.044715 * x * x * x)));
}

double ref_gelu_grad(double x) {
  const double k = std::sqrt(2.0 / M_PI);
  const double u = k * (x + 0.044715 * x * x * x);
  const double th = std::tanh(u);
  return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * k * (1.0 + 3.0 * 0.044715 * x * x);
}

}  // namespace

TEST(Gelu, ForwardAndBackwardMatchDoubleReference) {
  for (int64_t n : {1, 7, 8, 1003, 4096 * 3 + 5}) {
    auto x = random_vec(n, 1 + uint64_t(n), -6.f, 6.f), dy = random_vec(n, 2 + uint64_t(n));
    std::vector<float> out(static_cast<size_t>(n)), dx(static_cast<size_t>(n));
    std::vector<double> want(static_cast<size_t>(n)), want_dx(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      want[size_t(i)] = ref_gelu(x[size_t(i)]);
      want_dx[size_t(i)] = dy[size_t(i)] * ref_gelu_grad(x[size_t(i)]);
    }
    cpu::gelu_forward(out.data(), x.data(), n);
    cpu::gelu_backward(dx.data(), x.data(), dy.data(), n);
    // A float exp (2 ulp) and a few roundings: relative 1e-6, absolute 1e-7 where gelu is ~0.
    EXPECT_TRUE(all_close(out, want, 1e-7, 1e-6)) << "n=" << n;
    EXPECT_TRUE(all_close(dx, want_dx, 1e-6, 1e-5)) << "n=" << n;
  }
}

TEST(Gelu, ForwardInPlace) {
  const int64_t n = 1001;
  auto x = random_vec(n, 4, -4.f, 4.f);
  std::vector<float> out(static_cast<size_t>(n));
  cpu::gelu_forward(out.data(), x.data(), n);
  cpu::gelu_forward(x.data(), x.data(), n);  // out aliases inp
  EXPECT_EQ(out, x);
}

TEST(Gelu, BackwardInPlaceOverDout) {
  const int64_t n = 1001;
  auto x = random_vec(n, 5, -4.f, 4.f), dy = random_vec(n, 6);
  std::vector<float> dx(static_cast<size_t>(n));
  cpu::gelu_backward(dx.data(), x.data(), dy.data(), n);
  cpu::gelu_backward(dy.data(), x.data(), dy.data(), n);  // dinp aliases dout
  EXPECT_EQ(dx, dy);
}

TEST(Gelu, ExtremeInputsStayFinite) {
  std::vector<float> x = {-1e4f, -100.f, -20.f, -9.f, -1e-30f, 0.f, 1e-30f, 9.f, 20.f, 100.f, 1e4f};
  const int64_t n = int64_t(x.size());
  std::vector<float> out(x.size()), dx(x.size()), ones(x.size(), 1.f);
  cpu::gelu_forward(out.data(), x.data(), n);
  cpu::gelu_backward(dx.data(), x.data(), ones.data(), n);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_TRUE(std::isfinite(out[i]) && std::isfinite(dx[i])) << "x=" << x[i];
    EXPECT_NEAR(out[i], ref_gelu(x[i]), 1e-6 * std::fabs(x[i]) + 1e-30) << "x=" << x[i];
    EXPECT_NEAR(dx[i], ref_gelu_grad(x[i]), 1e-6) << "x=" << x[i];
  }
}

TEST(Gelu, GradientMatchesCentralDifferences) {
  // Central differences of the double reference (h = 1e-5) against the kernel's float gradient.
  const int64_t n = 64;
  auto x = random_vec(n, 7, -5.f, 5.f);
  std::vector<float> ones(size_t(n), 1.f), dx(static_cast<size_t>(n));
  cpu::gelu_backward(dx.data(), x.data(), ones.data(), n);
  const double h = 1e-5;
  for (int64_t i = 0; i < n; ++i) {
    const double fd = (ref_gelu(double(x[size_t(i)]) + h) - ref_gelu(double(x[size_t(i)]) - h)) / (2 * h);
    EXPECT_NEAR(dx[size_t(i)], fd, 2e-6) << "x=" << x[size_t(i)];
  }
}

TEST(Gelu, ResultsIndependentOfThreadCount) {
  const int64_t n = 50001;
  auto x = random_vec(n, 8, -5.f, 5.f), dy = random_vec(n, 9);
  auto run = [&](int threads) {
    ScopedThreads st(threads);
    std::vector<float> out(static_cast<size_t>(n)), dx(static_cast<size_t>(n));
    cpu::gelu_forward(out.data(), x.data(), n);
    cpu::gelu_backward(dx.data(), x.data(), dy.data(), n);
    return std::make_pair(out, dx);
  };
  EXPECT_EQ(run(1), run(2));
}

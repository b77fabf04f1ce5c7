#include "kernels/cpu/crossentropy.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/kernel_test_util.h"

using namespace loom;
using loom::test::all_close;
using loom::test::random_vec;
using loom::test::ScopedThreads;

namespace {

// Logits f32 [N, Vp] with NaN in the padding columns, which the kernel must never read.
std::vector<float> make_logits(int64_t N, int64_t V, int64_t Vp, uint64_t seed, float lo, float hi) {
  auto x = random_vec(N * Vp, seed, lo, hi);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = V; c < Vp; ++c) x[size_t(n * Vp + c)] = std::numeric_limits<float>::quiet_NaN();
  return x;
}

std::vector<int32_t> make_targets(int64_t N, int64_t V, uint64_t seed, bool with_ignored) {
  auto u = random_vec(N, seed, 0.f, 1.f);
  std::vector<int32_t> t(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) t[size_t(n)] = std::min<int32_t>(int32_t(u[size_t(n)] * float(V)), int32_t(V - 1));
  if (with_ignored)
    for (int64_t n = 3; n < N; n += 7) t[size_t(n)] = -1;
  if (N > 1) t[1] = int32_t(V - 1);
  return t;
}

struct Ref {
  std::vector<double> losses, dlogits;  // [N], [N, Vp]
};

// Softmax cross-entropy in double over the first V columns.
Ref ref_ce(const std::vector<float>& x, const std::vector<int32_t>& t, double dloss, int64_t N, int64_t V,
           int64_t Vp) {
  Ref r{std::vector<double>(size_t(N), 0.0), std::vector<double>(size_t(N * Vp), 0.0)};
  for (int64_t n = 0; n < N; ++n) {
    if (t[size_t(n)] < 0) continue;
    double m = -INFINITY;
    for (int64_t c = 0; c < V; ++c) m = std::max(m, double(x[size_t(n * Vp + c)]));
    double s = 0;
    for (int64_t c = 0; c < V; ++c) s += std::exp(double(x[size_t(n * Vp + c)]) - m);
    r.losses[size_t(n)] = std::log(s) + m - double(x[size_t(n * Vp + t[size_t(n)])]);
    for (int64_t c = 0; c < V; ++c)
      r.dlogits[size_t(n * Vp + c)] =
          dloss * (std::exp(double(x[size_t(n * Vp + c)]) - m) / s - (c == t[size_t(n)] ? 1.0 : 0.0));
  }
  return r;
}

// The model test asks for loss relative error <= 1e-5 against PyTorch; the kernel holds 1e-6.
constexpr double kLossRtol = 1e-6, kLossAtol = 1e-6;

}  // namespace

struct CeCase {
  int64_t N, V, Vp;
  float lo, hi;
};

class CrossEntropyTest : public ::testing::TestWithParam<CeCase> {};

TEST_P(CrossEntropyTest, MatchesDoubleReference) {
  const auto [N, V, Vp, lo, hi] = GetParam();
  auto x = make_logits(N, V, Vp, 1, lo, hi);
  auto t = make_targets(N, V, 2, true);
  int64_t counted = 0;
  for (int32_t v : t) counted += v >= 0;
  const float dloss = 1.f / float(counted);
  Ref r = ref_ce(x, t, dloss, N, V, Vp);

  std::vector<float> losses(size_t(N), 7.f);
  cpu::crossentropy_forward(losses.data(), x.data(), t.data(), N, V, Vp);
  EXPECT_TRUE(all_close(losses, r.losses, kLossAtol, kLossRtol));

  std::vector<float> losses2(size_t(N), 7.f), dlogits(size_t(N * Vp), 7.f);
  cpu::crossentropy_forward_backward(losses2.data(), dlogits.data(), x.data(), t.data(), dloss, N, V, Vp);
  EXPECT_EQ(losses, losses2);
  // Gradients scaled by 1/dloss are probabilities (minus one at the target): errors of a few
  // float roundings, absolute 1e-7 on values <= 1.
  std::vector<float> scaled(dlogits.size());
  std::vector<double> want(dlogits.size());
  for (size_t i = 0; i < dlogits.size(); ++i) {
    scaled[i] = dlogits[i] / dloss;
    want[i] = r.dlogits[i] / dloss;
  }
  EXPECT_TRUE(all_close(scaled, want, 1e-7, 1e-5));
  // Padding and ignored rows get exactly zero.
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = (t[size_t(n)] < 0 ? 0 : V); c < Vp; ++c) ASSERT_EQ(dlogits[size_t(n * Vp + c)], 0.f) << n << "," << c;

  // In place: dlogits overwrites logits and gives the same values.
  auto inplace = x;
  std::vector<float> losses3(static_cast<size_t>(N));
  cpu::crossentropy_forward_backward(losses3.data(), inplace.data(), inplace.data(), t.data(), dloss, N, V, Vp);
  EXPECT_EQ(losses3, losses);
  EXPECT_EQ(inplace, dlogits);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CrossEntropyTest,
                         ::testing::Values(CeCase{37, 1000, 1024, -4.f, 4.f},  // V=1000 padded to 1024
                                           CeCase{9, 50257, 50304, -8.f, 8.f},  // GPT-2: several chunks
                                           CeCase{5, 3, 128, -2.f, 2.f},        // tiny vocabulary
                                           CeCase{11, 333, 333, -60.f, 60.f})); // no padding, peaked rows

TEST(CrossEntropy, OnlineMaxGrowingAcrossChunks) {
  // Logits increase along the row, so the running max grows in every chunk and the running sum is
  // rescaled many times; large magnitudes check the stability of the shift.
  const int64_t N = 3, V = 9000, Vp = 9088;
  std::vector<float> x(size_t(N * Vp), std::numeric_limits<float>::quiet_NaN());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < V; ++c) x[size_t(n * Vp + c)] = float(c) * 0.01f + 1000.f * float(n) - 500.f;
  std::vector<int32_t> t = {0, 4500, int32_t(V - 1)};
  Ref r = ref_ce(x, t, 1.0, N, V, Vp);
  std::vector<float> losses(static_cast<size_t>(N)), d(size_t(N * Vp));
  cpu::crossentropy_forward_backward(losses.data(), d.data(), x.data(), t.data(), 1.f, N, V, Vp);
  EXPECT_TRUE(all_close(losses, r.losses, kLossAtol, kLossRtol));
  EXPECT_TRUE(all_close(d, r.dlogits, 1e-7, 1e-5));
}

TEST(CrossEntropy, GradientMatchesCentralDifferences) {
  // Central differences of the double reference loss sum (h = 1e-5) against the kernel.
  const int64_t N = 4, V = 50, Vp = 128;
  auto x = make_logits(N, V, Vp, 3, -3.f, 3.f);
  auto t = make_targets(N, V, 4, false);
  std::vector<float> losses(static_cast<size_t>(N)), d(size_t(N * Vp));
  const float dloss = 0.25f;
  cpu::crossentropy_forward_backward(losses.data(), d.data(), x.data(), t.data(), dloss, N, V, Vp);
  std::vector<double> xd(x.begin(), x.end());
  auto loss = [&] {
    double total = 0;
    for (int64_t n = 0; n < N; ++n) {
      double m = -INFINITY, s = 0;
      for (int64_t c = 0; c < V; ++c) m = std::max(m, xd[size_t(n * Vp + c)]);
      for (int64_t c = 0; c < V; ++c) s += std::exp(xd[size_t(n * Vp + c)] - m);
      total += std::log(s) + m - xd[size_t(n * Vp + t[size_t(n)])];
    }
    return double(dloss) * total;
  };
  const double h = 1e-5;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < V; c += 3) {
      const size_t i = size_t(n * Vp + c);
      const double x0 = xd[i];
      xd[i] = x0 + h;
      const double lp = loss();
      xd[i] = x0 - h;
      const double lm = loss();
      xd[i] = x0;
      EXPECT_NEAR(d[i], (lp - lm) / (2 * h), 1e-7) << n << "," << c;
    }
  // The target column too.
  for (int64_t n = 0; n < N; ++n) {
    const size_t i = size_t(n * Vp + t[size_t(n)]);
    const double x0 = xd[i];
    xd[i] = x0 + h;
    const double lp = loss();
    xd[i] = x0 - h;
    const double lm = loss();
    xd[i] = x0;
    EXPECT_NEAR(d[i], (lp - lm) / (2 * h), 1e-7) << "target of row " << n;
  }
}

TEST(CrossEntropy, ResultsIndependentOfThreadCount) {
  const int64_t N = 41, V = 1000, Vp = 1024;
  auto x = make_logits(N, V, Vp, 5, -5.f, 5.f);
  auto t = make_targets(N, V, 6, true);
  auto run = [&](int threads) {
    ScopedThreads st(threads);
    std::vector<float> losses(static_cast<size_t>(N)), d(size_t(N * Vp));
    cpu::crossentropy_forward_backward(losses.data(), d.data(), x.data(), t.data(), 0.1f, N, V, Vp);
    return std::make_pair(losses, d);
  };
  EXPECT_EQ(run(1), run(2));
}

TEST(CrossEntropy, BadTargetsAndSizesThrow) {
  const int64_t N = 4, V = 10, Vp = 128;
  auto x = make_logits(N, V, Vp, 7, -1.f, 1.f);
  std::vector<float> losses(static_cast<size_t>(N)), d(size_t(N * Vp));
  std::vector<int32_t> t = {0, 1, int32_t(V), 2};
  EXPECT_THROW(cpu::crossentropy_forward(losses.data(), x.data(), t.data(), N, V, Vp), Error);
  EXPECT_THROW(cpu::crossentropy_forward_backward(losses.data(), d.data(), x.data(), t.data(), 1.f, N, V, Vp), Error);
  t = {0, -2, 1, 2};
  EXPECT_THROW(cpu::crossentropy_forward(losses.data(), x.data(), t.data(), N, V, Vp), Error);
  t = {0, 1, 1, 2};
  EXPECT_THROW(cpu::crossentropy_forward(losses.data(), x.data(), t.data(), N, V, 8), Error);  // Vp < V
}

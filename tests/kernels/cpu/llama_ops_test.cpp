// The Llama family's element-wise kernels (RMSNorm, rotary embeddings, SwiGLU) against references
// in double written from the definitions, their gradients against central differences of those
// references, and independence of the thread count.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <vector>

#include "core/backend.h"
#include "core/error.h"
#include "kernels/cpu/kernel_test_util.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/swiglu.h"

using namespace loom;
using loom::test::all_close;
using loom::test::random_vec;
using loom::test::ScopedThreads;
using loom::test::to_double;

namespace {

constexpr double kEps = 1e-5;

// ---------------------------------------------------------------- RMSNorm

std::vector<double> ref_rmsnorm(const std::vector<double>& x, const std::vector<double>& w, int64_t N, int64_t C) {
  std::vector<double> y(x.size());
  for (int64_t n = 0; n < N; ++n) {
    double q = 0;
    for (int64_t c = 0; c < C; ++c) q += x[size_t(n * C + c)] * x[size_t(n * C + c)];
    const double r = 1.0 / std::sqrt(q / double(C) + kEps);
    for (int64_t c = 0; c < C; ++c) y[size_t(n * C + c)] = x[size_t(n * C + c)] * r * w[size_t(c)];
  }
  return y;
}

// sum(ref(x) * dy), for central differences.
double rms_objective(const std::vector<double>& x, const std::vector<double>& w, const std::vector<double>& dy,
                     int64_t N, int64_t C) {
  const std::vector<double> y = ref_rmsnorm(x, w, N, C);
  double s = 0;
  for (size_t i = 0; i < y.size(); ++i) s += y[i] * dy[i];
  return s;
}

struct Size {
  int64_t N, C;
};
class RmsNormTest : public ::testing::TestWithParam<Size> {};

TEST_P(RmsNormTest, ForwardAndBackwardMatchDoubleReference) {
  const int64_t N = GetParam().N, C = GetParam().C;
  auto x = random_vec(N * C, 11, -2.f, 3.f), w = random_vec(C, 12, 0.5f, 1.5f), dy = random_vec(N * C, 13);
  std::vector<float> out(size_t(N * C)), rstd(static_cast<size_t>(N));
  cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, float(kEps));
  const auto xd = to_double(x), wd = to_double(w), dyd = to_double(dy);
  EXPECT_TRUE(all_close(out.data(), ref_rmsnorm(xd, wd, N, C).data(), N * C, 2e-6, 1e-6));

  // Gradients by central differences of the double reference (step 1e-6 in double: truncation
  // error ~1e-12, far below the f32 kernel's ~1e-6).
  std::vector<double> want_dx(size_t(N * C)), want_dw(static_cast<size_t>(C));
  const double h = 1e-6;
  for (size_t i = 0; i < xd.size(); ++i) {
    auto xp = xd, xm = xd;
    xp[i] += h, xm[i] -= h;
    want_dx[i] = (rms_objective(xp, wd, dyd, N, C) - rms_objective(xm, wd, dyd, N, C)) / (2 * h);
  }
  for (int64_t c = 0; c < C; ++c) {
    auto wp = wd, wm = wd;
    wp[size_t(c)] += h, wm[size_t(c)] -= h;
    want_dw[size_t(c)] = (rms_objective(xd, wp, dyd, N, C) - rms_objective(xd, wm, dyd, N, C)) / (2 * h);
  }
  std::vector<float> dx(size_t(N * C)), dw(static_cast<size_t>(C), 0.f);
  cpu::rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
  EXPECT_TRUE(all_close(dx.data(), want_dx.data(), N * C, 1e-5, 1e-5));
  EXPECT_TRUE(all_close(dw.data(), want_dw.data(), C, 1e-5, 1e-5));

  // Accumulating: dinp += and dweight += what is already there.
  auto dx_acc = random_vec(N * C, 14), dw_acc = random_vec(C, 15);
  std::vector<double> want_dx_acc(size_t(N * C)), want_dw_acc(static_cast<size_t>(C));
  for (size_t i = 0; i < want_dx_acc.size(); ++i) want_dx_acc[i] = want_dx[i] + dx_acc[i];
  for (int64_t c = 0; c < C; ++c) want_dw_acc[size_t(c)] = want_dw[size_t(c)] + dw_acc[size_t(c)];
  cpu::rmsnorm_backward(dx_acc.data(), dw_acc.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C,
                        /*accumulate_dinp=*/true);
  EXPECT_TRUE(all_close(dx_acc.data(), want_dx_acc.data(), N * C, 1e-5, 1e-5));
  EXPECT_TRUE(all_close(dw_acc.data(), want_dw_acc.data(), C, 1e-5, 1e-5));
}

INSTANTIATE_TEST_SUITE_P(Sizes, RmsNormTest, ::testing::Values(Size{7, 67}, Size{3, 256}, Size{13, 3}, Size{1, 129}));

TEST(RmsNorm, ResultsIndependentOfThreadCount) {
  const int64_t N = 61, C = 200;
  auto x = random_vec(N * C, 21), w = random_vec(C, 22), dy = random_vec(N * C, 23);
  auto run = [&](int threads) {
    ScopedThreads st(threads);
    std::vector<float> out(size_t(N * C)), rstd(static_cast<size_t>(N)), dx(size_t(N * C)), dw(static_cast<size_t>(C), 0.f);
    cpu::rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C);
    cpu::rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
    out.insert(out.end(), dx.begin(), dx.end());
    out.insert(out.end(), dw.begin(), dw.end());
    return out;
  };
  EXPECT_EQ(run(1), run(2));
  EXPECT_EQ(run(1), run(3));
}

// ---------------------------------------------------------------- rotary embeddings

// HF's rotate_half form in double: y = x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1).
std::vector<double> ref_rope(const std::vector<double>& x, int64_t B, int64_t T, int64_t NH, int64_t HS,
                             int64_t stride, const std::vector<double>& inv_freq, const std::vector<int64_t>& pos) {
  std::vector<double> y = x;
  const int64_t half = HS / 2;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < NH; ++h)
        for (int64_t d = 0; d < HS; ++d) {
          const int64_t i = d % half;
          const double a = double(pos[size_t(t)]) * inv_freq[size_t(i)];
          const size_t at = size_t((b * T + t) * stride + h * HS);
          const double rot = d < half ? -x[at + size_t(d + half)] : x[at + size_t(d - half)];
          y[at + size_t(d)] = x[at + size_t(d)] * std::cos(a) + rot * std::sin(a);
        }
  return y;
}

TEST(Rope, InverseFrequenciesAreTheDefinitionAndLlama3Scaling) {
  const int64_t HS = 64;
  const std::vector<double> f = rope_inv_freq(HS, 10000.0);
  ASSERT_EQ(f.size(), 32u);
  for (int64_t i = 0; i < 32; ++i) EXPECT_DOUBLE_EQ(f[size_t(i)], 1.0 / std::pow(10000.0, double(2 * i) / double(HS)));
  // Llama 3.1's published scaling (factor 8, low 1, high 4, original 8192), each band by hand.
  RopeScaling s{8.0, 1.0, 4.0, 8192};
  const std::vector<double> g = rope_inv_freq(HS, 500000.0, s);
  int kept = 0, slowed = 0, blended = 0;
  for (int64_t i = 0; i < 32; ++i) {
    const double base = 1.0 / std::pow(500000.0, double(2 * i) / double(HS));
    const double wavelen = 2 * std::numbers::pi / base;
    if (wavelen < 8192.0 / 4) {
      EXPECT_DOUBLE_EQ(g[size_t(i)], base) << i;
      ++kept;
    } else if (wavelen > 8192.0) {
      EXPECT_DOUBLE_EQ(g[size_t(i)], base / 8) << i;
      ++slowed;
    } else {
      const double smooth = (8192.0 / wavelen - 1) / (4 - 1);
      EXPECT_NEAR(g[size_t(i)], (1 - smooth) * base / 8 + smooth * base, 1e-15) << i;
      ++blended;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(slowed, 0);
  EXPECT_GT(blended, 0);
  EXPECT_THROW(rope_inv_freq(63, 10000.0), Error);
}

TEST(Rope, RotatesTheHeadsOfAStridedBufferAndTheInverseUndoesIt) {
  // Q and K as columns of a packed [B, T, 3 C] buffer: only the rotated columns change.
  const int64_t B = 2, T = 9, NH = 3, HS = 8, C = NH * HS, stride = 3 * C;
  const std::vector<double> inv = rope_inv_freq(HS, 10000.0);
  auto buf = random_vec(B * T * stride, 31);
  for (const bool with_positions : {false, true}) {
    std::vector<int32_t> positions(static_cast<size_t>(T));
    std::vector<int64_t> pos(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      positions[size_t(t)] = int32_t(with_positions ? 100 - 7 * t : 5 + t);  // any order
      pos[size_t(t)] = positions[size_t(t)];
    }
    auto x = buf;
    cpu::rope_apply(x.data() + C, B, T, NH, HS, stride, inv.data(), 5, with_positions ? positions.data() : nullptr,
                    false);
    std::vector<double> want = to_double(buf);
    {
      std::vector<double> k(want.begin() + C, want.end());
      k = ref_rope(k, B, T, NH, HS, stride, inv, pos);  // the K columns, offset by C
      std::copy(k.begin(), k.end(), want.begin() + C);
    }
    EXPECT_TRUE(all_close(x.data(), want.data(), int64_t(x.size()), 1e-6, 1e-6)) << with_positions;
    cpu::rope_apply(x.data() + C, B, T, NH, HS, stride, inv.data(), 5, with_positions ? positions.data() : nullptr,
                    true);
    EXPECT_TRUE(all_close(x.data(), to_double(buf).data(), int64_t(x.size()), 1e-6, 1e-6)) << with_positions;
  }
}

TEST(Rope, BackwardIsTheGradientOfTheForward) {
  // d/dx sum(rope(x) * dy) = rope^T(dy) = the inverse rotation of dy.
  const int64_t B = 1, T = 5, NH = 2, HS = 6, stride = NH * HS;
  const std::vector<double> inv = rope_inv_freq(HS, 10000.0);
  const std::vector<double> x = to_double(random_vec(B * T * stride, 41));
  const std::vector<float> dy = random_vec(B * T * stride, 42);
  std::vector<int64_t> pos{3, 4, 5, 6, 7};
  auto objective = [&](const std::vector<double>& xx) {
    const std::vector<double> y = ref_rope(xx, B, T, NH, HS, stride, inv, pos);
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += y[i] * dy[i];
    return s;
  };
  std::vector<double> want(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    auto xp = x, xm = x;
    xp[i] += 1e-6, xm[i] -= 1e-6;
    want[i] = (objective(xp) - objective(xm)) / 2e-6;
  }
  auto dx = dy;
  cpu::rope_apply(dx.data(), B, T, NH, HS, stride, inv.data(), 3, nullptr, /*inverse=*/true);
  EXPECT_TRUE(all_close(dx.data(), want.data(), int64_t(dx.size()), 1e-6, 1e-6));
}

// ---------------------------------------------------------------- SwiGLU

double silu(double a) { return a / (1 + std::exp(-a)); }

TEST(SwiGlu, ForwardAndBackwardMatchDoubleReference) {
  const int64_t N = 9, H = 37;
  // Gates far into both tails too, where a careless sigmoid overflows.
  auto inp = random_vec(N * 2 * H, 51, -6.f, 6.f);
  inp[0] = 90.f, inp[1] = -90.f;
  auto dy = random_vec(N * H, 52);
  std::vector<float> out(size_t(N * H));
  cpu::swiglu_forward(out.data(), inp.data(), N, H);
  const auto x = to_double(inp);
  std::vector<double> want(size_t(N * H));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < H; ++j) want[size_t(n * H + j)] = silu(x[size_t(n * 2 * H + j)]) * x[size_t(n * 2 * H + H + j)];
  EXPECT_TRUE(all_close(out.data(), want.data(), N * H, 1e-6, 1e-6));

  // Each output depends on one gate and one up value: central differences per input element.
  std::vector<double> want_d(x.size());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < H; ++j) {
      const double g = x[size_t(n * 2 * H + j)], u = x[size_t(n * 2 * H + H + j)], d = dy[size_t(n * H + j)];
      const double h = 1e-6;
      want_d[size_t(n * 2 * H + j)] = d * u * (silu(g + h) - silu(g - h)) / (2 * h);
      want_d[size_t(n * 2 * H + H + j)] = d * silu(g);
    }
  std::vector<float> dinp(x.size());
  cpu::swiglu_backward(dinp.data(), dy.data(), inp.data(), N, H);
  EXPECT_TRUE(all_close(dinp.data(), want_d.data(), int64_t(dinp.size()), 1e-6, 1e-5));
  // In place over the input.
  auto alias = inp;
  cpu::swiglu_backward(alias.data(), dy.data(), alias.data(), N, H);
  EXPECT_EQ(alias, dinp);
}

}  // namespace

// LayerNorm (+ fused residual add) against double on the same bf16 inputs. Tolerances: bf16
// outputs 5e-3; f32 statistics and parameter gradients 1e-4.
#include <gtest/gtest.h>

#include <cmath>

#include "cuda_test_util.h"
#include "kernels/cuda/layernorm.cuh"

using namespace loom;
using namespace loom::test;

namespace {

struct LnRef {
  std::vector<double> out, mean, rstd;
};

LnRef ln_ref(const std::vector<float>& x, const std::vector<float>& w, const std::vector<float>& b, int64_t N, int64_t C) {
  LnRef r{std::vector<double>(size_t(N * C)), std::vector<double>(size_t(N)), std::vector<double>(size_t(N))};
  for (int64_t i = 0; i < N; ++i) {
    double m = 0, v = 0;
    for (int64_t c = 0; c < C; ++c) m += x[size_t(i * C + c)];
    m /= double(C);
    for (int64_t c = 0; c < C; ++c) v += (x[size_t(i * C + c)] - m) * (x[size_t(i * C + c)] - m);
    const double rs = 1.0 / std::sqrt(v / double(C) + 1e-5);
    r.mean[size_t(i)] = m;
    r.rstd[size_t(i)] = rs;
    for (int64_t c = 0; c < C; ++c) r.out[size_t(i * C + c)] = (x[size_t(i * C + c)] - m) * rs * w[size_t(c)] + b[size_t(c)];
  }
  return r;
}

class LayerNormTest : public ::testing::TestWithParam<std::pair<int64_t, int64_t>> {};

TEST_P(LayerNormTest, ForwardAndResidual) {
  LOOM_REQUIRE_GPU();
  const auto [N, C] = GetParam();
  auto a = random_bf16_values(size_t(N * C), 1, 1.f, 0.3f);
  auto a2 = random_bf16_values(size_t(N * C), 2, 0.5f);
  auto w = random_bf16_values(size_t(C), 3, 0.2f, 1.f);
  auto b = random_bf16_values(size_t(C), 4, 0.2f);
  DeviceBuffer<dbf16> da(a.size()), da2(a.size()), dw(w.size()), db(b.size()), dout(a.size()), dres(a.size());
  DeviceBuffer<float> dmean{size_t(N)}, drstd(static_cast<size_t>(N));
  upload_bf16(da, a);
  upload_bf16(da2, a2);
  upload_bf16(dw, w);
  upload_bf16(db, b);
  dout.poison();
  dmean.poison();
  drstd.poison();
  cuda::layernorm_forward(dout.get(), dmean.get(), drstd.get(), da.get(), dw.get(), db.get(), N, C, nullptr);
  LnRef r = ln_ref(a, w, b, N, C);
  const double e_out = rel_err(download_bf16(dout), r.out), e_mean = rel_err(dmean.download(), r.mean),
               e_rstd = rel_err(drstd.download(), r.rstd);
  EXPECT_LE(e_out, 5e-3);
  EXPECT_LE(e_mean, 1e-4);
  EXPECT_LE(e_rstd, 1e-4);

  // Fused: residual = bf16(a + a2) exactly as rounding on the host; out = LN(residual).
  std::vector<float> sum(a.size());
  for (size_t i = 0; i < a.size(); ++i) sum[i] = round_bf16(a[i] + a2[i]);
  dout.poison();
  dres.poison();
  cuda::residual_layernorm_forward(dres.get(), dout.get(), dmean.get(), drstd.get(), da.get(), da2.get(), dw.get(),
                                   db.get(), N, C, nullptr);
  auto res = download_bf16(dres);
  int64_t mismatches = 0;
  for (size_t i = 0; i < sum.size(); ++i) mismatches += res[i] != sum[i];
  EXPECT_EQ(mismatches, 0) << "residual must be the bf16-rounded sum";
  LnRef r2 = ln_ref(sum, w, b, N, C);
  const double e_fused = rel_err(download_bf16(dout), r2.out);
  EXPECT_LE(e_fused, 5e-3);
  // In place: residual aliases a.
  cuda::residual_layernorm_forward(da.get(), dout.get(), dmean.get(), drstd.get(), da.get(), da2.get(), dw.get(),
                                   db.get(), N, C, nullptr);
  auto res2 = download_bf16(da);
  mismatches = 0;
  for (size_t i = 0; i < sum.size(); ++i) mismatches += res2[i] != sum[i];
  EXPECT_EQ(mismatches, 0) << "in place";
  std::printf("layernorm N=%ld C=%ld: out %.2e mean %.2e rstd %.2e fused %.2e\n", long(N), long(C), e_out, e_mean,
              e_rstd, e_fused);
}

TEST_P(LayerNormTest, Backward) {
  LOOM_REQUIRE_GPU();
  const auto [N, C] = GetParam();
  auto x = random_bf16_values(size_t(N * C), 5, 1.f, 0.2f);
  auto w = random_bf16_values(size_t(C), 6, 0.2f, 1.f);
  auto b = random_bf16_values(size_t(C), 7, 0.2f);
  auto dy = random_bf16_values(size_t(N * C), 8);
  auto dx0 = random_bf16_values(size_t(N * C), 9);
  auto dw0 = random_f32(size_t(C), 10), db0 = random_f32(size_t(C), 11);
  LnRef r = ln_ref(x, w, b, N, C);
  std::vector<float> mean(static_cast<size_t>(N)), rstd(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) {
    mean[size_t(i)] = float(r.mean[size_t(i)]);
    rstd[size_t(i)] = float(r.rstd[size_t(i)]);
  }
  std::vector<double> ref_dx(size_t(N * C)), ref_dw(dw0.begin(), dw0.end()), ref_db(db0.begin(), db0.end());
  for (int64_t i = 0; i < N; ++i) {
    double s1 = 0, s2 = 0;
    for (int64_t c = 0; c < C; ++c) {
      const double xh = (x[size_t(i * C + c)] - r.mean[size_t(i)]) * r.rstd[size_t(i)];
      const double dn = double(dy[size_t(i * C + c)]) * w[size_t(c)];
      s1 += dn;
      s2 += dn * xh;
      ref_dw[size_t(c)] += double(dy[size_t(i * C + c)]) * xh;
      ref_db[size_t(c)] += dy[size_t(i * C + c)];
    }
    s1 /= double(C);
    s2 /= double(C);
    for (int64_t c = 0; c < C; ++c) {
      const double xh = (x[size_t(i * C + c)] - r.mean[size_t(i)]) * r.rstd[size_t(i)];
      ref_dx[size_t(i * C + c)] = (double(dy[size_t(i * C + c)]) * w[size_t(c)] - s1 - xh * s2) * r.rstd[size_t(i)];
    }
  }
  DeviceBuffer<dbf16> dx(x.size()), dw(w.size()), ddy(dy.size()), ddx(x.size());
  DeviceBuffer<float> dmean{size_t(N)}, drstd{size_t(N)}, ddw{size_t(C)}, ddb{size_t(C)},
      scratch(size_t(cuda::layernorm_backward_scratch_floats(C)));
  upload_bf16(dx, x);
  upload_bf16(dw, w);
  upload_bf16(ddy, dy);
  dmean.upload(mean);
  drstd.upload(rstd);
  ddw.upload(dw0);
  ddb.upload(db0);
  ddx.poison();
  scratch.poison();
  cuda::layernorm_backward(ddx.get(), ddw.get(), ddb.get(), ddy.get(), dx.get(), dw.get(), dmean.get(), drstd.get(), N, C,
                           false, scratch.get(), nullptr);
  const double e_dx = rel_err(download_bf16(ddx), ref_dx), e_dw = rel_err(ddw.download(), ref_dw),
               e_db = rel_err(ddb.download(), ref_db);
  EXPECT_LE(e_dx, 5e-3);
  EXPECT_LE(e_dw, 1e-4);
  EXPECT_LE(e_db, 1e-4);
  // accumulate: dx = dx0 + LN backward
  upload_bf16(ddx, dx0);
  cuda::layernorm_backward(ddx.get(), nullptr, nullptr, ddy.get(), dx.get(), dw.get(), dmean.get(), drstd.get(), N, C, true,
                           scratch.get(), nullptr);
  std::vector<double> ref_acc(ref_dx.size());
  for (size_t i = 0; i < ref_acc.size(); ++i) ref_acc[i] = ref_dx[i] + dx0[i];
  const double e_acc = rel_err(download_bf16(ddx), ref_acc);
  EXPECT_LE(e_acc, 5e-3);
  std::printf("layernorm bwd N=%ld C=%ld: dx %.2e dw %.2e db %.2e dx+= %.2e\n", long(N), long(C), e_dx, e_dw, e_db, e_acc);
}

INSTANTIATE_TEST_SUITE_P(Shapes, LayerNormTest,
                         ::testing::Values(std::make_pair(int64_t(1), int64_t(8)), std::make_pair(int64_t(37), int64_t(64)),
                                           std::make_pair(int64_t(1000), int64_t(768)),
                                           std::make_pair(int64_t(4099), int64_t(1600))));

TEST(LayerNorm, RejectsBadWidth) {
  LOOM_REQUIRE_GPU();
  DeviceBuffer<dbf16> x(64);
  DeviceBuffer<float> m(8);
  EXPECT_THROW(cuda::layernorm_forward(x.get(), m.get(), m.get(), x.get(), x.get(), x.get(), 4, 12, nullptr), Error);
}

}  // namespace

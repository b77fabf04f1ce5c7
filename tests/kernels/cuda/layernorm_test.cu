// LayerNorm (+ fused residual add) against the CPU op (kernels/cpu/layernorm.h: f32 with double
// statistics, on the same bf16-rounded inputs) and against double. Outputs are NaN-poisoned
// before each call, so an unwritten element fails. Tolerances (||out - ref|| / ||ref||): bf16
// outputs 5e-3 (one bf16 rounding, about 2e-3 relative, on top of f32 arithmetic); f32
// statistics and parameter gradients 1e-4 (f32 sums of a few thousand terms in another order).
#include <gtest/gtest.h>

#include <cmath>

#include "cuda_test_util.h"
#include "kernels/cuda/layernorm.cuh"
#include "kernels/cpu/layernorm.h"

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
  // The CPU op on the same inputs.
  std::vector<float> c_out(a.size()), c_mean(static_cast<size_t>(N)), c_rstd(static_cast<size_t>(N));
  cpu::layernorm_forward(c_out.data(), c_mean.data(), c_rstd.data(), a.data(), w.data(), b.data(), N, C);
  const double ce_out = rel_err(download_bf16(dout), c_out), ce_mean = rel_err(dmean.download(), c_mean),
               ce_rstd = rel_err(drstd.download(), c_rstd);
  EXPECT_LE(ce_out, 5e-3);
  EXPECT_LE(ce_mean, 1e-4);
  EXPECT_LE(ce_rstd, 1e-4);

  // Fused: residual = bf16(a + a2) exactly as rounding on the host; out = LN(residual).
  std::vector<float> sum(a.size());
  for (size_t i = 0; i < a.size(); ++i) sum[i] = round_bf16(a[i] + a2[i]);
  dout.poison();
  dres.poison();
  dmean.poison();
  drstd.poison();
  cuda::residual_layernorm_forward(dres.get(), dout.get(), dmean.get(), drstd.get(), da.get(), da2.get(), dw.get(),
                                   db.get(), N, C, nullptr);
  auto res = download_bf16(dres);
  int64_t mismatches = 0;
  for (size_t i = 0; i < sum.size(); ++i) mismatches += res[i] != sum[i];
  EXPECT_EQ(mismatches, 0) << "residual must be the bf16-rounded sum";
  LnRef r2 = ln_ref(sum, w, b, N, C);
  const double e_fused = rel_err(download_bf16(dout), r2.out);
  EXPECT_LE(e_fused, 5e-3);
  // Its statistics (the backward uses them) and output against the CPU op on the summed residual.
  std::vector<float> c2_out(a.size()), c2_mean(static_cast<size_t>(N)), c2_rstd(static_cast<size_t>(N));
  cpu::layernorm_forward(c2_out.data(), c2_mean.data(), c2_rstd.data(), sum.data(), w.data(), b.data(), N, C);
  const double ce_fused = rel_err(download_bf16(dout), c2_out), ce_fmean = rel_err(dmean.download(), c2_mean),
               ce_frstd = rel_err(drstd.download(), c2_rstd);
  EXPECT_LE(ce_fused, 5e-3);
  EXPECT_LE(ce_fmean, 1e-4);
  EXPECT_LE(ce_frstd, 1e-4);
  EXPECT_LE(rel_err(dmean.download(), r2.mean), 1e-4);
  EXPECT_LE(rel_err(drstd.download(), r2.rstd), 1e-4);
  // In place: residual aliases a.
  dout.poison();
  dmean.poison();
  drstd.poison();
  cuda::residual_layernorm_forward(da.get(), dout.get(), dmean.get(), drstd.get(), da.get(), da2.get(), dw.get(),
                                   db.get(), N, C, nullptr);
  auto res2 = download_bf16(da);
  mismatches = 0;
  for (size_t i = 0; i < sum.size(); ++i) mismatches += res2[i] != sum[i];
  EXPECT_EQ(mismatches, 0) << "in place";
  EXPECT_LE(rel_err(download_bf16(dout), c2_out), 5e-3) << "in place";
  EXPECT_LE(rel_err(dmean.download(), c2_mean), 1e-4) << "in place";
  EXPECT_LE(rel_err(drstd.download(), c2_rstd), 1e-4) << "in place";
  std::printf("layernorm N=%ld C=%ld: out %.2e mean %.2e rstd %.2e fused %.2e | against the CPU op: out %.2e mean "
              "%.2e rstd %.2e, fused out %.2e mean %.2e rstd %.2e\n",
              long(N), long(C), e_out, e_mean, e_rstd, e_fused, ce_out, ce_mean, ce_rstd, ce_fused, ce_fmean, ce_frstd);
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
  const auto got_dx = download_bf16(ddx), got_dw = ddw.download(), got_db = ddb.download();
  const double e_dx = rel_err(got_dx, ref_dx), e_dw = rel_err(got_dw, ref_dw), e_db = rel_err(got_db, ref_db);
  EXPECT_LE(e_dx, 5e-3);
  EXPECT_LE(e_dw, 1e-4);
  EXPECT_LE(e_db, 1e-4);
  // The CPU op on the same inputs and statistics, accumulating onto the same parameter gradients.
  std::vector<float> c_dx(x.size()), c_dw = dw0, c_db = db0;
  cpu::layernorm_backward(c_dx.data(), c_dw.data(), c_db.data(), dy.data(), x.data(), w.data(), mean.data(),
                          rstd.data(), N, C);
  const double ce_dx = rel_err(got_dx, c_dx), ce_dw = rel_err(got_dw, c_dw), ce_db = rel_err(got_db, c_db);
  EXPECT_LE(ce_dx, 5e-3);
  EXPECT_LE(ce_dw, 1e-4);
  EXPECT_LE(ce_db, 1e-4);
  // accumulate: dx = dx0 + LN backward
  upload_bf16(ddx, dx0);
  cuda::layernorm_backward(ddx.get(), nullptr, nullptr, ddy.get(), dx.get(), dw.get(), dmean.get(), drstd.get(), N, C, true,
                           scratch.get(), nullptr);
  std::vector<double> ref_acc(ref_dx.size());
  for (size_t i = 0; i < ref_acc.size(); ++i) ref_acc[i] = ref_dx[i] + dx0[i];
  const auto got_acc = download_bf16(ddx);
  const double e_acc = rel_err(got_acc, ref_acc);
  EXPECT_LE(e_acc, 5e-3);
  std::vector<float> c_acc = dx0;
  cpu::layernorm_backward(c_acc.data(), nullptr, nullptr, dy.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C,
                          true);
  const double ce_acc = rel_err(got_acc, c_acc);
  EXPECT_LE(ce_acc, 5e-3);
  std::printf("layernorm bwd N=%ld C=%ld: dx %.2e dw %.2e db %.2e dx+= %.2e | against the CPU op: %.2e %.2e %.2e "
              "%.2e\n",
              long(N), long(C), e_dx, e_dw, e_db, e_acc, ce_dx, ce_dw, ce_db, ce_acc);
}

INSTANTIATE_TEST_SUITE_P(Shapes, LayerNormTest,
                         // Widths of every forward kernel: rows held in registers in 1 (8, 64), 2 (264: a
                         // part-filled second chunk), 3 (576: SmolLM's, part-filled; 768) and 4 (1024) chunks
                         // of 256 columns, and wider rows read three times (1600).
                         ::testing::Values(std::make_pair(int64_t(1), int64_t(8)), std::make_pair(int64_t(37), int64_t(64)),
                                           std::make_pair(int64_t(129), int64_t(264)),
                                           std::make_pair(int64_t(333), int64_t(576)),
                                           std::make_pair(int64_t(1000), int64_t(768)),
                                           std::make_pair(int64_t(64), int64_t(1024)),
                                           std::make_pair(int64_t(4099), int64_t(1600))));

TEST(LayerNorm, RejectsBadWidth) {
  LOOM_REQUIRE_GPU();
  DeviceBuffer<dbf16> x(64);
  DeviceBuffer<float> m(8);
  EXPECT_THROW(cuda::layernorm_forward(x.get(), m.get(), m.get(), x.get(), x.get(), x.get(), 4, 12, nullptr), Error);
}

}  // namespace

// GEMM-based causal attention against the CPU op (kernels/cpu/attention.h, f32 on the same bf16
// inputs) and a double reference; outputs NaN-poisoned first. Tolerances (||x - ref|| / ||ref||):
// output 1e-2 and gradients 1e-2 (the probabilities and the score gradients pass through bf16
// once each before the second GEMM); the saved probabilities 5e-3 (one bf16 rounding, about 2e-3
// relative), exactly zero above the diagonal.
#include <gtest/gtest.h>

#include <array>
#include <cmath>

#include "cuda_test_util.h"
#include "kernels/cuda/allocator.cuh"
#include "kernels/cuda/attn_gemm.cuh"
#include "kernels/cpu/attention.h"

using namespace loom;
using namespace loom::test;

namespace {

struct Ref {
  std::vector<double> out, dqkv, att;  // att [B, NH, T, T]: the probabilities, zero above the diagonal
};

Ref attention_ref(const std::vector<float>& qkv, const std::vector<float>& dout, int64_t B, int64_t T, int64_t NH,
                  int64_t HS) {
  const int64_t C = NH * HS;
  Ref r{std::vector<double>(size_t(B * T * C), 0.0), std::vector<double>(size_t(B * T * 3 * C), 0.0),
        std::vector<double>(size_t(B * NH * T * T), 0.0)};
  const double scale = 1.0 / std::sqrt(double(HS));
  auto at = [&](int64_t b, int64_t t, int64_t which, int64_t h, int64_t d) {
    return double(qkv[size_t((b * T + t) * 3 * C + which * C + h * HS + d)]);
  };
  std::vector<double> p(static_cast<size_t>(T)), dp(static_cast<size_t>(T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t t = 0; t < T; ++t) {
        double m = -INFINITY;
        for (int64_t j = 0; j <= t; ++j) {
          double s = 0;
          for (int64_t d = 0; d < HS; ++d) s += at(b, t, 0, h, d) * at(b, j, 1, h, d);
          p[size_t(j)] = s * scale;
          m = std::max(m, p[size_t(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= t; ++j) sum += (p[size_t(j)] = std::exp(p[size_t(j)] - m));
        for (int64_t j = 0; j <= t; ++j) {
          p[size_t(j)] /= sum;
          r.att[size_t(((b * NH + h) * T + t) * T + j)] = p[size_t(j)];
        }
        for (int64_t d = 0; d < HS; ++d) {
          double o = 0;
          for (int64_t j = 0; j <= t; ++j) o += p[size_t(j)] * at(b, j, 2, h, d);
          r.out[size_t((b * T + t) * C + h * HS + d)] = o;
        }
        // backward of this row
        double dot = 0;
        for (int64_t j = 0; j <= t; ++j) {
          double s = 0;
          for (int64_t d = 0; d < HS; ++d) s += double(dout[size_t((b * T + t) * C + h * HS + d)]) * at(b, j, 2, h, d);
          dp[size_t(j)] = s;
          dot += s * p[size_t(j)];
        }
        for (int64_t j = 0; j <= t; ++j) {
          const double ds = p[size_t(j)] * (dp[size_t(j)] - dot) * scale;
          for (int64_t d = 0; d < HS; ++d) {
            r.dqkv[size_t((b * T + t) * 3 * C + h * HS + d)] += ds * at(b, j, 1, h, d);
            r.dqkv[size_t((b * T + j) * 3 * C + C + h * HS + d)] += ds * at(b, t, 0, h, d);
            r.dqkv[size_t((b * T + j) * 3 * C + 2 * C + h * HS + d)] +=
                p[size_t(j)] * double(dout[size_t((b * T + t) * C + h * HS + d)]);
          }
        }
      }
  return r;
}

}  // namespace

TEST(AttnGemm, ForwardBackward) {
  LOOM_REQUIRE_GPU();
  for (auto [B, T, NH, HS] : {std::array<int64_t, 4>{2, 64, 4, 16}, std::array<int64_t, 4>{1, 200, 2, 64}}) {
    const int64_t C = NH * HS;
    auto qkv = random_bf16_values(size_t(B * T * 3 * C), uint32_t(T), 1.f);
    auto dout = random_bf16_values(size_t(B * T * C), uint32_t(T + 1));
    const Ref r = attention_ref(qkv, dout, B, T, NH, HS);
    cuda::AttnGemmShape s{B, T, NH, HS};
    DeviceBuffer<dbf16> dqkv_in(qkv.size()), ddout(dout.size()), out(size_t(B * T * C)), att(size_t(B * NH * T * T)),
        dqkv(qkv.size());
    DeviceBuffer<char> ws(cuda::attn_gemm_workspace_bytes(s));
    upload_bf16(dqkv_in, qkv);
    upload_bf16(ddout, dout);
    out.poison();
    att.poison();
    dqkv.poison();
    ws.poison();
    cuda::attn_gemm_forward(test_blas(), out.get(), att.get(), dqkv_in.get(), s, ws.get(), nullptr);
    const auto got_out = download_bf16(out), got_att = download_bf16(att);
    const double eo = rel_err(got_out, r.out), ea = rel_err(got_att, r.att);
    int64_t above = 0;
    for (int64_t bh = 0; bh < B * NH; ++bh)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = t + 1; j < T; ++j) above += got_att[size_t((bh * T + t) * T + j)] != 0.f;
    EXPECT_EQ(above, 0) << "probabilities above the diagonal must be zero";
    cuda::attn_gemm_backward(test_blas(), dqkv.get(), att.get(), ddout.get(), dqkv_in.get(), s, ws.get(), nullptr);
    const auto got_dqkv = download_bf16(dqkv);
    const double eg = rel_err(got_dqkv, r.dqkv);
    EXPECT_LE(eo, 1e-2);
    EXPECT_LE(ea, 5e-3);
    EXPECT_LE(eg, 1e-2);
    // The CPU op on the same packed inputs.
    cpu::AttnArgs a;
    a.B = B;
    a.NH = NH;
    a.HS = HS;
    a.Tq = a.Tkv = T;
    a.q_stride = a.kv_stride = 3 * C;
    a.o_stride = C;
    a.causal = true;
    std::vector<float> c_out(size_t(B * T * C)), c_lse(size_t(B * NH * T)), c_dqkv(qkv.size());
    const float* q = qkv.data();
    cpu::attention_forward(c_out.data(), c_lse.data(), q, q + C, q + 2 * C, a);
    cpu::attention_backward(c_dqkv.data(), c_dqkv.data() + C, c_dqkv.data() + 2 * C, dout.data(), q, q + C, q + 2 * C,
                            c_out.data(), c_lse.data(), a);
    const double co = rel_err(got_out, c_out), cg = rel_err(got_dqkv, c_dqkv);
    EXPECT_LE(co, 1e-2);
    EXPECT_LE(cg, 1e-2);
    std::printf("attn_gemm B=%ld T=%ld NH=%ld HS=%ld: out %.2e probabilities %.2e dqkv %.2e | against the CPU op: "
                "out %.2e dqkv %.2e\n",
                long(B), long(T), long(NH), long(HS), eo, ea, eg, co, cg);
  }
}

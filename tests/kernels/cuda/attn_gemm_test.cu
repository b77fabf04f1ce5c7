// GEMM-based causal attention against a double reference on the same bf16 inputs. Tolerances:
// output 1e-2 and gradients 1e-2 in norm (the probabilities and the score gradients pass through
// bf16 once each before the second GEMM).
#include <gtest/gtest.h>

#include <array>
#include <cmath>

#include "cuda_test_util.h"
#include "kernels/cuda/allocator.cuh"
#include "kernels/cuda/attn_gemm.cuh"

using namespace loom;
using namespace loom::test;

namespace {

struct Ref {
  std::vector<double> out, dqkv;
};

Ref attention_ref(const std::vector<float>& qkv, const std::vector<float>& dout, int64_t B, int64_t T, int64_t NH,
                  int64_t HS) {
  const int64_t C = NH * HS;
  Ref r{std::vector<double>(size_t(B * T * C), 0.0), std::vector<double>(size_t(B * T * 3 * C), 0.0)};
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
        for (int64_t j = 0; j <= t; ++j) p[size_t(j)] /= sum;
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
    cuda::attn_gemm_forward(out.get(), att.get(), dqkv_in.get(), s, ws.get(), nullptr);
    const double eo = rel_err(download_bf16(out), r.out);
    cuda::attn_gemm_backward(dqkv.get(), att.get(), ddout.get(), dqkv_in.get(), s, ws.get(), nullptr);
    const double eg = rel_err(download_bf16(dqkv), r.dqkv);
    EXPECT_LE(eo, 1e-2);
    EXPECT_LE(eg, 1e-2);
    std::printf("attn_gemm B=%ld T=%ld NH=%ld HS=%ld: out %.2e dqkv %.2e\n", long(B), long(T), long(NH), long(HS), eo,
                eg);
  }
}

// cuBLASLt matmul against the CPU op (kernels/cpu/matmul.h, gelu.h: f32 on the same bf16-rounded
// inputs) and against a double-precision reference. Tolerances (||out - ref|| / ||ref||, the
// outputs NaN-poisoned first so an unwritten element fails): bf16 outputs 5e-3 (one bf16 rounding
// of each output is about 2e-3 relative), f32 outputs 1e-4 (f32 accumulation of exact bf16
// products, in another order than the CPU's).
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "cuda_test_util.h"
#include "kernels/cuda/allocator.cuh"
#include "kernels/cuda/matmul.cuh"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/matmul.h"

using namespace loom;
using namespace loom::test;

namespace {

constexpr double kTolBf16 = 5e-3;
constexpr double kTolF32 = 1e-4;

double gelu_ref(double x) { return 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))); }
double gelu_grad_ref(double x) {
  const double u = std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x), t = std::tanh(u);
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * std::sqrt(2 / M_PI) * (1 + 3 * 0.044715 * x * x);
}

// out[M, N] = inp[M, K] W[N, K]^T + bias (double)
std::vector<double> linear_ref(const std::vector<float>& inp, const std::vector<float>& w, const std::vector<float>* bias,
                               int64_t M, int64_t K, int64_t N) {
  std::vector<double> out(size_t(M * N));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = bias ? (*bias)[size_t(j)] : 0.0;
      for (int64_t k = 0; k < K; ++k) s += double(inp[size_t(i * K + k)]) * w[size_t(j * K + k)];
      out[size_t(i * N + j)] = s;
    }
  return out;
}

struct Shape3 {
  int64_t M, K, N;
};

class MatmulTest : public ::testing::TestWithParam<Shape3> {};

TEST_P(MatmulTest, ForwardBiasAndGelu) {
  LOOM_REQUIRE_GPU();
  const auto [M, K, N] = GetParam();
  auto inp = random_bf16_values(size_t(M * K), 1);
  auto w = random_bf16_values(size_t(N * K), 2, 0.1f);
  auto b = random_bf16_values(size_t(N), 3, 0.5f);
  DeviceBuffer<dbf16> d_inp(inp.size()), d_w(w.size()), d_b(b.size()), d_out(size_t(M * N)), d_pre(size_t(M * N));
  upload_bf16(d_inp, inp);
  upload_bf16(d_w, w);
  upload_bf16(d_b, b);
  const auto ref = linear_ref(inp, w, &b, M, K, N);

  d_out.poison();
  cuda::matmul_forward(test_blas(), {d_out.get(), nullptr, d_inp.get(), d_w.get(), d_b.get(), M, K, N, false}, nullptr);
  const double e_bias = rel_err(download_bf16(d_out), ref);
  EXPECT_LE(e_bias, kTolBf16);

  d_out.poison();
  cuda::matmul_forward(test_blas(), {d_out.get(), nullptr, d_inp.get(), d_w.get(), nullptr, M, K, N, false}, nullptr);
  const auto ref_nb = linear_ref(inp, w, nullptr, M, K, N);
  const double e_nobias = rel_err(download_bf16(d_out), ref_nb);
  EXPECT_LE(e_nobias, kTolBf16);

  d_out.poison();
  d_pre.poison();
  cuda::matmul_forward(test_blas(), {d_out.get(), d_pre.get(), d_inp.get(), d_w.get(), d_b.get(), M, K, N, true}, nullptr);
  std::vector<double> ref_gelu(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) ref_gelu[i] = gelu_ref(ref[i]);
  const auto got_pre = download_bf16(d_pre), got_gelu = download_bf16(d_out);
  const double e_pre = rel_err(got_pre, ref);
  const double e_gelu = rel_err(got_gelu, ref_gelu);
  EXPECT_LE(e_pre, kTolBf16);
  EXPECT_LE(e_gelu, kTolBf16);

  // The CPU op on the same inputs: linear with and without bias, then GELU.
  std::vector<float> cpu_out(size_t(M * N)), cpu_nb(size_t(M * N)), cpu_gelu(size_t(M * N));
  cpu::matmul_forward(cpu_out.data(), inp.data(), w.data(), b.data(), M, K, N);
  cpu::matmul_forward(cpu_nb.data(), inp.data(), w.data(), nullptr, M, K, N);
  cpu::gelu_forward(cpu_gelu.data(), cpu_out.data(), M * N);
  d_out.poison();
  cuda::matmul_forward(test_blas(), {d_out.get(), nullptr, d_inp.get(), d_w.get(), d_b.get(), M, K, N, false}, nullptr);
  const double c_bias = rel_err(download_bf16(d_out), cpu_out);
  d_out.poison();
  cuda::matmul_forward(test_blas(), {d_out.get(), nullptr, d_inp.get(), d_w.get(), nullptr, M, K, N, false}, nullptr);
  const double c_nobias = rel_err(download_bf16(d_out), cpu_nb);
  const double c_pre = rel_err(got_pre, cpu_out), c_gelu = rel_err(got_gelu, cpu_gelu);
  EXPECT_LE(c_bias, kTolBf16);
  EXPECT_LE(c_nobias, kTolBf16);
  EXPECT_LE(c_pre, kTolBf16);
  EXPECT_LE(c_gelu, kTolBf16);
  // The GELU epilogue without a bias.
  d_out.poison();
  d_pre.poison();
  cuda::matmul_forward(test_blas(), {d_out.get(), d_pre.get(), d_inp.get(), d_w.get(), nullptr, M, K, N, true}, nullptr);
  std::vector<float> cpu_gelu_nb(size_t(M * N));
  cpu::gelu_forward(cpu_gelu_nb.data(), cpu_nb.data(), M * N);
  const double c_gelu_nb = rel_err(download_bf16(d_out), cpu_gelu_nb), c_pre_nb = rel_err(download_bf16(d_pre), cpu_nb);
  EXPECT_LE(c_gelu_nb, kTolBf16);
  EXPECT_LE(c_pre_nb, kTolBf16);
  std::printf("matmul fwd M=%ld K=%ld N=%ld: bias %.2e nobias %.2e pre_gelu %.2e gelu %.2e | against the CPU op: "
              "%.2e %.2e %.2e %.2e, gelu without bias %.2e (pre %.2e)\n",
              long(M), long(K), long(N), e_bias, e_nobias, e_pre, e_gelu, c_bias, c_nobias, c_pre, c_gelu, c_gelu_nb,
              c_pre_nb);
}

TEST_P(MatmulTest, Backward) {
  LOOM_REQUIRE_GPU();
  const auto [M, K, N] = GetParam();
  auto inp = random_bf16_values(size_t(M * K), 11);
  auto w = random_bf16_values(size_t(N * K), 12, 0.1f);
  auto dout = random_bf16_values(size_t(M * N), 13);
  auto pre = random_bf16_values(size_t(M * K), 14);  // a GELU input that produced inp
  auto dw0 = random_f32(size_t(N * K), 15);           // existing gradients: the op accumulates
  auto db0 = random_f32(size_t(N), 16);
  DeviceBuffer<dbf16> d_inp(inp.size()), d_w(w.size()), d_dout(dout.size()), d_pre(pre.size()), d_dinp(inp.size());
  DeviceBuffer<float> d_dw(dw0.size()), d_db(db0.size()), scratch(size_t(cuda::matmul_dbias_scratch_floats(N)));
  upload_bf16(d_inp, inp);
  upload_bf16(d_w, w);
  upload_bf16(d_dout, dout);
  upload_bf16(d_pre, pre);
  d_dw.upload(dw0);
  d_db.upload(db0);
  d_dinp.poison();
  scratch.poison();

  cuda::MatmulBwdArgs a;
  a.dinp = d_dinp.get();
  a.dweight = d_dw.get();
  a.dbias = d_db.get();
  a.dout = d_dout.get();
  a.inp = d_inp.get();
  a.weight = d_w.get();
  a.M = M;
  a.K = K;
  a.N = N;
  a.dbias_scratch = scratch.get();
  cuda::matmul_backward(test_blas(), a, nullptr);

  std::vector<double> ref_dinp(size_t(M * K), 0.0), ref_dw(dw0.begin(), dw0.end()), ref_db(db0.begin(), db0.end());
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      const double g = dout[size_t(i * N + j)];
      ref_db[size_t(j)] += g;
      for (int64_t k = 0; k < K; ++k) {
        ref_dinp[size_t(i * K + k)] += g * w[size_t(j * K + k)];
        ref_dw[size_t(j * K + k)] += g * inp[size_t(i * K + k)];
      }
    }
  const auto got_dinp = download_bf16(d_dinp), got_dw = d_dw.download(), got_db = d_db.download();
  const double e_dinp = rel_err(got_dinp, ref_dinp);
  const double e_dw = rel_err(got_dw, ref_dw);
  const double e_db = rel_err(got_db, ref_db);
  EXPECT_LE(e_dinp, kTolBf16);
  EXPECT_LE(e_dw, kTolF32);
  EXPECT_LE(e_db, kTolF32);
  // The CPU op on the same inputs, accumulating onto the same existing gradients.
  std::vector<float> cpu_dinp(size_t(M * K)), cpu_dw = dw0, cpu_db = db0;
  cpu::matmul_backward(cpu_dinp.data(), cpu_dw.data(), cpu_db.data(), dout.data(), inp.data(), w.data(), M, K, N);
  const double c_dinp = rel_err(got_dinp, cpu_dinp), c_dw = rel_err(got_dw, cpu_dw), c_db = rel_err(got_db, cpu_db);
  EXPECT_LE(c_dinp, kTolBf16);
  EXPECT_LE(c_dw, kTolF32);
  EXPECT_LE(c_db, kTolF32);

  // Both ways of computing the weight and bias gradients together (matmul_backward times them and
  // keeps the faster, so the call above took either): the GEMM's epilogue, and a plain GEMM with
  // bias_grad after it; each accumulating onto dw0 and db0.
  // The epilogue runs where a cuBLASLt algorithm takes it; at N = 768 (GPT-2's width, where the
  // H100 ran it for every weight gradient of the model) it must have, not fallen back.
  struct TunedAgain {
    ~TunedAgain() { test_blas().set_bias_grad_path(cuda::BiasGradPath::tuned); }
  } restore;
  for (auto path : {cuda::BiasGradPath::epilogue, cuda::BiasGradPath::separate}) {
    test_blas().set_bias_grad_path(path);
    d_dw.upload(dw0);
    d_db.upload(db0);
    scratch.poison();
    cuda::MatmulBwdArgs wb = a;
    wb.dinp = nullptr;
    const int64_t epilogue_runs = test_blas().bias_grad_epilogue_runs();
    cuda::matmul_backward(test_blas(), wb, nullptr);
    const int64_t ran_epilogue = test_blas().bias_grad_epilogue_runs() - epilogue_runs;
    if (path == cuda::BiasGradPath::separate) EXPECT_EQ(ran_epilogue, 0);
    if (path == cuda::BiasGradPath::epilogue && N == 768) EXPECT_EQ(ran_epilogue, 1);
    EXPECT_LE(rel_err(d_dw.download(), cpu_dw), kTolF32) << "bias gradient path " << int(path);
    EXPECT_LE(rel_err(d_db.download(), cpu_db), kTolF32) << "bias gradient path " << int(path);
  }

  // The bias gradient alone (no weight gradient, so not from the GEMM's epilogue: the bias_grad
  // kernel), and bias_grad called directly; both accumulate onto db0.
  d_db.upload(db0);
  scratch.poison();
  cuda::MatmulBwdArgs bo;
  bo.dbias = d_db.get();
  bo.dout = d_dout.get();
  bo.M = M;
  bo.K = K;
  bo.N = N;
  bo.dbias_scratch = scratch.get();
  cuda::matmul_backward(test_blas(), bo, nullptr);
  const double c_db_alone = rel_err(d_db.download(), cpu_db);
  EXPECT_LE(c_db_alone, kTolF32);
  d_db.upload(db0);
  scratch.poison();
  cuda::bias_grad(d_db.get(), d_dout.get(), M, N, scratch.get(), nullptr);
  const double c_bias_grad = rel_err(d_db.download(), cpu_db);
  EXPECT_LE(c_bias_grad, kTolF32);

  // DGELU epilogue: dinp = (dout @ W) * gelu'(pre)
  d_dinp.poison();
  cuda::MatmulBwdArgs g;
  g.dinp = d_dinp.get();
  g.dout = d_dout.get();
  g.weight = d_w.get();
  g.dinp_gelu_pre = d_pre.get();
  g.M = M;
  g.K = K;
  g.N = N;
  cuda::matmul_backward(test_blas(), g, nullptr);
  std::vector<double> ref_dg(ref_dinp.size());
  for (size_t i = 0; i < ref_dg.size(); ++i) ref_dg[i] = ref_dinp[i] * gelu_grad_ref(pre[i]);
  const auto got_dg = download_bf16(d_dinp);
  const double e_dgelu = rel_err(got_dg, ref_dg);
  EXPECT_LE(e_dgelu, kTolBf16);
  std::vector<float> cpu_dg(cpu_dinp.size());
  cpu::gelu_backward(cpu_dg.data(), pre.data(), cpu_dinp.data(), M * K);
  const double c_dgelu = rel_err(got_dg, cpu_dg);
  EXPECT_LE(c_dgelu, kTolBf16);
  std::printf("matmul bwd M=%ld K=%ld N=%ld: dinp %.2e dweight %.2e dbias %.2e dinp*dgelu %.2e | against the CPU op: "
              "%.2e %.2e %.2e %.2e, dbias alone %.2e, bias_grad %.2e\n",
              long(M), long(K), long(N), e_dinp, e_dw, e_db, e_dgelu, c_dinp, c_dw, c_db, c_dgelu, c_db_alone,
              c_bias_grad);
}

INSTANTIATE_TEST_SUITE_P(Shapes, MatmulTest,
                         ::testing::Values(Shape3{64, 64, 64}, Shape3{333, 192, 520}, Shape3{1000, 256, 768},
                                           Shape3{77, 768, 2304}));

TEST(Matmul, GemmBf16AllTransposes) {
  LOOM_REQUIRE_GPU();
  const int64_t M = 96, N = 80, K = 136;
  auto A = random_bf16_values(size_t(M * K), 21), B = random_bf16_values(size_t(K * N), 22);
  DeviceBuffer<dbf16> dA(A.size()), dB(B.size());
  upload_bf16(dA, A);
  upload_bf16(dB, B);
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      // Interpret the same buffers as [M, K] or [K, M] (and [K, N] or [N, K]).
      auto a_at = [&](int64_t i, int64_t k) { return double(ta ? A[size_t(k * M + i)] : A[size_t(i * K + k)]); };
      auto b_at = [&](int64_t k, int64_t j) { return double(tb ? B[size_t(j * K + k)] : B[size_t(k * N + j)]); };
      std::vector<double> ref(size_t(M * N));
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double s = 0;
          for (int64_t k = 0; k < K; ++k) s += a_at(i, k) * b_at(k, j);
          ref[size_t(i * N + j)] = 0.5 * s;
        }
      DeviceBuffer<float> dC(size_t(M * N));
      dC.poison();
      cuda::gemm(test_blas(), ta, tb, M, N, K, 0.5f, dA.get(), ta ? M : K, dB.get(), tb ? K : N, 0.f, dC.get(), N, true, nullptr);
      const auto got = dC.download();
      const double e = rel_err(got, ref);
      EXPECT_LE(e, kTolF32) << "trans_a=" << ta << " trans_b=" << tb;
      // The CPU op (cpu::gemm) on the same operands.
      std::vector<float> c(size_t(M * N));
      cpu::gemm(ta, tb, M, N, K, 0.5f, A.data(), ta ? M : K, B.data(), tb ? K : N, 0.f, c.data(), N);
      EXPECT_LE(rel_err(got, c), kTolF32) << "against the CPU op, trans_a=" << ta << " trans_b=" << tb;
      // bf16 output accumulating onto an existing C (beta = 1).
      auto C0 = random_bf16_values(size_t(M * N), uint32_t(23 + 2 * ta + tb));
      DeviceBuffer<dbf16> dCb(C0.size());
      upload_bf16(dCb, C0);
      cuda::gemm(test_blas(), ta, tb, M, N, K, 0.5f, dA.get(), ta ? M : K, dB.get(), tb ? K : N, 1.f, dCb.get(), N, false,
                      nullptr);
      std::vector<float> cb = C0;
      cpu::gemm(ta, tb, M, N, K, 0.5f, A.data(), ta ? M : K, B.data(), tb ? K : N, 1.f, cb.data(), N);
      EXPECT_LE(rel_err(download_bf16(dCb), cb), kTolBf16) << "bf16 output, beta 1, trans_a=" << ta << " trans_b=" << tb;
    }
}

TEST(Matmul, RejectsBadShapes) {
  LOOM_REQUIRE_GPU();
  DeviceBuffer<dbf16> x(64);
  EXPECT_THROW(cuda::matmul_forward(test_blas(), {x.get(), nullptr, x.get(), x.get(), nullptr, 4, 6, 8, false}, nullptr), Error);
  EXPECT_THROW(cuda::matmul_forward(test_blas(), {x.get(), nullptr, x.get(), x.get(), nullptr, 4, 8, 8, true}, nullptr), Error);
}

// The bf16 GEMM rate that MFU is reported against: arguments are checked before any device work;
// on a GPU the rate lies between 1 TFLOP/s and 5 PFLOP/s (above any GPU's dense bf16 datasheet
// figure) and the operands are given back to the pool.
TEST(Matmul, GemmPeakMeasurement) {
  MemoryPool host("host");
  try {
    cuda::Blas b(host);
    ADD_FAILURE() << "a BLAS state over a host pool was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a device pool"), std::string::npos) << e.what();
  }
  LOOM_REQUIRE_GPU();
  cuda::Blas& blas = test_blas();  // its cuBLASLt workspace stays allocated: take it before counting
  auto message = [&](int64_t n, double seconds) -> std::string {
    try {
      cuda::measure_gemm_peak(blas, nullptr, loom::DType::bf16, n, seconds);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(message(0, 0.1).find("n = 0"), std::string::npos) << message(0, 0.1);
  EXPECT_NE(message(256, 0.0).find("seconds = 0"), std::string::npos) << message(256, 0.0);
  MemoryPool& pool = blas.pool();
  const int64_t before = pool.current(MemTag::workspace);
  const double rate = cuda::measure_gemm_peak(blas, nullptr, loom::DType::bf16, 1024, 0.05);
  EXPECT_GT(rate, 1e12);
  EXPECT_LT(rate, 5e15);
  EXPECT_EQ(pool.current(MemTag::workspace), before);
}

}  // namespace

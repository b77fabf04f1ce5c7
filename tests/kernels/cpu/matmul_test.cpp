#include "kernels/cpu/matmul.h"

#include <dirent.h>
#include <gtest/gtest.h>

#include <cmath>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/memory.h"
#include "kernels/cpu/kernel_test_util.h"

using namespace loom;
using loom::test::all_close;
using loom::test::random_vec;
using loom::test::ScopedThreads;

namespace {

// C [M, N] = alpha op(A) op(B) + beta C in double, row-major with leading dimensions.
void ref_gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, double alpha, const std::vector<float>& A,
              int64_t lda, const std::vector<float>& B, int64_t ldb, double beta, std::vector<double>& C,
              int64_t ldc) {
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double a = ta ? A[size_t(k * lda + i)] : A[size_t(i * lda + k)];
        const double b = tb ? B[size_t(j * ldb + k)] : B[size_t(k * ldb + j)];
        s += a * b;
      }
      C[size_t(i * ldc + j)] = alpha * s + beta * C[size_t(i * ldc + j)];
    }
}

// Float sums of up to K products of values in [-1, 1]: errors grow like sqrt(K) * 6e-8.
constexpr double kAtol = 2e-5, kRtol = 1e-5;

struct Sizes {
  int64_t M, N, K;
};

}  // namespace

class GemmTest : public ::testing::TestWithParam<std::tuple<bool, bool, Sizes>> {};

TEST_P(GemmTest, MatchesDoubleReferenceWithStridesAlphaBeta) {
  const auto [ta, tb, s] = GetParam();
  const int64_t M = s.M, N = s.N, K = s.K;
  // Leading dimensions larger than the rows, so strides are honoured.
  const int64_t lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 5, ldc = N + 2;
  auto A = random_vec((ta ? K : M) * lda, 1);
  auto B = random_vec((tb ? N : K) * ldb, 2);
  auto C = random_vec(M * ldc, 3);
  std::vector<double> want(C.begin(), C.end());
  ref_gemm(ta, tb, M, N, K, 0.7, A, lda, B, ldb, 0.3, want, ldc);
  cpu::gemm(ta, tb, M, N, K, 0.7f, A.data(), lda, B.data(), ldb, 0.3f, C.data(), ldc);
  EXPECT_TRUE(all_close(C, want, kAtol, kRtol));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmTest,
    ::testing::Combine(::testing::Bool(), ::testing::Bool(),
                       ::testing::Values(Sizes{37, 129, 51}, Sizes{1, 67, 300}, Sizes{130, 1, 17},
                                         Sizes{64, 48, 1}, Sizes{97, 255, 383})));

TEST(Gemm, ZeroKScalesC) {
  std::vector<float> C = {1.f, 2.f, 3.f, 4.f};
  cpu::gemm(false, false, 2, 2, 0, 1.f, nullptr, 1, nullptr, 2, 0.5f, C.data(), 2);
  EXPECT_EQ(C, (std::vector<float>{0.5f, 1.f, 1.5f, 2.f}));
  cpu::gemm(false, false, 2, 2, 0, 1.f, nullptr, 1, nullptr, 2, 0.f, C.data(), 2);
  EXPECT_EQ(C, (std::vector<float>{0.f, 0.f, 0.f, 0.f}));
}

TEST(Gemm, BadLeadingDimensionThrows) {
  std::vector<float> A(12), B(12), C(16);
  EXPECT_THROW(cpu::gemm(false, false, 4, 4, 3, 1.f, A.data(), 2, B.data(), 4, 0.f, C.data(), 4), Error);
  EXPECT_THROW(cpu::gemm(false, false, 4, 4, 3, 1.f, A.data(), 3, B.data(), 4, 0.f, C.data(), 3), Error);
}

namespace {

// out [M, N] = inp [M, K] @ weight [N, K]^T + bias [N], in double.
std::vector<double> ref_linear(const std::vector<float>& inp, const std::vector<float>& w, const float* bias,
                               int64_t M, int64_t K, int64_t N) {
  std::vector<double> out(size_t(M * N));
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double s = bias ? double(bias[j]) : 0.0;
      for (int64_t k = 0; k < K; ++k) s += double(inp[size_t(i * K + k)]) * double(w[size_t(j * K + k)]);
      out[size_t(i * N + j)] = s;
    }
  return out;
}

}  // namespace

TEST(Matmul, ForwardWithAndWithoutBias) {
  const int64_t M = 37, K = 51, N = 129;
  auto inp = random_vec(M * K, 10), w = random_vec(N * K, 11), bias = random_vec(N, 12);
  std::vector<float> out(size_t(M * N), 123.f);  // stale contents must be overwritten
  cpu::matmul_forward(out.data(), inp.data(), w.data(), bias.data(), M, K, N);
  EXPECT_TRUE(all_close(out, ref_linear(inp, w, bias.data(), M, K, N), kAtol, kRtol));
  std::fill(out.begin(), out.end(), 123.f);
  cpu::matmul_forward(out.data(), inp.data(), w.data(), nullptr, M, K, N);
  EXPECT_TRUE(all_close(out, ref_linear(inp, w, nullptr, M, K, N), kAtol, kRtol));
}

TEST(Matmul, BackwardMatchesReferenceAndAccumulates) {
  const int64_t M = 37, K = 51, N = 129;
  auto inp = random_vec(M * K, 20), w = random_vec(N * K, 21), dout = random_vec(M * N, 22);
  auto dinp = random_vec(M * K, 23), dw = random_vec(N * K, 24), db = random_vec(N, 25);
  // Reference: dinp = dout @ w (or += old), dw += dout^T inp, db += column sums.
  std::vector<double> want_dinp(size_t(M * K)), want_dinp_acc(size_t(M * K));
  std::vector<double> want_dw(dw.begin(), dw.end()), want_db(db.begin(), db.end());
  for (int64_t i = 0; i < M; ++i)
    for (int64_t k = 0; k < K; ++k) {
      double s = 0.0;
      for (int64_t j = 0; j < N; ++j) s += double(dout[size_t(i * N + j)]) * w[size_t(j * K + k)];
      want_dinp[size_t(i * K + k)] = s;
      want_dinp_acc[size_t(i * K + k)] = s + dinp[size_t(i * K + k)];
    }
  for (int64_t j = 0; j < N; ++j) {
    for (int64_t k = 0; k < K; ++k) {
      double s = 0.0;
      for (int64_t i = 0; i < M; ++i) s += double(dout[size_t(i * N + j)]) * inp[size_t(i * K + k)];
      want_dw[size_t(j * K + k)] += s;
    }
    for (int64_t i = 0; i < M; ++i) want_db[size_t(j)] += dout[size_t(i * N + j)];
  }
  auto dinp_acc = dinp;
  cpu::matmul_backward(dinp_acc.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), M, K, N,
                       /*accumulate_dinp=*/true);
  EXPECT_TRUE(all_close(dinp_acc, want_dinp_acc, kAtol, kRtol));
  EXPECT_TRUE(all_close(dw, want_dw, kAtol, kRtol));
  EXPECT_TRUE(all_close(db, want_db, kAtol, kRtol));
  // Overwriting dinp, skipping the parameter gradients.
  cpu::matmul_backward(dinp.data(), nullptr, nullptr, dout.data(), inp.data(), w.data(), M, K, N);
  EXPECT_TRUE(all_close(dinp, want_dinp, kAtol, kRtol));
}

TEST(Matmul, BackwardMatchesCentralDifferences) {
  // loss = sum(out * g) with out = inp @ w^T + b; the gradients are checked against central
  // differences of the loss computed in double from the kernel's float outputs.
  const int64_t M = 5, K = 7, N = 9;
  ScopedThreads st(1);  // tiny GEMMs: a team only adds synchronisation
  auto inp = random_vec(M * K, 30), w = random_vec(N * K, 31), b = random_vec(N, 32), g = random_vec(M * N, 33);
  auto loss = [&] {
    std::vector<float> out(size_t(M * N));
    cpu::matmul_forward(out.data(), inp.data(), w.data(), b.data(), M, K, N);
    double s = 0.0;
    for (size_t i = 0; i < out.size(); ++i) s += double(out[i]) * g[i];
    return s;
  };
  std::vector<float> dinp(size_t(M * K)), dw(size_t(N * K), 0.f), db(size_t(N), 0.f);
  cpu::matmul_backward(dinp.data(), dw.data(), db.data(), g.data(), inp.data(), w.data(), M, K, N);
  const float h = 1e-2f;
  // FD error: float rounding of the loss (~1e-6) / 2h, about 1e-4.
  const double tol = 1e-3;
  auto check = [&](std::vector<float>& x, const std::vector<float>& grad, const char* name) {
    for (size_t i = 0; i < x.size(); i += 3) {
      const float x0 = x[i];
      x[i] = x0 + h;
      const double lp = loss();
      x[i] = x0 - h;
      const double lm = loss();
      x[i] = x0;
      EXPECT_NEAR(grad[i], (lp - lm) / (2.0 * h), tol) << name << "[" << i << "]";
    }
  };
  check(inp, dinp, "dinp");
  check(w, dw, "dweight");
  check(b, db, "dbias");
}

TEST(Matmul, SameResultsForOneAndTwoThreads) {
  const int64_t M = 96, K = 200, N = 333;
  auto inp = random_vec(M * K, 40), w = random_vec(N * K, 41), b = random_vec(N, 42), dout = random_vec(M * N, 43);
  auto run = [&](int threads) {
    ScopedThreads st(threads);
    std::vector<float> out(size_t(M * N)), dinp(size_t(M * K)), dw(size_t(N * K), 0.f), db(size_t(N), 0.f);
    cpu::matmul_forward(out.data(), inp.data(), w.data(), b.data(), M, K, N);
    cpu::matmul_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), M, K, N);
    return std::vector<std::vector<float>>{out, dinp, dw, db};
  };
  auto r1 = run(1), r2 = run(2);
  // The bias gradient has a fixed summation order: bitwise equal.
  EXPECT_EQ(r1[3], r2[3]);
  // oneDNN may split a GEMM's reduction differently for different team sizes; results agree to
  // float rounding.
  for (int t = 0; t < 3; ++t)
    EXPECT_TRUE(all_close(r1[size_t(t)], std::vector<double>(r2[size_t(t)].begin(), r2[size_t(t)].end()), 1e-5,
                          1e-5))
        << "tensor " << t;
  // Repeating a run with the same team size is bitwise reproducible.
  EXPECT_EQ(r2, run(2));
}

namespace {

int count_process_threads() {
  DIR* d = opendir("/proc/self/task");
  if (!d) return -1;
  int n = 0;
  while (dirent* e = readdir(d))
    if (e->d_name[0] != '.') ++n;
  closedir(d);
  return n;
}

}  // namespace

// Ranks run as threads, each limiting its own OpenMP team. Two std::threads that each set
// omp_set_num_threads(1) and call gemm concurrently must get correct results, must not make
// oneDNN start extra OpenMP workers (oversubscription), and must run at a sane speed.
TEST(Gemm, ConcurrentCallersWithOneThreadEach) {
  const int64_t n = 384;
  auto A = random_vec(n * n, 50), B = random_vec(n * n, 51);
  std::vector<float> want(size_t(n * n));
  {
    ScopedThreads st(1);
    cpu::gemm(false, true, n, n, n, 1.f, A.data(), n, B.data(), n, 0.f, want.data(), n);
  }
  constexpr int kReps = 8;
  auto timed_reps = [&](std::vector<float>& C) {
    auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < kReps; ++r) cpu::gemm(false, true, n, n, n, 1.f, A.data(), n, B.data(), n, 0.f, C.data(), n);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  double solo = 0.0;
  {
    ScopedThreads st(1);
    std::vector<float> C(size_t(n * n));
    solo = timed_reps(C);
  }
  const int threads_before = count_process_threads();
  std::atomic<int> arrived{0}, finished{0};
  std::atomic<bool> release{false};
  std::vector<float> C0(size_t(n * n)), C1(size_t(n * n));
  double secs[2] = {0, 0};
  int threads_during = 0;
  int team[2] = {0, 0};
  auto worker = [&](int id, std::vector<float>& C) {
    omp_set_num_threads(1);
    team[id] = omp_get_max_threads();
    // A rank calls gemm many times; measure the steady state, not this thread's first call.
    cpu::gemm(false, true, n, n, n, 1.f, A.data(), n, B.data(), n, 0.f, C.data(), n);
    ++arrived;
    while (arrived.load() < 2) std::this_thread::yield();
    secs[id] = timed_reps(C);
    ++finished;
    while (!release.load()) std::this_thread::yield();  // stay alive while threads are counted
  };
  std::thread t0(worker, 0, std::ref(C0)), t1(worker, 1, std::ref(C1));
  while (finished.load() < 2) std::this_thread::yield();
  threads_during = count_process_threads();
  release = true;
  t0.join();
  t1.join();
  EXPECT_EQ(team[0], 1);
  EXPECT_EQ(team[1], 1);
  EXPECT_EQ(C0, want);  // same single-threaded code path: bitwise equal
  EXPECT_EQ(C1, want);
  if (threads_before > 0) {
    EXPECT_EQ(threads_during, threads_before + 2) << "gemm started extra threads";
  }
  const double flops = 2.0 * double(n) * n * n * kReps;
  std::printf("gemm %ld^3, 1 thread alone: %.1f GFLOP/s; two callers at once: %.1f and %.1f GFLOP/s\n", long(n),
              flops / solo * 1e-9, flops / secs[0] * 1e-9, flops / secs[1] * 1e-9);
  // Two single-threaded callers on two cores should each run near the solo speed; allow a wide
  // margin for a loaded machine, but not the collapse that oversubscribed spinning teams show.
  EXPECT_LT(std::max(secs[0], secs[1]), 4.0 * solo + 0.05);
}

TEST(Matmul, MeasuredPeakIsPlausible) {
  const double g = cpu::measure_gemm_peak_gflops(256, 0.1);
  std::printf("measured gemm peak (n=256, %d threads): %.1f GFLOP/s\n", omp_get_max_threads(), g);
  // A rate, not a timing assertion: it only has to be a positive finite number (the machine may
  // be arbitrarily loaded while the test runs).
  EXPECT_TRUE(std::isfinite(g));
  EXPECT_GT(g, 0.0);
}

// bf16 matmuls (train.precision = bf16): inputs rounded to bf16, products summed in f32. Against
// double on the same bf16-rounded inputs: the products of two bf16 values are exact in f32, so
// what is left is f32 summation, as in the f32 GEMM (kAtol, kRtol). Odd sizes, the bias, and both
// accumulating outputs.
namespace {
std::vector<float> round_bf16(std::vector<float> v) {
  for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}
}  // namespace

TEST(Bf16Matmul, MatchesDoubleOnRoundedInputs) {
  const std::string missing = cpu_bf16_missing();
  if (!missing.empty()) {
    try {
      cpu::Bf16Matmul refused(default_cpu_pool());
      ADD_FAILURE() << "a bf16 matmul without bf16 dot products was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("AVX512-BF16"), std::string::npos) << e.what();
    }
    GTEST_SKIP() << "this CPU lacks " << missing;
  }
  MemoryPool pool("bf16-test");
  cpu::Bf16Matmul mm(pool);
  // 8328 output features: two blocks of 4096 and one of 136.
  for (const Sizes s : {Sizes{37, 53, 71}, Sizes{128, 96, 768}, Sizes{1, 8, 3}, Sizes{19, 8328, 24}}) {
    const int64_t M = s.M, N = s.N, K = s.K;
    SCOPED_TRACE(::testing::Message() << "M=" << M << " N=" << N << " K=" << K);
    const auto x = random_vec(M * K, 11), w = random_vec(N * K, 12), b = random_vec(N, 13), dy = random_vec(M * N, 14);
    const auto xr = round_bf16(x), wr = round_bf16(w), dyr = round_bf16(dy);
    // forward: out = x w^T + b
    std::vector<float> out(size_t(M * N), NAN);
    mm.forward(out.data(), x.data(), w.data(), b.data(), M, K, N);
    std::vector<double> want(size_t(M * N));
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) want[size_t(i * N + j)] = b[size_t(j)];
    ref_gemm(false, true, M, N, K, 1.0, xr, K, wr, K, 1.0, want, N);
    EXPECT_TRUE(all_close(out, want, kAtol, kRtol)) << "forward";
    // backward, accumulating onto dinp and dweight; dbias from the f32 dout
    auto dx = random_vec(M * K, 15), dw = random_vec(N * K, 16), db = random_vec(N, 17);
    std::vector<double> want_dx(dx.begin(), dx.end()), want_dw(dw.begin(), dw.end()), want_db(db.begin(), db.end());
    mm.backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), M, K, N, true);
    ref_gemm(false, false, M, K, N, 1.0, dyr, N, wr, K, 1.0, want_dx, K);
    ref_gemm(true, false, N, K, M, 1.0, dyr, N, xr, K, 1.0, want_dw, K);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) want_db[size_t(j)] += dy[size_t(i * N + j)];
    EXPECT_TRUE(all_close(dx, want_dx, kAtol, kRtol)) << "dinp (accumulated)";
    EXPECT_TRUE(all_close(dw, want_dw, kAtol, kRtol)) << "dweight";
    EXPECT_TRUE(all_close(db, want_db, kAtol, kRtol)) << "dbias";
    // dinp written, not accumulated
    std::vector<float> dx2(size_t(M * K), NAN);
    mm.backward(dx2.data(), nullptr, nullptr, dy.data(), x.data(), w.data(), M, K, N, false);
    std::vector<double> want_dx2(size_t(M * K), 0.0);
    ref_gemm(false, false, M, K, N, 1.0, dyr, N, wr, K, 0.0, want_dx2, K);
    EXPECT_TRUE(all_close(dx2, want_dx2, kAtol, kRtol)) << "dinp";
  }
  // Every byte it holds is the pool's (tag workspace).
  EXPECT_GT(pool.current(MemTag::workspace), 0);
  // A vocabulary head's copies hold a block of the weight and of the output gradient: less than
  // its whole weight in bf16 (GPT-2 124M's head at 1024 tokens).
  const int64_t V = 50304, C = 768, T = 1024;
  const int64_t declared = mm.workspace_bytes({LinearShape{T, C, V}});
  EXPECT_LT(declared, 2 * V * C) << declared;
  EXPECT_GE(declared, 2 * (T * C + 4096 * C + T * 4096)) << declared;
}

// fp32 GEMM throughput for the shapes of GPT-2 124M training at B*T = 1024 rows, in GFLOP/s:
// loom's gemm (oneDNN) against OpenBLAS (loaded at run time when present, so the binary does not
// depend on it) and against this CPU's FMA peak, measured with a register-only FMA loop.
//
//   bench_gemm                                 all shapes, 1 and 2 threads
//   OPENBLAS_CORETYPE=Haswell bench_gemm       force OpenBLAS's kernel choice (read when it loads)
//   bench_gemm --benchmark_filter=oneDNN       one library only
//
// Forms (Linear layout, weight [N, K]): fwd   out [M, N]  = inp [M, K] @ W^T      (gemm N,T)
//                                      dinp  dinp [M, K] = dout [M, N] @ W       (gemm N,N)
//                                      dw    dW [N, K]  += dout^T @ inp          (gemm T,N, beta 1)
#include <benchmark/benchmark.h>
#include <dlfcn.h>
#include <immintrin.h>
#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/rng.h"
#include "kernels/cpu/matmul.h"

namespace {

struct Shape {
  const char* name;
  int64_t M, K, N;  // inp [M, K] @ W [N, K]^T
};

// GPT-2 124M, C = 768, vocabulary padded to 50304, B*T = 1024.
const Shape kShapes[] = {
    {"qkv", 1024, 768, 2304},
    {"attn_proj", 1024, 768, 768},
    {"fc", 1024, 768, 3072},
    {"fc_proj", 1024, 3072, 768},
    {"lm_head", 1024, 768, 50304},
};

enum Form { kFwd, kDinp, kDw };
const char* kFormNames[] = {"fwd", "dinp", "dw"};

// OpenBLAS through dlopen, with its CBLAS enums.
using cblas_sgemm_t = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float,
                               float*, int);
struct OpenBlas {
  cblas_sgemm_t sgemm = nullptr;
  void (*set_num_threads)(int) = nullptr;
  char* (*get_corename)() = nullptr;
  bool ok() const { return sgemm && set_num_threads; }
};

OpenBlas& openblas() {
  static OpenBlas lib = [] {
    OpenBlas l;
    void* h = dlopen("libopenblas.so.0", RTLD_NOW | RTLD_LOCAL);
    if (!h) return l;
    l.sgemm = reinterpret_cast<cblas_sgemm_t>(dlsym(h, "cblas_sgemm"));
    l.set_num_threads = reinterpret_cast<void (*)(int)>(dlsym(h, "openblas_set_num_threads"));
    l.get_corename = reinterpret_cast<char* (*)()>(dlsym(h, "openblas_get_corename"));
    return l;
  }();
  return lib;
}

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

struct Operands {
  std::vector<float> inp, w, out;  // f32 [M, K], [N, K], [M, N]
  explicit Operands(const Shape& s)
      : inp(size_t(s.M * s.K)), w(size_t(s.N * s.K)), out(size_t(s.M * s.N)) {
    loom::fill_uniform(inp.data(), s.M * s.K, -1.f, 1.f, 1, 1, 0);
    loom::fill_uniform(w.data(), s.N * s.K, -0.05f, 0.05f, 1, 2, 0);
    loom::fill_uniform(out.data(), s.M * s.N, -1.f, 1.f, 1, 3, 0);
  }
};

// Runs one form of one shape; `blas` selects OpenBLAS instead of loom.
void run_form(const Shape& s, Form f, bool blas, Operands& o) {
  const int M = int(s.M), K = int(s.K), N = int(s.N);
  if (!blas) {
    switch (f) {
      case kFwd: loom::cpu::gemm(false, true, M, N, K, 1.f, o.inp.data(), K, o.w.data(), K, 0.f, o.out.data(), N); break;
      case kDinp: loom::cpu::gemm(false, false, M, K, N, 1.f, o.out.data(), N, o.w.data(), K, 0.f, o.inp.data(), K); break;
      case kDw: loom::cpu::gemm(true, false, N, K, M, 1.f, o.out.data(), N, o.inp.data(), K, 1.f, o.w.data(), K); break;
    }
    return;
  }
  auto* g = openblas().sgemm;
  switch (f) {
    case kFwd: g(kRowMajor, kNoTrans, kTrans, M, N, K, 1.f, o.inp.data(), K, o.w.data(), K, 0.f, o.out.data(), N); break;
    case kDinp: g(kRowMajor, kNoTrans, kNoTrans, M, K, N, 1.f, o.out.data(), N, o.w.data(), K, 0.f, o.inp.data(), K); break;
    case kDw: g(kRowMajor, kTrans, kNoTrans, N, K, M, 1.f, o.out.data(), N, o.inp.data(), K, 1.f, o.w.data(), K); break;
  }
}

void bm_gemm(benchmark::State& state, Shape s, Form f, bool blas, int threads) {
  if (blas) {
    openblas().set_num_threads(threads);
  }
  omp_set_num_threads(threads);
  Operands o(s);
  run_form(s, f, blas, o);  // warm-up
  for (auto _ : state) {
    run_form(s, f, blas, o);
    benchmark::DoNotOptimize(o.out.data());
    benchmark::DoNotOptimize(o.w.data());
    benchmark::DoNotOptimize(o.inp.data());
    benchmark::ClobberMemory();
  }
  const double flops = 2.0 * double(s.M) * double(s.K) * double(s.N);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// Register-only FMA loop: 12 independent accumulators per thread hide the FMA latency, so the
// rate is (FMA units) x (lanes) x 2 x clock, the ceiling any GEMM can reach.
__attribute__((noinline)) double fma_loop_avx2(int64_t iters) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(float(i) * 1e-3f);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  __m256 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
  float out[8];
  _mm256_storeu_ps(out, s);
  return double(out[0]);
}

__attribute__((target("avx512f"), noinline)) double fma_loop_avx512(int64_t iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(float(i) * 1e-3f);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t it = 0; it < iters; ++it)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  __m512 s = acc[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
  float out[16];
  _mm512_storeu_ps(out, s);
  return double(out[0]);
}

void bm_fma_peak(benchmark::State& state, bool avx512, int threads) {
  if (avx512 && !__builtin_cpu_supports("avx512f")) {
    state.SkipWithError("no AVX-512 on this CPU");
    return;
  }
  const int64_t iters = 1 << 22;
  double sink = 0;
  for (auto _ : state) {
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += avx512 ? fma_loop_avx512(iters) : fma_loop_avx2(iters);
  }
  benchmark::DoNotOptimize(sink);
  const double flops = double(iters) * 12 * (avx512 ? 16 : 8) * 2 * threads;
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  const int max_threads = omp_get_max_threads();
  std::vector<int> thread_counts = {1};
  if (max_threads > 1) thread_counts.push_back(max_threads);

  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  const bool have_blas = openblas().ok();
  benchmark::AddCustomContext("omp_max_threads", std::to_string(max_threads));
  benchmark::AddCustomContext("avx512f", __builtin_cpu_supports("avx512f") ? "yes" : "no");
  benchmark::AddCustomContext("openblas", have_blas ? "loaded" : "not found");
  if (have_blas && openblas().get_corename)
    benchmark::AddCustomContext("openblas_core", openblas().get_corename());
  benchmark::AddCustomContext("OPENBLAS_CORETYPE", coretype ? coretype : "(unset)");

  for (int t : thread_counts) {
    benchmark::RegisterBenchmark(("fma_peak/avx2/threads:" + std::to_string(t)).c_str(), bm_fma_peak, false, t)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime();
    if (__builtin_cpu_supports("avx512f"))
      benchmark::RegisterBenchmark(("fma_peak/avx512/threads:" + std::to_string(t)).c_str(), bm_fma_peak, true, t)
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
  }
  for (int lib = 0; lib < (have_blas ? 2 : 1); ++lib)
    for (int t : thread_counts)
      for (const Shape& s : kShapes)
        for (Form f : {kFwd, kDinp, kDw}) {
          const std::string name = std::string("gemm/") + (lib ? "OpenBLAS" : "oneDNN") + "/" + s.name + "/" +
                                   kFormNames[f] + "/threads:" + std::to_string(t);
          benchmark::RegisterBenchmark(name.c_str(), bm_gemm, s, f, lib == 1, t)
              ->Unit(benchmark::kMillisecond)
              ->UseRealTime()
              ->MinTime(0.3);
        }
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

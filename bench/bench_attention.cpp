// CPU attention forward and backward at GPT-2 124M shapes (packed qkv [B, T, 3C], NH=12, HS=64).
// Reports the time per call and GFLOP/s counted as 4 B NH T^2 HS / 2 for a causal forward
// (q k^T and p v over the visible half) and 2.5 times that for backward; non-causal counts the full T^2.
//
//   bench_attention [--benchmark_filter=...]   threads: OMP_NUM_THREADS (default: all cores)
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstdint>
#include <vector>

#include "core/rng.h"
#include "kernels/cpu/attention.h"

namespace {

struct Setup {
  loom::cpu::AttnArgs a;
  std::vector<float> qkv, out, lse, dout, dqkv;  // f32 [B, T, 3C], [B, T, C], [B, NH, T], [B, T, C], [B, T, 3C]

  Setup(int64_t B, int64_t T, int64_t NH, int64_t HS, bool causal) {
    const int64_t C = NH * HS;
    a.B = B, a.NH = NH, a.HS = HS, a.Tq = a.Tkv = T;
    a.q_stride = a.kv_stride = 3 * C;
    a.o_stride = C;
    a.causal = causal;
    qkv.resize(size_t(B * T * 3 * C));
    dout.resize(size_t(B * T * C));
    loom::fill_uniform(qkv.data(), int64_t(qkv.size()), -1.f, 1.f, 1, 0, 0);
    loom::fill_uniform(dout.data(), int64_t(dout.size()), -1.f, 1.f, 2, 0, 0);
    out.resize(size_t(B * T * C));
    lse.resize(size_t(B * NH * T));
    dqkv.resize(qkv.size());
  }
  void forward() {
    const int64_t C = a.NH * a.HS;
    loom::cpu::attention_forward(out.data(), lse.data(), qkv.data(), qkv.data() + C, qkv.data() + 2 * C, a);
  }
  void backward() {
    const int64_t C = a.NH * a.HS;
    loom::cpu::attention_backward(dqkv.data(), dqkv.data() + C, dqkv.data() + 2 * C, dout.data(), qkv.data(),
                                  qkv.data() + C, qkv.data() + 2 * C, out.data(), lse.data(), a);
  }
  double forward_flops() const {
    const double f = 4.0 * double(a.B * a.NH) * double(a.Tq) * double(a.Tkv) * double(a.HS);
    return a.causal ? f / 2 : f;
  }
};

void report(benchmark::State& state, double flops) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9 * double(state.iterations()), benchmark::Counter::kIsRate);
  state.counters["threads"] = omp_get_max_threads();
}

// args: B, T, NH, HS, causal
void BM_AttentionForward(benchmark::State& state) {
  Setup s(state.range(0), state.range(1), state.range(2), state.range(3), state.range(4) != 0);
  for (auto _ : state) {
    s.forward();
    benchmark::DoNotOptimize(s.out.data());
    benchmark::ClobberMemory();
  }
  report(state, s.forward_flops());
}

void BM_AttentionBackward(benchmark::State& state) {
  Setup s(state.range(0), state.range(1), state.range(2), state.range(3), state.range(4) != 0);
  s.forward();
  for (auto _ : state) {
    s.backward();
    benchmark::DoNotOptimize(s.dqkv.data());
    benchmark::ClobberMemory();
  }
  report(state, 2.5 * s.forward_flops());
}

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"B", "T", "NH", "HS", "causal"});
  b->Args({4, 256, 12, 64, 1});
  b->Args({4, 1024, 12, 64, 1});
  b->Args({4, 256, 12, 64, 0});
  b->Args({1, 1024, 12, 64, 1});
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

BENCHMARK(BM_AttentionForward)->Apply(shapes);
BENCHMARK(BM_AttentionBackward)->Apply(shapes);

}  // namespace

BENCHMARK_MAIN();

// Pipeline bubble measured from the executor's trace: runs every schedule kind on the threads
// backend with a balanced model (equal blocks per stage, embedding and head small), and prints
// each rank's idle fraction (the median over the steps after the first) next to the checker's
// simulation with the model's op costs and the theory, (p - 1) / (m + p - 1) of the step for
// GPipe and 1F1B ((p - 1) / m of the work). Optionally writes a Chrome trace and a PNG per kind
// (of the last step).
//   bench_pipeline [p] [m] [n_layer] [steps] [--trace PREFIX]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <string>

#include <fmt/format.h>

#include "comm/threads.h"
#include "model/config.h"
#include "parallel/pipeline/executor.h"

using namespace loom;
using namespace loom::parallel::pipeline;

int main(int argc, char** argv) {
  int p = 4, m = 8, L = 8, steps = 3;
  std::string prefix;
  std::vector<int> pos;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--trace" && i + 1 < argc) prefix = argv[++i];
    else pos.push_back(std::atoi(argv[i]));
  }
  if (pos.size() > 0) p = pos[0];
  if (pos.size() > 1) m = pos[1];
  if (pos.size() > 2) L = pos[2];
  if (pos.size() > 3) steps = pos[3];
  if (p < 1 || m < 1 || L < 1 || steps < 1) {
    std::fprintf(stderr, "usage: bench_pipeline [p] [m] [n_layer] [steps] [--trace PREFIX] (all >= 1)\n");
    return 2;
  }
  model::GPTConfig cfg;
  cfg.name = "bench-pipeline";
  cfg.n_layer = L;
  cfg.n_head = 4;
  cfg.n_embd = 128;
  cfg.vocab_size = 256;
  cfg.block_size = 64;
  const int64_t B = 2 * m, T = 64;
  std::printf("p=%d m=%d n_layer=%d C=%lld B=%lld T=%lld, %d steps (median of all but the first)\n", p, m, L,
              (long long)cfg.n_embd, (long long)B, (long long)T, steps);
  std::printf("%-12s %-40s %s\n", "kind", "idle fraction per rank (measured)", "simulated (model's op costs)");
  for (Kind k : {Kind::gpipe, Kind::one_f_one_b, Kind::interleaved, Kind::zb_h1}) {
    const int v = k == Kind::interleaved ? 2 : 1;
    if (k == Kind::interleaved && (m % p || L + 2 < p * v)) continue;
    ExecutorOptions o;
    o.schedule = {k, p, v, m};
    // Balanced: the blocks split evenly; the cheap embedding and head ride with the end stages.
    const int V = p * v;
    if (L % V == 0) {
      o.cuts.push_back(0);
      for (int s = 1; s < V; ++s) o.cuts.push_back(1 + int64_t(s) * (L / V));
      o.cuts.push_back(L + 2);
    }
    // Each step's trace of every rank; the last step's is the one written out.
    std::vector<std::vector<std::vector<TraceEvent>>> per_step(
        size_t(steps), std::vector<std::vector<TraceEvent>>(static_cast<size_t>(p)));
    std::mutex mu;
    std::mt19937 rng(7);
    Tensor x = Tensor::empty({B, T}, DType::i32, MemTag::activations);
    for (int64_t i = 0; i < x.numel(); ++i) x.i32()[i] = int32_t(rng() % 256);
    double sim_idle = 0;
    comm::run_ranks(p, [&](comm::Comm& w) {
      MemoryPool pool(fmt::format("r{}", w.rank()));
      PipelineExecutor ex(cfg, o, w, nullptr, pool);
      for (int s = 0; s < steps; ++s) {
        ex.step(x, x);
        std::lock_guard lk(mu);
        per_step[size_t(s)][size_t(w.rank())] = ex.trace();
      }
      if (w.rank() == 0) sim_idle = ex.checked().idle_fraction(0);
    });
    // Median over the measured steps (the first one warms the pools up).
    std::vector<std::vector<double>> fr(static_cast<size_t>(p));
    for (int st = steps > 1 ? 1 : 0; st < steps; ++st) {
      const std::vector<double> f = idle_fractions(per_step[size_t(st)]);
      for (int r = 0; r < p; ++r) fr[size_t(r)].push_back(f[size_t(r)]);
    }
    std::vector<double> idle;
    for (auto& v : fr) {
      std::sort(v.begin(), v.end());
      idle.push_back(v[v.size() / 2]);
    }
    std::string s;
    for (double f : idle) s += fmt::format("{:.3f} ", f);
    std::printf("%-12s %-40s %.3f\n", std::string(kind_name(k)).c_str(), s.c_str(), sim_idle);
    if (!prefix.empty()) {
      const auto& trace = per_step.back();
      const std::string base = prefix + "_" + std::string(kind_name(k));
      write_chrome_trace(base + ".json", trace);
      std::string why;
      draw_png(base + ".png", trace_timeline(fmt::format("{} p={} m={} (measured)", kind_name(k), p, m), trace), &why);
    }
  }
  std::printf("theory (GPipe, 1F1B): idle = (p-1)/(m+p-1) = %.3f; interleaved (v=2): %.3f\n",
              double(p - 1) / (m + p - 1), double(p - 1) / (2.0 * m + p - 1));
  return 0;
}

// Pipeline bubble measured from the executor's trace: runs every schedule kind on the threads
// backend with a balanced model (equal blocks per stage, embedding and head small), and prints
// each rank's idle fraction (the median over the steps after the first) next to the checker's
// simulation with the model's op costs and the theory, (p - 1) / (m + p - 1) of the step for
// GPipe and 1F1B ((p - 1) / m of the work). Optionally writes a Chrome trace and a PNG per kind
// (of the last step; with one thread per rank, also a PNG of its replay).
//
// When each rank runs one thread, it also replays the step's instruction lists with each
// compute's measured thread CPU time (checker.h's replay): the timeline on one dedicated core per
// rank. On a host with at least p free cores the wall-clock figures are the measurement and the
// replay a cross-check (they agree within about 0.01 at p = 2 on 2 cores). With fewer cores than
// ranks the rank threads share them, every compute stretches while others run, and the wall-clock
// figures say little; the replay still describes the schedule: a thread's CPU time does not count
// the time it waits for a core.
//   bench_pipeline [p] [m] [n_layer] [steps] [--trace PREFIX] [--threads-per-rank N]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <random>
#include <string>

#include <fmt/format.h>
#include <omp.h>

#include "comm/threads.h"
#include "model/config.h"
#include "parallel/pipeline/checker.h"
#include "parallel/pipeline/executor.h"

using namespace loom;
using namespace loom::parallel::pipeline;

int main(int argc, char** argv) {
  int p = 4, m = 8, L = 8, steps = 3;
  std::string prefix;
  std::vector<int> pos;
  comm::RunOptions run;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--trace" && i + 1 < argc) prefix = argv[++i];
    else if (a == "--threads-per-rank" && i + 1 < argc) run.threads_per_rank = std::atoi(argv[++i]);
    else pos.push_back(std::atoi(argv[i]));
  }
  if (pos.size() > 0) p = pos[0];
  if (pos.size() > 1) m = pos[1];
  if (pos.size() > 2) L = pos[2];
  if (pos.size() > 3) steps = pos[3];
  if (p < 1 || m < 1 || L < 1 || steps < 1 || run.threads_per_rank < 0) {
    std::fprintf(stderr,
                 "usage: bench_pipeline [p] [m] [n_layer] [steps] [--trace PREFIX] [--threads-per-rank N] (all >= 1)\n");
    return 2;
  }
  const int per_rank = comm::threads_per_rank(p, run);
  const bool replayable = per_rank == 1;
  const int cores = omp_get_num_procs();
  const bool shared = p * per_rank > cores;  // the wall clock then stretches every compute
  model::GPTConfig cfg;
  cfg.name = "bench-pipeline";
  cfg.n_layer = L;
  cfg.n_head = 4;
  cfg.n_embd = 128;
  cfg.vocab_size = 256;
  cfg.block_size = 64;
  const int64_t B = 2 * m, T = 64;
  std::printf("p=%d m=%d n_layer=%d C=%lld B=%lld T=%lld, %d steps (median of all but the first), %d thread(s) per "
              "rank on %d core(s)\n",
              p, m, L, (long long)cfg.n_embd, (long long)B, (long long)T, steps, per_rank, cores);
  if (shared)
    std::printf("%d rank threads on %d cores: the wall-clock column stretches with the sharing; the replay's "
                "figures stand for one core per rank\n", p * per_rank, cores);
  std::printf("%-12s %-36s %-36s %s\n", "kind", "idle per rank (wall clock)", "idle per rank (CPU-time replay)",
              "simulated (model's op costs)");
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
    Schedule schedule;
    comm::run_ranks(p, [&](comm::Comm& w) {
      MemoryPool pool(fmt::format("r{}", w.rank()));
      PipelineExecutor ex(cfg, o, w, nullptr, pool);
      for (int s = 0; s < steps; ++s) {
        ex.step(x, x);
        std::lock_guard lk(mu);
        per_step[size_t(s)][size_t(w.rank())] = ex.trace();
      }
      if (w.rank() == 0) {
        sim_idle = ex.checked().idle_fraction(0);
        schedule = ex.schedule();
      }
    }, run);
    // Median over the measured steps (the first one warms the pools up).
    std::vector<std::vector<double>> fr(static_cast<size_t>(p)), rp(static_cast<size_t>(p)), busy(static_cast<size_t>(p));
    for (int st = steps > 1 ? 1 : 0; st < steps; ++st) {
      const std::vector<double> f = idle_fractions(per_step[size_t(st)]);
      const CheckResult re = replay(schedule, compute_seconds(per_step[size_t(st)]));
      for (int r = 0; r < p; ++r) {
        fr[size_t(r)].push_back(f[size_t(r)]);
        rp[size_t(r)].push_back(re.idle_fraction(r));
        busy[size_t(r)].push_back(1e3 * re.ranks[size_t(r)].busy);
      }
    }
    auto medians = [](std::vector<std::vector<double>>& per_rank_values) {
      std::string s;
      for (auto& v : per_rank_values) {
        std::sort(v.begin(), v.end());
        s += fmt::format("{:.3f} ", v[v.size() / 2]);
      }
      return s;
    };
    const std::string wall = medians(fr), replayed = replayable ? medians(rp) : "- (ranks run several threads)";
    std::printf("%-12s %-36s %-36s %.3f\n", std::string(kind_name(k)).c_str(), wall.c_str(), replayed.c_str(), sim_idle);
    // Each rank's compute per step: a stage heavier than the others sets the pipeline's pace.
    if (replayable) {
      std::string b;
      for (auto& v : busy) {
        std::sort(v.begin(), v.end());
        b += fmt::format("{:.1f} ", v[v.size() / 2]);
      }
      std::printf("%-12s busy per rank (CPU ms per step): %s\n", "", b.c_str());
    }
    if (!prefix.empty()) {
      const auto& trace = per_step.back();
      const std::string base = prefix + "_" + std::string(kind_name(k));
      write_chrome_trace(base + ".json", trace);
      std::string why;
      draw_png(base + ".png", trace_timeline(fmt::format("{} p={} m={} (measured)", kind_name(k), p, m), trace), &why);
      if (replayable) {
        const CheckResult re = replay(schedule, compute_seconds(trace));
        Timeline tl = schedule_timeline(schedule, re);
        tl.title = fmt::format("{} p={} m={} (replayed from CPU times, one core per rank)", kind_name(k), p, m);
        draw_png(base + "_replay.png", tl, &why);
      }
    }
  }
  std::printf("theory (GPipe, 1F1B): idle = (p-1)/(m+p-1) = %.3f; interleaved (v=2): %.3f\n",
              double(p - 1) / (m + p - 1), double(p - 1) / (2.0 * m + p - 1));
  return 0;
}

#include "plan/calibration.h"
#include "core/threads.h"

#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "comm/threads.h"
#include "core/error.h"
#include "core/file.h"
#include "core/memory.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/crossentropy.h"
#include "kernels/cpu/gelu.h"
#include "kernels/cpu/layernorm.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/residual.h"
#include "model/gpt.h"
#include "parallel/pipeline/checker.h"
#include "parallel/pipeline/schedule.h"

namespace fs = std::filesystem;

namespace loom::plan {

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string today() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[16];
  std::strftime(buf, sizeof(buf), "%Y-%m-%d", &tm);
  return buf;
}

nlohmann::json kernels_json(const std::map<std::string, KernelCost>& k) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [name, c] : k) j[name] = {{"call_s", c.call}, {"unit_s", c.unit}};
  return j;
}

nlohmann::json linear_json(const std::vector<LinearRate>& g) {
  nlohmann::json j = nlohmann::json::array();
  for (const LinearRate& r : g)
    j.push_back({{"tokens", r.tokens}, {"width", r.width}, {"forward_flops", r.forward}, {"backward_flops", r.backward}});
  return j;
}

nlohmann::json blocks_json(const std::vector<BlockTime>& g) {
  nlohmann::json j = nlohmann::json::array();
  for (const BlockTime& b : g)
    j.push_back({{"ranks", b.ranks}, {"tokens", b.tokens}, {"width", b.width}, {"seq", b.seq}, {"vocab", b.vocab},
                 {"layer_forward_s", b.layer_forward}, {"layer_backward_s", b.layer_backward},
                 {"head_forward_s", b.head_forward}, {"head_backward_s", b.head_backward}});
  return j;
}

nlohmann::json to_json(const HostProfile& p) {
  return {{"cpu", p.cpu},
          {"cores", p.cores},
          {"threads", p.threads},
          {"gemm_peak_flops", p.gemm_peak},
          {"gemm_typical_flops", p.gemm_typical},
          {"gemm_small_flops", p.gemm_small},
          {"memory_bytes_per_s", p.memory_bw},
          {"allreduce_latency_s", p.allreduce_latency},
          {"allreduce_bytes_per_s", p.allreduce_bw},
          {"crowded_sync_s", p.crowded_sync},
          {"wake_s", p.wake},
          {"crowded_wake_s", p.crowded_wake},
          {"balance_s", p.balance},
          {"kernels", kernels_json(p.kernels)},
          {"linear", linear_json(p.linear)},
          {"blocks", blocks_json(p.blocks)},
          {"source", p.source},
          {"date", p.date}};
}

std::optional<HostProfile> from_json(const nlohmann::json& j) {
  try {
    HostProfile p;
    p.cpu = j.at("cpu").get<std::string>();
    p.cores = j.at("cores").get<int>();
    p.threads = j.at("threads").get<int>();
    p.gemm_peak = j.at("gemm_peak_flops").get<double>();
    p.gemm_typical = j.value("gemm_typical_flops", 0.0);
    p.gemm_small = j.value("gemm_small_flops", 0.0);
    p.memory_bw = j.value("memory_bytes_per_s", 0.0);
    p.allreduce_latency = j.value("allreduce_latency_s", 0.0);
    p.allreduce_bw = j.value("allreduce_bytes_per_s", 0.0);
    p.crowded_sync = j.value("crowded_sync_s", 0.0);
    p.wake = j.value("wake_s", 0.0);
    p.crowded_wake = j.value("crowded_wake_s", 0.0);
    p.balance = j.value("balance_s", 0.0);
    // Numbers no calibration on any host measures make the entry one loom did not write (edited or
    // corrupt): it is ignored as a missing one is, and measured again. A rate is FLOP/s or bytes/s
    // from 1e6 to 1e16, a time from 0 to 100 s; 0 is a figure not measured (an older entry).
    auto rate = [](double v, bool needed) { return std::isfinite(v) && (needed ? v >= 1e6 : v == 0 || v >= 1e6) && v <= 1e16; };
    auto secs = [](double v) { return std::isfinite(v) && v >= 0 && v <= 100; };
    if (!rate(p.gemm_peak, true) || !rate(p.gemm_typical, false) || !rate(p.gemm_small, false) ||
        !rate(p.memory_bw, false) || !rate(p.allreduce_bw, false) || p.gemm_typical > p.gemm_peak ||
        p.gemm_small > p.gemm_peak)
      return std::nullopt;
    for (double v : {p.allreduce_latency, p.crowded_sync, p.wake, p.crowded_wake, p.balance})
      if (!secs(v)) return std::nullopt;
    p.source = j.value("source", std::string());
    p.date = j.value("date", std::string());
    if (j.contains("linear") && j["linear"].is_array())
      for (const auto& r : j["linear"]) {
        const LinearRate x{r.at("tokens").get<double>(), r.at("width").get<double>(), r.at("forward_flops").get<double>(),
                           r.at("backward_flops").get<double>()};
        if (x.tokens > 0 && x.width > 0 && rate(x.forward, true) && rate(x.backward, true)) p.linear.push_back(x);
      }
    // A malformed block entry is dropped, not the whole profile (the planner then finds the grid
    // incomplete and leaves the blocks out).
    if (j.contains("blocks") && j["blocks"].is_array())
      for (const auto& r : j["blocks"]) try {
          auto num = [&](const char* key) { return r.at(key).get<double>(); };
          const BlockTime b{r.at("ranks").get<int>(), num("tokens"), num("width"), num("seq"), num("vocab"),
                            num("layer_forward_s"), num("layer_backward_s"), num("head_forward_s"),
                            num("head_backward_s")};
          if (b.ranks >= 1 && b.tokens > 0 && b.width > 0 && b.seq > 0 && b.vocab > 0 && b.layer_forward > 0 &&
              b.layer_backward > 0 && b.head_forward > 0 && b.head_backward > 0 && secs(b.layer_forward) &&
              secs(b.layer_backward) && secs(b.head_forward) && secs(b.head_backward))
            p.blocks.push_back(b);
        } catch (const nlohmann::json::exception&) {
        }
    if (j.contains("kernels") && j["kernels"].is_object())
      for (const auto& [name, c] : j["kernels"].items()) {
        const KernelCost k{c.at("call_s").get<double>(), c.at("unit_s").get<double>()};
        if (secs(k.call) && k.unit >= 1e-18 && k.unit <= 1) p.kernels[name] = k;
      }
    if (p.threads <= 0 || p.cores <= 0) return std::nullopt;
    return p;
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

// An unreadable cache (missing, a folder, not JSON) is measured again, not an error.
nlohmann::json read_cache() {
  std::string text;
  try {
    text = read_file(calibration_path());
  } catch (const Error&) {
    return nlohmann::json::array();
  }
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  return j.is_array() ? j : nlohmann::json::array();
}

// The best sustained rate of C[M, N] = A[M, K] B[K, N] (the kernel's own measurement, in rounds
// of at least `seconds` / 4), once two rounds agree within 2% (at most 8).
double gemm_rate(int64_t M, int64_t N, int64_t K, double seconds) {
  double best = 0, last = 0;
  for (int round = 0; round < 8; ++round) {
    const double rate = cpu::measure_gemm_gflops(M, N, K, seconds / 4) * 1e9;
    best = std::max(best, rate);
    if (round > 0 && std::abs(rate - last) <= 0.02 * std::max(rate, last)) break;
    last = rate;
  }
  return best;
}

// The least mean seconds per call of run() over rounds of at least `seconds` / 8 (at least one
// call a round; the best of 3 rounds, after a warm-up call).
template <class Run>
double seconds_per_call(Run&& run, double seconds) {
  run();  // warm: first-touch pages, the OpenMP team
  double best = std::numeric_limits<double>::infinity();
  for (int round = 0; round < 3; ++round) {
    int calls = 0;
    const auto t0 = Clock::now();
    do run(), ++calls;
    while (since(t0) < seconds / 8);
    best = std::min(best, since(t0) / calls);
  }
  return best;
}

// A kernel timed at a small and a large size (units of work u1 < u2): the line through both.
KernelCost fit(double t1, double u1, double t2, double u2) {
  KernelCost k;
  k.unit = std::max((t2 - t1) / (u2 - u1), t2 / u2 * 1e-3);
  k.call = std::max(0.0, t1 - k.unit * u1);
  return k;
}

// loom's non-GEMM CPU kernels at a small layer's sizes (64 tokens of width 128) and a large one's
// (2048 tokens of width 768).
std::map<std::string, KernelCost> measure_kernels(double seconds) {
  std::map<std::string, KernelCost> out;
  struct Size {
    int64_t N, C, T, NH, V;
  };
  const Size sizes[2] = {{64, 128, 64, 4, 4096}, {2048, 768, 256, 12, 8192}};
  double t[2][9], u[2][9];
  for (int s = 0; s < 2; ++s) {
    const auto [N, C, T, NH, V] = sizes[s];
    const size_t wide = static_cast<size_t>(N * 4 * C), cols = static_cast<size_t>(C), rows = static_cast<size_t>(N);
    std::vector<float> x(wide), y(wide), z(wide, 0.25f), w(cols, 1.0f), b(cols, 0.0f), dw(cols), db(cols), mean(rows),
        rstd(rows);
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(i % 97) / 97.0f - 0.5f;
    cpu::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C);
    t[s][0] = seconds_per_call([&] { cpu::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C); }, seconds);
    t[s][1] = seconds_per_call([&] {
      cpu::layernorm_backward(z.data(), dw.data(), db.data(), y.data(), x.data(), w.data(), mean.data(), rstd.data(), N, C);
    }, seconds);
    u[s][0] = u[s][1] = double(N * C);
    t[s][2] = seconds_per_call([&] { cpu::gelu_forward(y.data(), x.data(), N * 4 * C); }, seconds);
    t[s][3] = seconds_per_call([&] { cpu::gelu_backward(z.data(), x.data(), y.data(), N * 4 * C); }, seconds);
    u[s][2] = u[s][3] = double(N * 4 * C);
    t[s][4] = seconds_per_call([&] { cpu::residual_forward(z.data(), x.data(), y.data(), N * C); }, seconds);
    u[s][4] = double(N * C);
    // Attention over B = N / T sequences of T tokens, NH heads of C / NH: qkv packed [N, 3C].
    {
      const int64_t B = N / T, HS = C / NH;
      std::vector<float> qkv(static_cast<size_t>(N * 3 * C)), o(static_cast<size_t>(N * C)), lse(static_cast<size_t>(B * NH * T)), dqkv(static_cast<size_t>(N * 3 * C)),
          dout(static_cast<size_t>(N * C), 0.01f);
      for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = float(i % 89) / 89.0f - 0.5f;
      cpu::AttnArgs a;
      a.B = B, a.NH = NH, a.HS = HS, a.Tq = a.Tkv = T, a.q_stride = a.kv_stride = 3 * C, a.o_stride = C;
      MemoryPool pool("calibrate");
      cpu::AttnWorkspace ws(pool);
      const float *q = qkv.data(), *k = q + C, *v = q + 2 * C;
      t[s][5] = seconds_per_call([&] { cpu::attention_forward(o.data(), lse.data(), q, k, v, ws.use(a, false)); }, seconds);
      t[s][6] = seconds_per_call([&] {
        cpu::attention_backward(dqkv.data(), dqkv.data() + C, dqkv.data() + 2 * C, dout.data(), q, k, v, o.data(),
                                lse.data(), ws.use(a, true));
      }, seconds);
      u[s][5] = u[s][6] = 4.0 * double(N) * double(T) * double(C);
    }
    // The fused cross-entropy over N rows of V logits.
    {
      std::vector<float> logits(static_cast<size_t>(N * V)), dl(static_cast<size_t>(N * V)), losses(static_cast<size_t>(N));
      std::vector<int32_t> targets(static_cast<size_t>(N));
      for (size_t i = 0; i < logits.size(); ++i) logits[i] = float(i % 101) / 50.0f - 1.0f;
      for (int64_t n = 0; n < N; ++n) targets[static_cast<size_t>(n)] = int32_t((n * 7919) % V);
      t[s][7] = seconds_per_call([&] {
        cpu::crossentropy_forward_backward(losses.data(), dl.data(), logits.data(), targets.data(), 1.0f / float(N), N,
                                           V, V);
      }, seconds);
      u[s][7] = double(N * V);
    }
    // AdamW over as many parameters as the layer's matrices (12 C^2).
    {
      const int64_t n = 12 * C * C;
      std::vector<float> prm(static_cast<size_t>(n), 0.1f), g(static_cast<size_t>(n), 0.01f), m1(static_cast<size_t>(n)), m2(static_cast<size_t>(n));
      cpu::AdamWArgs args;
      args.weight_decay = 0.1;
      t[s][8] = seconds_per_call([&] { cpu::adamw_update(prm.data(), g.data(), m1.data(), m2.data(), n, args); }, seconds);
      u[s][8] = double(n);
    }
  }
  for (size_t i = 0; i < kKernelNames.size(); ++i) out[kKernelNames[i]] = fit(t[0][i], u[0][i], t[1][i], u[1][i]);
  return out;
}

// A transformer layer's four linears (matmul_forward / matmul_backward with bias) on a grid of
// tokens and widths (up to a million tokens x width): their forward and backward FLOP/s.
std::vector<LinearRate> measure_linear(double seconds) {
  std::vector<LinearRate> out;
  for (int64_t C : {128, 384, 1024})
    for (int64_t M : {64, 256, 1024, 4096}) {
      if (M * C > 1024 * 1024) continue;  // (larger points cost seconds each; the planner clamps to the grid)
      double tf = 0, tb = 0, flops = 0;
      for (auto [N, K] : {std::pair{3 * C, C}, std::pair{C, C}, std::pair{4 * C, C}, std::pair{C, 4 * C}}) {
        // The activations rotate over sets that together exceed the caches (64 MiB), as a
        // training step's do: each product reads inputs and writes outputs that are not in cache.
        const int64_t set_floats = 2 * M * K + 2 * M * N;
        const int64_t sets = std::clamp<int64_t>((int64_t(16) << 20) / set_floats, 1, 64);
        std::vector<float> acts(static_cast<size_t>(sets * set_floats), 0.01f), w(static_cast<size_t>(N * K), 0.01f),
            b(static_cast<size_t>(N), 0.0f), dw(static_cast<size_t>(N * K)), db(static_cast<size_t>(N));
        int64_t at = 0;
        auto next = [&] {
          float* base = acts.data() + (at++ % sets) * set_floats;
          return std::array<float*, 4>{base, base + M * K, base + 2 * M * K, base + 2 * M * K + M * N};  // x, dx, y, dy
        };
        tf += seconds_per_call([&] {
          const auto [x, dx, y, dy] = next();
          cpu::matmul_forward(y, x, w.data(), b.data(), M, K, N);
        }, seconds);
        tb += seconds_per_call([&] {
          const auto [x, dx, y, dy] = next();
          cpu::matmul_backward(dx, dw.data(), db.data(), dy, x, w.data(), M, K, N);
        }, seconds);
        flops += 2.0 * double(M) * double(N) * double(K);
      }
      out.push_back({double(M), double(C), flops / tf, 2 * flops / tb});
    }
  return out;
}

// Seconds of each chain element's forward and backward in the last step (model::ChainHooks).
struct BlockClock : model::ChainHooks {
  explicit BlockClock(size_t n) : forward(n), backward(n) {}
  std::vector<double> forward, backward;
  Clock::time_point t0;
  void before_forward(int64_t) override { t0 = Clock::now(); }
  void after_forward(int64_t i) override { forward[size_t(i)] = since(t0); }
  void before_backward(int64_t) override { t0 = Clock::now(); }
  void after_backward(int64_t i) override { backward[size_t(i)] = since(t0); }
};

// loom's own chain as a training step runs it (zero_grad, forward with the fused loss, backward):
// a two-layer GPT (heads of 64, feed-forward 4 x width, vocabulary 8192, sequences of 64) at 64,
// 256 and 1024 tokens x widths 128 and 384, on 1, 2, 4 ... `threads` ranks at once, up to 8
// (threads / ranks OpenMP threads each, in lockstep: a barrier before and after every step), each
// point's steps repeated for at least `seconds` after ten warm-up steps (at least 5). Per rank,
// per element, the median over the steps (a layer's: of the two layers' mean); the slowest
// rank's; the whole grid twice over, the lesser of the two (a slow spell of the host falls on
// one of them).
std::vector<BlockTime> measure_blocks(int threads, double seconds) {
  std::vector<int> rank_counts;
  // At most kMaxRanks ranks at once (each holds a model and its activations, and their work adds
  // up): a host with more cores is measured up to that many; the planner takes the nearest count.
  constexpr int kMaxRanks = 8;
  for (int r = 1; r < threads && r <= kMaxRanks; r *= 2) rank_counts.push_back(r);
  if (threads <= kMaxRanks) rank_counts.push_back(threads);
  constexpr int64_t kLayers = 2, kSeq = 64, kVocab = 8192;
  // A fresh model's first steps run slower (its memory newly mapped): after two warm-up steps the
  // one-rank blocks at 1024 tokens measured up to 1.45x what the same model's blocks took in a
  // training run's later steps in the same minutes; after ten, the layers within 5% and the head
  // within 10% (a training run's first ten steps are what the bench skips, too).
  constexpr int kWarmupSteps = 10;
  std::vector<BlockTime> out;
  for (int round = 0; round < 2; ++round) {
    size_t point = 0;
    for (int ranks : rank_counts)
      for (int64_t C : {128, 384})
        for (int64_t N : {64, 256, 1024}) {
          model::GPTConfig cfg;
          cfg.name = "calibrate";
          cfg.n_layer = kLayers;
          cfg.n_embd = C;
          cfg.n_head = C / 64;
          cfg.vocab_size = kVocab;
          cfg.block_size = kSeq;
          const int64_t B = N / kSeq;
          // layer forward, backward, head forward, backward: each rank's medians
          std::vector<std::array<double, 4>> per_rank(static_cast<size_t>(ranks));
          comm::RunOptions ro;
          ro.threads_per_rank = std::max(1, threads / ranks);
          comm::run_ranks(ranks, [&](comm::Comm& c) {
            MemoryPool pool("calibrate");
            model::GPT gpt(cfg, pool, 1337 + uint64_t(c.rank()));
            Tensor tokens = Tensor::empty({B, kSeq}, DType::i32, MemTag::workspace, pool);
            Tensor targets = Tensor::empty({B, kSeq}, DType::i32, MemTag::workspace, pool);
            for (int64_t i = 0; i < N; ++i) {
              tokens.i32()[i] = int32_t((i * 7919 + 13) % kVocab);
              targets.i32()[i] = int32_t((i * 104729 + 7) % kVocab);
            }
            BlockClock clock(size_t(kLayers + 2));
            gpt.set_hooks(&clock);
            std::array<std::vector<double>, 4> t;
            double timed = 0;
            for (int step = 0;; ++step) {
              c.barrier();
              const auto t0 = Clock::now();
              gpt.zero_grad();
              gpt.forward(tokens, targets, {.fuse_backward = true});
              gpt.backward();
              c.barrier();  // the step ends when the slowest rank's does
              if (step < kWarmupSteps) continue;
              timed += since(t0);
              double lf = 0, lb = 0;
              for (int64_t l = 1; l <= kLayers; ++l) lf += clock.forward[size_t(l)], lb += clock.backward[size_t(l)];
              t[0].push_back(lf / kLayers);
              t[1].push_back(lb / kLayers);
              t[2].push_back(clock.forward[size_t(kLayers + 1)]);
              t[3].push_back(clock.backward[size_t(kLayers + 1)]);
              // Every rank stops after the same step: rank 0's time decides.
              int done = t[0].size() >= 5 && timed >= seconds ? 1 : 0;
              c.broadcast(&done, 1, DType::i32, 0);
              if (done) break;
            }
            for (size_t k = 0; k < t.size(); ++k) {
              std::sort(t[k].begin(), t[k].end());
              per_rank[size_t(c.rank())][k] = t[k][t[k].size() / 2];
            }
          }, ro);
          std::array<double, 4> slowest{};
          for (const auto& r : per_rank)
            for (size_t k = 0; k < r.size(); ++k) slowest[k] = std::max(slowest[k], r[k]);
          if (round == 0) {
            out.push_back({ranks, double(N), double(C), double(kSeq), double(kVocab), slowest[0], slowest[1],
                           slowest[2], slowest[3]});
          } else {
            BlockTime& o = out[point];
            o.layer_forward = std::min(o.layer_forward, slowest[0]);
            o.layer_backward = std::min(o.layer_backward, slowest[1]);
            o.head_forward = std::min(o.head_forward, slowest[2]);
            o.head_backward = std::min(o.head_backward, slowest[3]);
          }
          ++point;
        }
  }
  return out;
}

}  // namespace

std::string host_cpu_name() {
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);)
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      std::string s = colon == std::string::npos ? line : line.substr(colon + 1);
      s.erase(0, s.find_first_not_of(' '));
      return s;
    }
  return "unknown cpu";
}

int host_cores() { return int(std::max<long>(1, ::sysconf(_SC_NPROCESSORS_ONLN))); }

std::string calibration_path() {
  if (const char* d = std::getenv("LOOM_CACHE_DIR"); d && *d) return (fs::path(d) / "calibration.json").string();
  if (const char* d = std::getenv("XDG_CACHE_HOME"); d && *d) return (fs::path(d) / "loom" / "calibration.json").string();
  if (const char* h = std::getenv("HOME"); h && *h) return (fs::path(h) / ".cache" / "loom" / "calibration.json").string();
  return (fs::temp_directory_path() / "loom-calibration.json").string();
}

std::optional<HostProfile> cached_profile(int threads) {
  const std::string cpu = host_cpu_name();
  const int cores = host_cores();
  for (const auto& e : read_cache())
    if (auto p = from_json(e); p && p->cpu == cpu && p->cores == cores && p->threads == threads) return p;
  return std::nullopt;
}

void save_profile(const HostProfile& p) {
  nlohmann::json all = read_cache(), kept = nlohmann::json::array();
  for (const auto& e : all) {
    auto q = from_json(e);
    if (q && !(q->cpu == p.cpu && q->cores == p.cores && q->threads == p.threads)) kept.push_back(e);
  }
  kept.push_back(to_json(p));
  const fs::path path = calibration_path();
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  // Several loom processes may calibrate at once: each through a temporary file of its own.
  write_file_atomically(path.string(), kept.dump(2) + "\n", {.per_process = true});
}

// The work of the scheduling measurements: a 256-token layer's qkv product (width 128), ~0.1 ms
// on one thread, each rank on buffers of its own.
struct QkvProduct {
  static constexpr int64_t M = 256, C = 128, N = 384;
  std::vector<float> x = std::vector<float>(size_t(M * C), 0.1f), w = std::vector<float>(size_t(N * C), 0.01f),
                     y = std::vector<float>(size_t(M * N));
  void run(int times = 1) {
    for (int i = 0; i < times; ++i) cpu::matmul_forward(y.data(), x.data(), w.data(), nullptr, M, C, N);
  }
};

// Keeps the calling thread (and the threads it starts, which inherit it) on the first `n` CPUs
// it may run on while it lives, so that measurements of ranks beyond `n` cores are crowded on a
// host with more; nothing where it may run on `n` or fewer already or cannot be pinned.
class OnFirstCpus {
 public:
  explicit OnFirstCpus(int n) {
    CPU_ZERO(&before_);
    if (n < 1 || pthread_getaffinity_np(pthread_self(), sizeof before_, &before_) != 0 || CPU_COUNT(&before_) <= n)
      return;
    cpu_set_t first;
    CPU_ZERO(&first);
    for (int cpu = 0, taken = 0; cpu < CPU_SETSIZE && taken < n; ++cpu)
      if (CPU_ISSET(cpu, &before_)) CPU_SET(cpu, &first), ++taken;
    pinned_ = pthread_setaffinity_np(pthread_self(), sizeof first, &first) == 0;
  }
  ~OnFirstCpus() {
    if (pinned_) pthread_setaffinity_np(pthread_self(), sizeof before_, &before_);
  }
  OnFirstCpus(const OnFirstCpus&) = delete;
  OnFirstCpus& operator=(const OnFirstCpus&) = delete;

 private:
  cpu_set_t before_;
  bool pinned_ = false;
};

// The OS's scheduling of one-thread ranks, as a pipeline meets it (pipeline::RankCosts).
//
// The seconds from a message's post to its receiver running again, for a receiver asleep in the
// receive (the mean of `n`: what adds up over a step; the times are mostly short with an
// occasional wait for a time slice): rank 0 computes for about a millisecond (so that rank 1 is
// asleep), posts the time without waiting for the send (as a pipeline stage does) and computes
// on; `hogs` more ranks compute all the while, so that a core is idle when the message arrives
// (threads - 2 of them) or none is (threads - 1).
double wake_latency(int hogs, int n) {
  double total = 0;
  std::atomic<bool> stop{false};
  comm::RunOptions ro;
  ro.threads_per_rank = 1;
  comm::run_ranks(2 + hogs, [&](comm::Comm& c) {
    QkvProduct work;
    if (c.rank() >= 2) {
      while (!stop.load()) work.run();
      return;
    }
    struct Stop {  // the hogs stop however ranks 0 and 1 end
      std::atomic<bool>& s;
      ~Stop() { s.store(true); }
    } guard{stop};
    constexpr int kWarmup = 5;
    double posted[2] = {0, 0};  // rank 0: a send's buffer stays until the next but one
    std::unique_ptr<comm::PendingSend> sends[2];
    for (int i = 0; i < n + kWarmup; ++i) {
      if (c.rank() == 0) {
        work.run(8);
        auto& slot = sends[i & 1];
        if (slot) slot->wait();
        posted[i & 1] = std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
        slot = c.isend(&posted[i & 1], 2, DType::u32, 1);  // a double as two 32-bit words
      } else {
        double t = 0;
        c.recv(&t, 2, DType::u32, 0);
        if (i >= kWarmup) total += std::chrono::duration<double>(Clock::now().time_since_epoch()).count() - t;
      }
    }
    for (auto& q : sends)
      if (q) q->wait();
  }, ro);
  return total / n;
}

// How long a thread that shares a core with another computing thread stays there while another
// core is idle (the OS's load balancing): both start pinned to one core, then the second may run
// anywhere; the time until it runs elsewhere (the median of `n`, at most 0.2 s: a thread not
// moved by then counts as never moved within an op; 0 where the threads cannot be pinned or only
// one core is allowed).
double balance_time(int n) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || CPU_COUNT(&allowed) < 2) return 0;
  int first = 0;
  while (!CPU_ISSET(first, &allowed)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  auto spin_until = [](const std::function<bool()>& done) {
    volatile double v = 0;
    while (!done())
      for (int i = 0; i < 1000; ++i) v = v + i;
  };
  std::vector<double> lags;
  for (int k = 0; k < n; ++k) {
    std::atomic<bool> stop{false}, pinned{true};
    double lag = -1;
    std::thread hog([&] {
      if (pthread_setaffinity_np(pthread_self(), sizeof one, &one) != 0) pinned = false;
      spin_until([&] { return stop.load(); });
    });
    std::thread mover([&] {
      if (pthread_setaffinity_np(pthread_self(), sizeof one, &one) != 0) pinned = false;
      auto t0 = Clock::now();
      spin_until([&] { return since(t0) > 0.02; });  // both on the one core for 20 ms
      if (pthread_setaffinity_np(pthread_self(), sizeof allowed, &allowed) != 0) pinned = false;
      t0 = Clock::now();
      spin_until([&] { return sched_getcpu() != first || since(t0) > 0.2; });
      lag = since(t0);
      stop = true;
    });
    mover.join();
    hog.join();
    if (!pinned) return 0;
    lags.push_back(lag);
  }
  std::sort(lags.begin(), lags.end());
  return lags[lags.size() / 2];
}

HostProfile calibrate_host(int threads, double seconds) {
  LOOM_CHECK(threads >= 1, "calibrate: threads must be at least 1, got {}", threads);
  HostProfile p;
  p.cpu = host_cpu_name();
  p.cores = host_cores();
  p.threads = threads;
  p.source = "loom calibrate";
  p.date = today();
  const int before = omp_get_max_threads();
  set_omp_threads(threads);
  // A transformer layer's products at 2048 tokens: qkv, attention output, MLP up and down.
  std::vector<double> rates;
  for (int64_t C : {512, 768, 1024, 2048}) {
    const int64_t M = 2048;
    for (auto [N, K] : {std::pair{3 * C, C}, std::pair{C, C}, std::pair{4 * C, C}, std::pair{C, 4 * C}})
      rates.push_back(gemm_rate(M, N, K, seconds));
  }
  std::sort(rates.begin(), rates.end());
  p.gemm_peak = rates.back();
  p.gemm_typical = rates[rates.size() / 2];
  // The same four products of a width-128 layer for 64 tokens.
  std::vector<double> small;
  for (auto [N, K] : {std::pair{384, 128}, std::pair{128, 128}, std::pair{512, 128}, std::pair{128, 512}})
    small.push_back(gemm_rate(64, N, K, seconds));
  std::sort(small.begin(), small.end());
  p.gemm_small = small[small.size() / 2];
  // The peak is the best rate measured: a small product that ran faster (caches, a host that got
  // quieter) raises it, so no rate the profile gives exceeds it (an MFU above 100% otherwise).
  p.gemm_peak = std::max(p.gemm_peak, p.gemm_small);
  // Memory: a copy of 128 MiB (read and write counted), best of 5.
  {
    const size_t n = size_t(32) << 20;
    std::vector<float> src(n, 1.0f), dst(n, 0.0f);
    double best = 0;
    for (int k = 0; k < 5; ++k) {
      const auto t0 = Clock::now();
#pragma omp parallel for schedule(static)
      for (int64_t c = 0; c < 64; ++c) {
        const size_t chunk = n / 64;
        std::memcpy(dst.data() + size_t(c) * chunk, src.data() + size_t(c) * chunk, chunk * sizeof(float));
      }
      best = std::max(best, 2.0 * double(n) * sizeof(float) / since(t0));
    }
    p.memory_bw = best;
  }
  p.kernels = measure_kernels(seconds);
  p.linear = measure_linear(seconds);
  set_omp_threads(before);
  p.blocks = measure_blocks(threads, seconds);
  // The threads backend between two ranks: latency of 1 KiB all-reduces, bandwidth of 32 MiB ones.
  {
    comm::RunOptions ro;
    ro.threads_per_rank = 1;
    double lat = 0, bw = 0;
    comm::run_ranks(2, [&](comm::Comm& c) {
      std::vector<float> small(256, 1.0f), big(size_t(8) << 20, 1.0f);
      c.barrier();
      auto t0 = Clock::now();
      for (int i = 0; i < 200; ++i) c.all_reduce(small.data(), int64_t(small.size()), DType::f32);
      const double l = since(t0) / 200;
      c.barrier();
      t0 = Clock::now();
      for (int i = 0; i < 5; ++i) c.all_reduce(big.data(), int64_t(big.size()), DType::f32);
      const double b = 5.0 * double(big.size()) * sizeof(float) / since(t0);
      if (c.rank() == 0) lat = l, bw = b;
    }, ro);
    p.allreduce_latency = lat;
    p.allreduce_bw = bw;
  }
  // The OS's scheduling of ranks beyond `threads` cores: on a host with more, on its first
  // `threads` CPUs.
  const OnFirstCpus crowd(threads);
  // Ranks beyond the cores: a synchronisation waits for ranks the OS has not scheduled yet, and
  // for their wake-up. 2 x threads ranks of one thread each run a small product (a 256-token
  // layer's qkv) then a 1 KiB all-reduce, against the product alone: the difference per
  // iteration, less the all-reduce's own latency (the median of 3 pairs of runs).
  {
    comm::RunOptions ro;
    ro.threads_per_rank = 1;
    const int iters = std::max(20, int(seconds * 2000));
    auto per_iteration = [&](bool sync) {
      double secs = 0;
      comm::run_ranks(2 * threads, [&](comm::Comm& c) {
        QkvProduct work;
        std::vector<float> red(256, 1.0f);
        c.barrier();
        const auto t0 = Clock::now();
        for (int i = 0; i < iters; ++i) {
          work.run();
          if (sync) c.all_reduce(red.data(), int64_t(red.size()), DType::f32);
        }
        c.barrier();
        if (c.rank() == 0) secs = since(t0) / iters;
      }, ro);
      return secs;
    };
    std::vector<double> extra;
    for (int k = 0; k < 3; ++k) extra.push_back(per_iteration(true) - per_iteration(false));
    std::sort(extra.begin(), extra.end());
    p.crowded_sync = std::max(0.0, extra[1] - p.allreduce_latency);
  }
  p.crowded_wake = wake_latency(threads - 1, 100);
  p.wake = threads >= 2 ? wake_latency(threads - 2, 100) : p.crowded_wake;
  p.balance = balance_time(9);
  return p;
}

PipelineCheck check_crowded_pipeline(const HostProfile& p, int ranks, int micro, int products) {
  namespace pipe = parallel::pipeline;
  LOOM_CHECK(ranks >= 2 && micro >= 1 && products >= 1 && p.threads >= 1,
             "pipeline check: {} ranks, {} micro-batches, {} products and {} threads must be positive (ranks >= 2)",
             ranks, micro, products, p.threads);
  const OnFirstCpus crowd(p.threads);  // crowded as the profile's cores are, on a larger host too
  comm::RunOptions ro;
  ro.threads_per_rank = 1;
  PipelineCheck out;
  out.ranks = ranks, out.micro = micro;
  // A forward: `products` products, timed with `threads` ranks at once (the planner's block costs
  // are timed so too); a backward: twice as many.
  comm::run_ranks(p.threads, [&](comm::Comm& c) {
    QkvProduct work;
    work.run(3 * products);
    c.barrier();
    std::vector<double> t;
    for (int i = 0; i < 21; ++i) {
      const auto t0 = Clock::now();
      work.run(products);
      t.push_back(since(t0));
    }
    std::sort(t.begin(), t.end());
    if (c.rank() == 0) out.forward_s = t[t.size() / 2];
  }, ro);
  pipe::OpCosts oc;
  oc.forward = out.forward_s;
  oc.backward = 2 * out.forward_s;
  oc.backward_input = oc.backward_weight = out.forward_s;
  pipe::ScheduleSpec spec;
  spec.kind = pipe::Kind::one_f_one_b;
  spec.stages = ranks;
  spec.micro_batches = micro;
  const pipe::Schedule sch = pipe::generate(spec, oc);
  // The schedule's lists run as the executor runs them (sends posted, receives waited for, the
  // sends finished before the step's end), 1 KiB messages; the median of 9 steps after 3.
  std::vector<double> steps;
  comm::run_ranks(ranks, [&](comm::Comm& c) {
    QkvProduct work;
    std::vector<float> msg(256, 1.0f), in(256);
    for (int s = 0; s < 12; ++s) {
      std::vector<std::unique_ptr<comm::PendingSend>> sends;
      c.barrier();
      const auto t0 = Clock::now();
      for (const pipe::Instr& i : sch.ranks[size_t(c.rank())]) {
        switch (i.op) {
          case pipe::Op::forward: work.run(products); break;
          case pipe::Op::backward: work.run(2 * products); break;
          case pipe::Op::send_act:
          case pipe::Op::send_grad: sends.push_back(c.isend(msg.data(), 256, DType::f32, i.peer)); break;
          case pipe::Op::recv_act:
          case pipe::Op::recv_grad: c.recv(in.data(), 256, DType::f32, i.peer); break;
          default: break;
        }
      }
      for (auto& q : sends) q->wait();
      c.barrier();
      if (c.rank() == 0 && s >= 3) steps.push_back(since(t0));
    }
  }, ro);
  std::sort(steps.begin(), steps.end());
  out.measured_s = steps[steps.size() / 2];
  pipe::RankCosts rc;
  rc.chunk.assign(size_t(ranks), std::vector<pipe::OpCosts>(1, oc));
  rc.transfer = p.allreduce_latency;
  rc.capacity = p.threads;
  out.shared_s = pipe::simulate(sch, rc).makespan;
  rc.wake = p.wake, rc.crowded_wake = p.crowded_wake, rc.balance = p.balance;
  out.scheduled_s = pipe::simulate(sch, rc).makespan;
  return out;
}

}  // namespace loom::plan

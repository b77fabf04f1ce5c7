// loom calibrate: measure this host once (GEMM rate over transformer shapes, memory bandwidth, the
// threads backend's all-reduce, loom's kernels, linear layers and blocks) and cache it
// (src/plan/calibration.h), so every MFU `loom train` prints is a share of a rate measured on a
// quiet host, and `loom plan --cluster cpu` plans with this host's figures.
#include <omp.h>

#include <cstdio>
#include <memory>

#include "cli/command.h"
#include "plan/calibration.h"

namespace loom::cli {
namespace {

struct CalibrateArgs {
  int threads = 0;
  double seconds = 0.5;
};

Registrar reg{Command{
    "calibrate", "measure this host's GEMM rate, memory bandwidth, all-reduce and loom's other kernels, and cache them",
    [](CLI::App& sub) -> std::function<int()> {
      auto a = std::make_shared<CalibrateArgs>();
      sub.add_option("--threads", a->threads, "OpenMP threads per rank to measure with (default: all)")
          ->check(CLI::Range(1, 4096));
      sub.add_option("--seconds", a->seconds,
                     "least time per GEMM shape (and per kernel, linear layer and block point)")
          ->capture_default_str()
          ->check(number_in(0.01, 60.0));
      return [a]() -> int {
        const int threads = a->threads > 0 ? a->threads : omp_get_max_threads();
        const plan::HostProfile p = plan::calibrate_host(threads, a->seconds);
        std::printf("%s, %d cores, %d threads\n", p.cpu.c_str(), p.cores, p.threads);
        std::printf("  f32 GEMM over transformer shapes: best %.1f GFLOP/s, median %.1f GFLOP/s\n", p.gemm_peak / 1e9,
                    p.gemm_typical / 1e9);
        std::printf("  f32 GEMM of a width-128 layer for 64 tokens: median %.1f GFLOP/s\n", p.gemm_small / 1e9);
        std::printf("  memory copy: %.1f GB/s\n", p.memory_bw / 1e9);
        std::printf("  all-reduce, threads backend, 2 ranks: %.1f us latency, %.2f GB/s\n", p.allreduce_latency * 1e6,
                    p.allreduce_bw / 1e9);
        std::printf("  a synchronisation with %d one-thread ranks on %d threads' cores: %.1f us more\n", 2 * p.threads,
                    p.threads, p.crowded_sync * 1e6);
        std::printf("  a rank asleep in a receive runs %.0f us after its message (%.0f us when every core "
                    "computes); a thread sharing a core moves to an idle one after %.1f ms\n",
                    p.wake * 1e6, p.crowded_wake * 1e6, p.balance * 1e3);
        for (const auto& [name, k] : p.kernels)
          std::printf("  %-19s %7.2f us a call + %.3g ns per %s\n", name.c_str(), k.call * 1e6, k.unit * 1e9,
                      name.rfind("attention", 0) == 0 ? "FLOP" : name == "adamw" ? "parameter" : name == "crossentropy" ? "logit" : "element");
        for (const plan::BlockTime& b : p.blocks)
          std::printf("  %d rank%s at once, %4.0f tokens of width %3.0f: layer %.2f + %.2f ms, head %.2f + %.2f ms "
                      "(forward + backward)\n",
                      b.ranks, b.ranks == 1 ? " " : "s", b.tokens, b.width, b.layer_forward * 1e3,
                      b.layer_backward * 1e3, b.head_forward * 1e3, b.head_backward * 1e3);
        plan::save_profile(p);
        std::printf("cached in %s (loom train's MFU and loom plan --cluster cpu use it)\n",
                    plan::calibration_path().c_str());
        return 0;
      };
    }}};

}  // namespace
}  // namespace loom::cli

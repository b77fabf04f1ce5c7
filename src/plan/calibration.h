// This host's measured rates, cached across runs: the GEMM rate the MFU that `loom train` prints
// is a share of, and the `cpu` profile `loom plan` uses.
//
// `loom calibrate` measures, for the OpenMP threads a rank runs: the f32 GEMM rate over the
// matrix shapes of transformer layers (each repeated until two rounds agree within 2%; the best
// shape's rate is the peak, the median's share of it the efficiency), the memory bandwidth (copy),
// the threads backend's all-reduce latency and bandwidth between two ranks, and for the planner's
// cpu profile loom's own kernels, linear layers and blocks and the waits of ranks beyond the cores
// (the fields below). The cache, calibration.json under $LOOM_CACHE_DIR (else
// $XDG_CACHE_HOME/loom, else ~/.cache/loom), keeps one entry per CPU model, core count and thread
// count. A training run measures the GEMM rate briefly itself (it writes nothing to the cache) and
// takes the larger of that and the cached figure, so a run on a busy host does not divide by a
// rate measured while the host was busy. An entry whose numbers no measurement gives (a rate
// outside 1e6..1e16 per second, a time outside 0..100 s, a GEMM rate above the peak) is ignored as
// a missing one is; so is a cache that cannot be read.
#pragma once
#include <map>
#include <optional>
#include <string>

#include "plan/cluster.h"

namespace loom::plan {

struct HostProfile {
  std::string cpu;            // the CPU's model name (/proc/cpuinfo)
  int cores = 0;              // logical cores online
  int threads = 0;            // OpenMP threads the rates were measured with
  double gemm_peak = 0;       // FLOP/s, f32: the best transformer shape's sustained rate
  double gemm_typical = 0;    // FLOP/s, f32: the median shape's
  // FLOP/s, f32: the median of a small layer's products for one short micro-batch (64 tokens,
  // width 128): how much a product's size costs (the planner's size effect, Device::gemm_half).
  double gemm_small = 0;
  double memory_bw = 0;       // bytes/s, copy (read + write counted)
  double allreduce_latency = 0;    // seconds, threads backend, 2 ranks, small messages
  double allreduce_bw = 0;         // bytes/s of buffer reduced, large messages
  // Seconds each synchronisation (a collective, a received message) costs beyond its latency when
  // the host runs twice as many one-thread ranks as `threads` (ranks wait for peers the OS has
  // not scheduled).
  double crowded_sync = 0;
  // How the OS runs one-thread ranks, for the pipeline simulation (pipeline::RankCosts): seconds
  // from a message's post to its receiver, asleep in the receive, running again when a core is
  // idle (wake) or all `threads` cores compute (crowded_wake); and how long a thread that shares a
  // core stays there while another core is idle (balance). (These three and crowded_sync are
  // measured on the first `threads` CPUs the process may use.)
  double wake = 0;
  double crowded_wake = 0;
  double balance = 0;
  // loom's non-GEMM kernels, with `threads` threads: norm_forward and norm_backward (LayerNorm,
  // per element of [N, C]), gelu_forward and gelu_backward (per element), attention_forward and
  // attention_backward (per FLOP of the forward's 4 T C per token, causal masking not subtracted),
  // crossentropy (the fused softmax, loss and gradient, per logit), adamw (per parameter),
  // residual (an add of two [N, C] into a third, per element). Empty in a cache written before
  // they were measured.
  std::map<std::string, KernelCost> kernels;
  // loom's linear layers over a grid of tokens (64 to 4096) and widths (128 to 1024; tokens x width
  // at most 2^20): a layer's four products' forward and backward rates at each point, their
  // activations rotating over 64 MiB of buffers so that they come from memory (Device::linear).
  std::vector<LinearRate> linear;
  // loom's own chain (Device::blocks): a two-layer GPT's layer and head forward and backward at
  // 64, 256 and 1024 tokens x widths 128 and 384, for 1, 2, 4 ... `threads` ranks at once (up to
  // 8).
  std::vector<BlockTime> blocks;
  std::string source;         // "loom calibrate"
  std::string date;           // YYYY-MM-DD
};

std::string host_cpu_name();
int host_cores();
// The cache file's path (its directory need not exist).
std::string calibration_path();
// The cached entry of this host for `threads` threads, if any (an unreadable cache is ignored).
std::optional<HostProfile> cached_profile(int threads);
// Adds or replaces p's entry (same cpu, cores and threads) in the cache, written atomically.
void save_profile(const HostProfile& p);
// Measures this host with `threads` OpenMP threads (seconds: the least time per GEMM shape).
HostProfile calibrate_host(int threads, double seconds = 0.5);

// A pipeline of one-thread ranks on this host (1F1B, uniform stages whose forward is `products`
// of a 256-token layer's qkv products and backward twice that, 1 KiB messages over the threads
// backend) measured against the planner's simulation of it with the host's cores shared evenly
// (no wake-ups, at once balanced) and with p's measured scheduling (wake, crowded_wake, balance):
// what `loom bench pipeline-host` prints.
struct PipelineCheck {
  int ranks = 0, micro = 0;
  double forward_s = 0;    // a forward, timed with p.threads ranks at once
  double measured_s = 0;   // a step, the median of 9
  double shared_s = 0;     // simulated: the cores shared, no scheduling costs
  double scheduled_s = 0;  // simulated: with p's wake-ups and balancing
};
PipelineCheck check_crowded_pipeline(const HostProfile& p, int ranks, int micro, int products);

}  // namespace loom::plan

// `loom bench train --dp N [--zero S] [--offload]`: data-parallel training steps on synthetic
// tokens, ranks as threads: tokens/s at a fixed global batch, peak memory per rank by tag (params,
// grads, optimizer; host pool with offload) and how much gradient-reduction time was hidden behind
// backward.
#include <omp.h>

#include <chrono>
#include <cstdio>

#include "cli/bench_dp.h"
#include "cli/command.h"
#include "comm/threads.h"
#include "core/file.h"
#include "core/rng.h"
#include "model/gpt.h"
#include "parallel/data/data_parallel.h"

namespace loom::cli {

int bench_train_dp(const BenchDpOptions& o) {
  model::GPTConfig mc = model::gpt_preset(o.model);
  if (o.seq > mc.block_size) mc.block_size = o.seq;
  LOOM_CHECK(o.dp >= 1 && o.batch % o.dp == 0, "bench train: --batch {} must be divisible by --dp {}", o.batch, o.dp);
  const int64_t local = o.batch / o.dp;
  comm::RunOptions ro;
  std::vector<double> secs(static_cast<size_t>(o.dp));
  parallel::CommStats stats0;
  MemStats mem0, host0;
  std::string trace_json;
  comm::run_ranks(o.dp, [&](comm::Comm& c) {
    MemoryPool pool(fmt::format("cpu:{}", c.rank())), host(fmt::format("host:{}", c.rank()));
    model::GPT gpt(mc, pool, 1337);
    parallel::Trace trace(c.rank(), !o.trace.empty());
    parallel::DataParallelOptions dpo;
    dpo.zero = o.zero;
    dpo.offload = o.offload;
    dpo.host_pool = &host;
    dpo.bucket_bytes = std::max<int64_t>(1, int64_t(o.bucket_mb * 1024 * 1024));
    dpo.trace = trace.enabled() ? &trace : nullptr;
    parallel::DataParallel ddp(gpt, c, optim::AdamWConfig{}, dpo);
    Tensor x = Tensor::empty({local, o.seq}, DType::i32, MemTag::workspace, pool);
    for (int64_t i = 0; i < x.numel(); ++i)
      x.i32()[i] = int32_t(uniform_at(1, 1, uint64_t(c.rank() * x.numel() + i)) * float(mc.vocab_size));
    model::ForwardOptions fo;
    fo.fuse_backward = true;
    fo.dloss_scale = 1.0f / float(o.dp);
    std::chrono::steady_clock::time_point t0;
    for (int s = 0; s < o.warmup + o.steps; ++s) {
      if (s == o.warmup) {
        c.barrier();
        pool.reset_peaks();
        host.reset_peaks();
        ddp.reset_comm_stats();
        t0 = std::chrono::steady_clock::now();
      }
      ddp.zero_grad();
      gpt.forward(x, x, fo);
      gpt.backward();
      ddp.step(1e-4);
    }
    c.barrier();
    secs[size_t(c.rank())] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::string tj = o.trace.empty() ? "" : parallel::gather_trace(c, trace);
    if (c.rank() == 0) {
      stats0 = ddp.comm_stats();
      mem0 = pool.stats();
      host0 = host.stats();
      trace_json = tj;
    }
  }, ro);
  const double tps = double(o.batch * o.seq * o.steps) / secs[0];
  std::printf("model %s | dp %d | ZeRO %d%s | global batch %lld x %lld | %d threads per rank\n", o.model.c_str(), o.dp,
              o.zero, o.offload ? " + offload" : "", (long long)o.batch, (long long)o.seq,
              std::max(1, omp_get_max_threads() / o.dp));
  std::printf("%.0f tokens/s | %.1f ms/step\n", tps, 1e3 * secs[0] / o.steps);
  std::printf("peak per rank (rank 0): params %s | grads %s | optimizer %s | host: params %s, grads %s, optimizer %s\n",
              format_bytes(mem0.peak[size_t(MemTag::params)]).c_str(), format_bytes(mem0.peak[size_t(MemTag::grads)]).c_str(),
              format_bytes(mem0.peak[size_t(MemTag::optimizer)]).c_str(),
              format_bytes(host0.peak[size_t(MemTag::params)]).c_str(), format_bytes(host0.peak[size_t(MemTag::grads)]).c_str(),
              format_bytes(host0.peak[size_t(MemTag::optimizer)]).c_str());
  std::printf("gradient reduction %.1f ms/step, exposed %.1f ms/step, hidden behind backward %.0f%% | gathers %.1f ms/step\n",
              1e3 * stats0.reduce_busy_s / o.steps, 1e3 * stats0.reduce_wait_s / o.steps,
              stats0.reduce_busy_s > 0 ? 100 * stats0.hidden_s() / stats0.reduce_busy_s : 0.0,
              1e3 * stats0.gather_s / o.steps);
  if (!o.trace.empty()) {
    write_file_atomically(o.trace, trace_json);
    std::printf("wrote trace %s\n", o.trace.c_str());
  }
  return 0;
}

}  // namespace loom::cli

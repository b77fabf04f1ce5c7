// loom bench train: times training steps of a GPT-2 model on the CPU and reports tokens/s,
// ms/step, model-FLOPs utilisation against a GEMM peak measured in the same run, and the pool's
// peak bytes per tag beside what the model and optimiser declare.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "cli/bench_dp.h"
#include "core/threads.h"
#include "cli/command.h"
#include "core/memory.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "kernels/cpu/matmul.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "plan/calibration.h"
#include "train/config.h"

namespace loom::cli {
namespace {

struct BenchTrainOptions {
  std::string model = "gpt2-124m";
  int64_t batch = 4, seq = 256;
  int threads = 0;  // 0: OpenMP's default
  int steps = 5, warmup = 1;
  uint64_t seed = 1337;
  std::string precision = "f32";  // f32, or bf16: the linear layers' products (train.precision)
  double gemm_seconds = 1.0;
  // Data parallelism (ranks as threads): any of these selects the data-parallel benchmark.
  int dp = 1, zero = 0;
  bool offload = false;
  double bucket_mb = 25;
  std::string trace;
};

using clock_type = std::chrono::steady_clock;

double ms_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
}

int bench_train(const BenchTrainOptions& o) {
  model::GPTConfig cfg = model::gpt_preset(o.model);
  if (o.batch <= 0) throw Error(fmt::format("bench train: --batch must be positive, got {}", o.batch));
  // (As loom train does: the preset's positions grow to the sequence, model.block_size 0.)
  if (o.seq <= 0 || o.seq > (int64_t(1) << 20))
    throw Error(fmt::format("bench train: --seq must be in [1, 2^20], got {}", o.seq));
  cfg.block_size = std::max(cfg.block_size, int64_t(o.seq));
  if (o.steps <= 0 || o.warmup < 0)
    throw Error(fmt::format("bench train: --steps must be positive and --warmup non-negative"));
  if (o.threads < 0 || o.threads > train::max_threads())
    throw Error(fmt::format("bench train: --threads must be from 0 (OpenMP's default) to {} (8 per core of this "
                            "host), got {}", train::max_threads(), o.threads));
  if (!(o.gemm_seconds >= 0.01 && o.gemm_seconds <= 60))
    throw Error(fmt::format("bench train: --gemm-seconds must be from 0.01 to 60, got {}", o.gemm_seconds));
  if (o.precision != "f32" && o.precision != "bf16")
    throw Error(fmt::format("bench train: --precision must be f32 or bf16, got '{}'", o.precision));
  if (o.threads > 0) set_omp_threads(o.threads);
  const int threads = omp_get_max_threads();
  const int64_t B = o.batch, T = o.seq, C = cfg.n_embd, L = cfg.n_layer, V = cfg.vocab_size;

  std::printf("loom bench train: %s\n", cfg.str().c_str());
  std::printf("batch %lld x seq %lld = %lld tokens/step, %d threads, %d warm-up + %d timed steps\n", (long long)B,
              (long long)T, (long long)(B * T), threads, o.warmup, o.steps);
  std::fflush(stdout);
  // MFU against the rate of the products' own precision.
  const bool bf16 = o.precision == "bf16";
  const double peak = bf16 ? cpu::measure_bf16_gemm_peak_gflops(1536, o.gemm_seconds)
                           : cpu::measure_gemm_peak_gflops(1536, o.gemm_seconds);
  std::printf("GEMM peak (measured now, %s 1536^3, %d threads): %.1f GFLOP/s\n", bf16 ? "bf16" : "fp32", threads, peak);

  MemoryPool pool("bench");
  model::ModelLayout layout;
  layout.matmul = o.precision == "bf16" ? DType::bf16 : DType::f32;
  model::GPT gpt(cfg, pool, o.seed, layout);
  std::printf("precision %s (%s)\n", o.precision.c_str(),
              o.precision == "bf16" ? "the linear layers' products in bf16 with f32 accumulation" : "f32 throughout");
  optim::AdamWConfig oc;  // lr 6e-4, betas (0.9, 0.95), eps 1e-8, wd 0.1 on matrices, clip 1.0
  optim::AdamW opt(gpt.parameters(), oc, pool);

  // Synthetic batch: a random token sequence and its next tokens.
  MemoryPool io("bench-data");
  Tensor tokens = Tensor::empty({B, T}, DType::i32, MemTag::workspace, io);   // i32 [B, T]
  Tensor targets = Tensor::empty({B, T}, DType::i32, MemTag::workspace, io);  // i32 [B, T]
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t <= T; ++t) {
      int32_t id = int32_t(std::min<double>(double(V - 1), uniform_at(o.seed, 7, uint64_t(b * (T + 1) + t)) * double(V)));
      if (t < T) tokens.i32()[b * T + t] = id;
      if (t > 0) targets.i32()[b * T + t - 1] = id;
    }

  const int64_t n_nonemb = cfg.nonembedding_parameters(), Vp = cfg.padded_vocab();
  const double flops_per_token = cfg.flops_per_token(T);  // GPTConfig::flops_per_token's convention
  const double flops_per_step = flops_per_token * double(B * T);
  std::printf("parameters %lld (non-embedding %lld)\n", (long long)gpt.num_parameters(), (long long)n_nonemb);
  std::printf("model FLOPs/token = 6*N_nonemb + 6*C*V_padded + 12*L*C*T = %.4g + %.4g + %.4g = %.4g; %.1f GFLOP/step\n",
              6.0 * double(n_nonemb), 6.0 * double(C * Vp), 12.0 * double(L * C * T), flops_per_token,
              flops_per_step * 1e-9);

  std::vector<double> step_ms, fwd_ms, bwd_ms, opt_ms;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    auto t0 = clock_type::now();
    gpt.zero_grad();
    const float loss = gpt.forward(tokens, targets, {.fuse_backward = true});
    const double f = ms_since(t0);
    auto t1 = clock_type::now();
    gpt.backward();
    const double b = ms_since(t1);
    auto t2 = clock_type::now();
    optim::StepStats st = opt.step();
    const double u = ms_since(t2), total = ms_since(t0);
    const bool timed = s >= o.warmup;
    std::printf("%s %d: %.1f ms (forward %.1f, backward %.1f, adamw %.1f)  loss %.4f  grad norm %.3f\n",
                timed ? "step" : "warm-up", timed ? s - o.warmup + 1 : s + 1, total, f, b, u, double(loss),
                st.grad_norm);
    std::fflush(stdout);
    if (timed) {
      step_ms.push_back(total);
      fwd_ms.push_back(f);
      bwd_ms.push_back(b);
      opt_ms.push_back(u);
    }
  }
  auto mean = [](const std::vector<double>& v) { return std::accumulate(v.begin(), v.end(), 0.0) / double(v.size()); };
  const double ms = mean(step_ms);
  const double tok_s = double(B * T) / (ms * 1e-3);
  const double achieved = flops_per_step / (ms * 1e-3) * 1e-9;
  std::printf("\nms/step %.1f (min %.1f, max %.1f; forward %.1f, backward %.1f, adamw %.1f)\n", ms,
              *std::min_element(step_ms.begin(), step_ms.end()), *std::max_element(step_ms.begin(), step_ms.end()),
              mean(fwd_ms), mean(bwd_ms), mean(opt_ms));
  std::printf("tokens/s %.1f\n", tok_s);
  std::printf("model FLOPs %.1f GFLOP/s = MFU %.1f%% of the measured GEMM peak %.1f GFLOP/s\n", achieved,
              100.0 * achieved / peak, peak);

  // Memory: the pool's peaks against the declarations.
  const int64_t declared[kNumMemTags] = {gpt.param_bytes(), gpt.grad_bytes(), opt.state_bytes(),
                                         gpt.saved_activation_bytes(B, T), gpt.workspace_bytes(B, T, threads), 0};
  const char* what[kNumMemTags] = {"parameters (wte padded to the padded vocabulary)", "gradients",
                                   "AdamW exp_avg + exp_avg_sq", "saved activations (sum over the chain)",
                                   "backward scratch 4*B*T*(2C + wide) + attention scratch + linear scratch",
                                   "no communication"};
  MemStats stats = pool.stats();
  bool all_equal = true;
  int64_t declared_total = 0;
  std::printf("\nmemory by tag (pool '%s'): peak measured | declared\n", pool.name().c_str());
  for (int i = 0; i < kNumMemTags; ++i) {
    const bool eq = stats.peak[size_t(i)] == declared[i];
    all_equal &= eq;
    declared_total += declared[i];
    std::printf("  %-12s %12s | %12s  %s  %s\n", std::string(mem_tag_name(MemTag(i))).c_str(),
                format_bytes(stats.peak[size_t(i)]).c_str(), format_bytes(declared[i]).c_str(), eq ? "equal" : "DIFFERENT",
                what[i]);
  }
  std::printf("  %-12s %12s | %12s  (sum of the declarations)\n", "total", format_bytes(stats.total_peak).c_str(),
              format_bytes(declared_total).c_str());
  const int64_t attn_scratch = gpt.block(0).attention_workspace_bytes(B, T, threads);
  const int64_t linear_scratch = gpt.linear_workspace_bytes(B, T);
  const int64_t ws = gpt.workspace_bytes(B, T, threads);
  std::printf("workspace: %lld bytes = backward scratch %lld (dres [B,T,C], bufC [B,T,C], buf4C [B,T,wide = %lld] in "
              "f32) + attention scratch %lld (the larger of one forward and one backward call, %d threads) + linear "
              "scratch %lld (%s)\n",
              (long long)ws, (long long)(ws - attn_scratch - linear_scratch), (long long)model::wide_columns(cfg, 1),
              (long long)attn_scratch, threads, (long long)linear_scratch,
              linear_scratch ? "bf16 copies of the largest input and of blocks of at most 4096 weight rows and output-gradient "
                             "columns, and oneDNN's scratch"
                             : "none in f32");
  std::printf("RESULT model=%s batch=%lld seq=%lld threads=%d tokens_per_s=%.2f ms_per_step=%.1f "
              "gemm_peak_gflops=%.1f mfu=%.4f memory_matches=%d\n",
              cfg.name.c_str(), (long long)B, (long long)T, threads, tok_s, ms, peak, achieved / peak, all_equal);
  if (!all_equal) {
    std::fprintf(stderr, "loom bench train: measured peak memory differs from the declaration\n");
    return 2;
  }
  return 0;
}

// loom bench pipeline-host: pipelines of one-thread ranks, more of them than cores, against the
// planner's simulation of them (plan::check_crowded_pipeline), with this host's calibration.
int bench_pipeline_host(int threads) {
  if (threads <= 0) threads = omp_get_max_threads();
  if (threads > int(std::thread::hardware_concurrency()))
    throw Error(fmt::format("bench pipeline-host: --threads {} is more than this host's {} cores", threads,
                            std::thread::hardware_concurrency()));
  const auto p = plan::cached_profile(threads);
  if (!p || p->source != "loom calibrate")
    throw Error(fmt::format("bench pipeline-host: no `loom calibrate` profile for {} threads in {}: run `loom "
                            "calibrate{}` first", threads, plan::calibration_path(),
                            threads == omp_get_max_threads() ? "" : fmt::format(" --threads {}", threads)));
  std::printf("loom bench pipeline-host: %s, %d cores; the calibration of %s: a woken rank runs %.0f us after its "
              "message (%.0f us with every core busy), a shared core is balanced after %.1f ms\n",
              p->cpu.c_str(), threads, p->date.c_str(), p->wake * 1e6, p->crowded_wake * 1e6, p->balance * 1e3);
  std::printf("1F1B, uniform stages (backward = 2 forwards), one-thread ranks on %d cores; simulated with the cores "
              "alone and with the host's scheduling\n", threads);
  std::printf("%5s %5s %10s %10s %22s %22s\n", "ranks", "micro", "forward", "measured", "cores alone", "with scheduling");
  const int c = threads;
  struct Case {
    int ranks, micro, products;
  };
  const std::vector<Case> cases = {{2 * c, 2 * c, 8},  {2 * c, 2 * c, 24}, {2 * c, 2 * c, 48},
                                   {2 * c, 4 * c, 8},  {c + 1, 2 * c, 8},  {c, 2 * c, 8}};
  for (const Case& k : cases) {
    if (k.ranks < 2) continue;
    const plan::PipelineCheck r = plan::check_crowded_pipeline(*p, k.ranks, k.micro, k.products);
    auto err = [&](double s) { return 100.0 * (s / r.measured_s - 1.0); };
    std::printf("%5d %5d %7.2f ms %7.1f ms %9.1f ms (%+5.1f%%) %9.1f ms (%+5.1f%%)\n", r.ranks, r.micro,
                r.forward_s * 1e3, r.measured_s * 1e3, r.shared_s * 1e3, err(r.shared_s), r.scheduled_s * 1e3,
                err(r.scheduled_s));
  }
  return 0;
}

Registrar reg{Command{
    "bench", "benchmarks (train: time GPT-2 training steps on the CPU; pipeline-host: the planner's simulation of "
    "pipelines beyond the cores)", [](CLI::App& sub) -> std::function<int()> {
      sub.require_subcommand(1);
      auto o = std::make_shared<BenchTrainOptions>();
      CLI::App* train = sub.add_subcommand("train", "time training steps: tokens/s, ms/step, MFU, memory by tag");
      train->add_option("--model", o->model, "model preset (gpt2-tiny, gpt2-124m, gpt2-350m, ...)")
          ->capture_default_str();
      train->add_option("--batch", o->batch, "batch size B")->capture_default_str();
      train->add_option("--seq", o->seq, "sequence length T")->capture_default_str();
      train->add_option("--threads", o->threads, "OpenMP threads (0: the default)")->capture_default_str();
      train->add_option("--steps", o->steps, "timed steps")->capture_default_str();
      train->add_option("--warmup", o->warmup, "untimed steps first")->capture_default_str();
      train->add_option("--seed", o->seed, "initialisation and data seed")
          ->capture_default_str()
          ->transform(seed_validator());
      train->add_option("--precision", o->precision,
                        "f32, or bf16: the linear layers' products in bf16 with f32 accumulation (AVX512-BF16 or AMX)")
          ->capture_default_str();
      train->add_option("--gemm-seconds", o->gemm_seconds, "time spent measuring the GEMM peak")
          ->capture_default_str();
      train->add_option("--dp", o->dp, "data-parallel ranks (threads); > 1 times data-parallel steps")
          ->capture_default_str()
          ->check(CLI::Range(1, 1024));
      train->add_option("--zero", o->zero, "ZeRO stage 0-3 (with --dp)")->capture_default_str()->check(CLI::Range(0, 3));
      train->add_flag("--offload", o->offload, "ZeRO-Offload: optimizer state and update in the host pool");
      train->add_option("--bucket-mb", o->bucket_mb, "gradient bucket size in MiB (with --dp)")
          ->capture_default_str()
          ->check(number_in(0.001, 1 << 20));
      train->add_option("--trace", o->trace, "Chrome trace of every rank to FILE (with --dp)");
      auto host_threads = std::make_shared<int>(0);
      CLI::App* host = sub.add_subcommand(
          "pipeline-host", "pipelines of one-thread ranks beyond the cores against the planner's simulation of them");
      host->add_option("--threads", *host_threads, "the cores the ranks share (0: OpenMP's default)")
          ->check(CLI::Range(0, 1024));
      return [o, train, host, host_threads]() -> int {
        if (host->parsed()) return bench_pipeline_host(*host_threads);
        if (!train->parsed()) return 1;
        if (o->dp > 1 || o->zero > 0 || o->offload) {
          BenchDpOptions d;
          d.model = o->model;
          d.dp = o->dp;
          d.zero = o->zero;
          d.offload = o->offload;
          d.batch = o->batch;
          d.seq = o->seq;
          d.bucket_mb = o->bucket_mb;
          d.steps = o->steps;
          d.warmup = o->warmup;
          d.trace = o->trace;
          return bench_train_dp(d);
        }
        if (!o->trace.empty())
          throw Error("bench train: --trace traces the data-parallel benchmark: give it with --dp, --zero or --offload");
        if (train->parsed()) return bench_train(*o);
        return 1;
      };
    }}};

}  // namespace
}  // namespace loom::cli

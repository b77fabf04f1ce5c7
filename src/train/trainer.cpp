#include "train/trainer.h"
#include "train/run_util.h"

#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include "core/error.h"
#include "data/loader.h"
#include "data/tokenizer.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "comm/threads.h"
#include "parallel/data/data_parallel.h"
#include "parallel/data/trace.h"
#include "train/checkpoint.h"
#include "train/checkpoint_io.h"
#include "train/schedule.h"
#include "train/trainer_parallel.h"

namespace fs = std::filesystem;

namespace loom::train {

namespace {

// Everything one rank does. Rank 0 prints, writes metrics and checkpoints; every rank runs the
// same collectives in the same order (evaluation and samples included: ZeRO-3 gathers parameters
// inside forward). on_fail runs before any of this rank's objects are destroyed when it throws,
// so the other ranks are released at once (threads: the world is marked failed; mpi: the job is
// aborted) instead of waiting for the communicator's timeout.
TrainResult train_rank(const TrainConfig& cfg, const TrainOptions& opt, comm::Comm& world, const FaultInjection& fault,
                       const std::function<void(const std::string&)>& on_fail) {
  const int rank = world.rank(), dp = world.size();
  const bool lead = rank == 0;
  auto say = [&](const std::string& s) {
    if (lead && !opt.quiet) std::printf("%s\n", s.c_str()), std::fflush(stdout);
  };

  RunData run_data = open_run_data(cfg, opt.config_path);
  check_ranks_agree(world, cfg, run_data);  // before any other collective
  const std::string vocabulary = run_data.tokenizer ? run_data.tokenizer->fingerprint() : "";
  data::Loader& train = run_data.train;
  std::unique_ptr<data::Loader>& val = run_data.val;
  const model::GPTConfig mc = run_data.model;

  MemoryPool pool(fmt::format("cpu:{}", rank)), host_pool(fmt::format("host:{}", rank));
  model::GPT gpt(mc, pool, cfg.seed);
  const optim::AdamWConfig oc = adamw_config(cfg);
  parallel::Trace trace(rank, !opt.trace_path.empty());
  parallel::DataParallelOptions dpo;
  dpo.zero = int(cfg.zero);
  dpo.offload = cfg.offload;
  dpo.host_pool = &host_pool;
  dpo.bucket_bytes = std::max<int64_t>(1, int64_t(double(cfg.bucket_mb) * 1024 * 1024));
  dpo.trace = trace.enabled() ? &trace : nullptr;
  parallel::DataParallel ddp(gpt, world, oc, dpo);
  LrSchedule sched{cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps, cfg.lr_schedule};

  TrainResult res;
  try {
    // Checkpoints hold the full (gathered) parameters and moments in the single-device format,
    // so one written under any dp / ZeRO stage loads under any other.
    auto named = [&](const parallel::DataParallel::FullState& fs) {
      std::vector<NamedTensor> state;
      for (size_t i = 0; i < gpt.parameters().size(); ++i) {
        const std::string& n = gpt.parameters()[i]->spec.name;
        state.push_back({"param/" + n, ddp.param_view(fs.params, i)});
        state.push_back({"adam_m/" + n, ddp.param_view(fs.exp_avg, i)});
        state.push_back({"adam_v/" + n, ddp.param_view(fs.exp_avg_sq, i)});
      }
      return state;
    };

    fs::path out_dir(cfg.out_dir);
    if (lead) fs::create_directories(out_dir);
    // The writing rank holds the run directory for the whole run (a second run into it is refused).
    std::unique_ptr<RunDirLock> dir_lock = lead ? std::make_unique<RunDirLock>(out_dir.string()) : nullptr;
    std::string metrics_path = (out_dir / "metrics.jsonl").string();
    int64_t start_step = 0;
    if (opt.resume) {
      std::vector<std::string> notes;
      std::string ckpt = resume_checkpoint(cfg.out_dir, &notes);
      for (const std::string& n : notes) say("resume: " + n);
      if (ckpt.empty()) {
        say(fmt::format("resume: no checkpoint in {}, starting from step 0", cfg.out_dir));
      } else {
        CheckpointMeta meta = read_checkpoint_meta(ckpt);
        check_resume_checkpoint(ckpt, meta, cfg, mc, vocabulary);
        auto full = ddp.empty_full_state();
        load_checkpoint_tensors(ckpt, named(full));
        ddp.load_full_state(full, meta.optimizer_steps);
        start_step = meta.step;
        if (lead) truncate_metrics(metrics_path, start_step);
        say(fmt::format("resumed from {} (step {})", ckpt, start_step));
      }
    }
    world.barrier();  // rank 0 has prepared the output directory
    if (lead && start_step == 0 && fs::exists(metrics_path)) fs::remove(metrics_path);

    std::unique_ptr<data::Tokenizer> tok = lead ? std::move(run_data.tokenizer) : nullptr;

    // Rank r reads samples [r * local, (r + 1) * local) of every step's global batch, in
    // grad_accum micro-batches of mb.
    const int64_t local = cfg.batch_size / dp, mb = local / cfg.grad_accum, T = cfg.seq_len;
    const int64_t val_mb = cfg.batch_size / cfg.grad_accum;  // the single-device validation batch
    say(fmt::format("model {} | {:.2f}M parameters | dp {} ({}) | ZeRO {}{} | {} threads per rank", mc.str(),
                    double(gpt.num_parameters()) / 1e6, dp, world.backend(), cfg.zero, cfg.offload ? " + offload" : "",
                    omp_get_max_threads()));
    const double peak = job_gemm_peak(world);
    res.last_val_loss = NAN;
    res.unigram_val_loss = lead ? unigram_loss(train, val.get(), mc.vocab_size) : NAN;
    say(fmt::format("data {} | train {} tokens{} | unigram baseline loss {:.4f} | GEMM peak {:.1f} GFLOP/s",
                    cfg.data_dir, train.total_tokens(), val ? fmt::format(", val {} tokens", val->total_tokens()) : "",
                    res.unigram_val_loss, peak / 1e9));

    Tensor x = Tensor::empty({mb, T}, DType::i32, MemTag::workspace, pool);
    Tensor y = Tensor::empty({mb, T}, DType::i32, MemTag::workspace, pool);
    RunLog log(cfg, metrics_path, start_step, lead, opt.quiet, gpt.config().flops_per_token(T), peak,
               res.unigram_val_loss);

    // Each rank evaluates its share of every validation batch; the mean over ranks is the mean
    // of the single-device batches.
    auto evaluate = [&]() -> double {
      if (!val) return NAN;
      int64_t n = std::min(cfg.eval_batches, val->val_batches(val_mb));
      if (n == 0) return NAN;
      const int64_t vl = val_mb / dp;
      Tensor vx = Tensor::empty({vl, T}, DType::i32, MemTag::workspace, pool);
      Tensor vy = Tensor::empty({vl, T}, DType::i32, MemTag::workspace, pool);
      double sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        val->val_batch(i, val_mb, rank * vl, vl, vx.i32(), vy.i32());
        sum += gpt.forward(vx, vy);
      }
      gpt.release_activations();
      return ddp.sum_over_ranks(sum) / double(n * dp);
    };
    auto sample = [&](int64_t step) -> std::string {
      if (cfg.sample_tokens == 0) return "";
      // Every rank samples (ZeRO-3 forwards are collective), from rank 0's prompt.
      return sample_text(cfg, gpt, shared_sample_prompt(world, cfg, tok.get(), train, val.get()), step, tok.get());
    };
    auto checkpoint = [&](int64_t step) {
      auto full = ddp.gather_full_state();  // collective
      if (lead)
        save_checkpoint(out_dir.string(), checkpoint_meta(cfg, mc, step, ddp.optimizer_steps(), vocabulary),
                        named(full), cfg.keep_checkpoints);
    };

    pool.reset_peaks();
    host_pool.reset_peaks();
    ddp.reset_comm_stats();
    RunHooks hooks;
    hooks.step = [&](int64_t step, float lr) {
      ddp.zero_grad();
      double loss = 0;
      for (int64_t micro = 0; micro < cfg.grad_accum; ++micro) {
        train.train_batch(step, cfg.batch_size, rank * local + micro * mb, mb, x.i32(), y.i32());
        model::ForwardOptions fo;
        fo.fuse_backward = true;
        fo.dloss_scale = 1.0f / float(cfg.grad_accum * dp);
        ddp.set_last_micro(micro + 1 == cfg.grad_accum);
        loss += gpt.forward(x, y, fo);
        gpt.backward();
      }
      loss = ddp.sum_over_ranks(loss / double(cfg.grad_accum)) / double(dp);
      // A non-finite loss stops the run before the optimizer touches the weights.
      if (!std::isfinite(loss)) return RunHooks::StepOut{loss, 0.0};
      return RunHooks::StepOut{loss, ddp.step(lr).grad_norm};
    };
    hooks.evaluate = evaluate;
    hooks.sample = sample;
    hooks.checkpoint = checkpoint;
    run_steps(cfg, log, sched, fault, rank, dp, start_step, val != nullptr, hooks, res);
    for (int t = 0; t < kNumMemTags; ++t) {
      res.peak_bytes[size_t(t)] = pool.peak(MemTag(t));
      res.host_peak_bytes[size_t(t)] = host_pool.peak(MemTag(t));
    }
    const auto& cs = ddp.comm_stats();
    res.reduce_busy_s = cs.reduce_busy_s;
    res.reduce_exposed_s = cs.reduce_wait_s;
    res.gather_s = cs.gather_s;
    if (dp > 1)
      say(fmt::format("memory per rank (peak): params {} | grads {} | optimizer {}{} | gradient reduction {:.3f} s, "
                      "{:.3f} s exposed ({:.0f}% hidden behind backward) | parameter gathers {:.3f} s",
                      format_bytes(res.peak_bytes[size_t(MemTag::params)]),
                      format_bytes(res.peak_bytes[size_t(MemTag::grads)]),
                      format_bytes(res.peak_bytes[size_t(MemTag::optimizer)]),
                      cfg.offload ? fmt::format(" (host: optimizer {})", format_bytes(res.host_peak_bytes[size_t(MemTag::optimizer)])) : "",
                      cs.reduce_busy_s, cs.reduce_wait_s,
                      cs.reduce_busy_s > 0 ? 100.0 * cs.hidden_s() / cs.reduce_busy_s : 0.0, cs.gather_s));
    res.last_sample = sample(cfg.steps);
    if (!res.last_sample.empty()) say(fmt::format("--- sample ---\n{}\n---", res.last_sample));
    if (!opt.trace_path.empty()) {
      std::string json = parallel::gather_trace(world, trace);
      if (lead) {
        parallel::write_text_file(opt.trace_path, json);
        say(fmt::format("wrote trace {}", opt.trace_path));
      }
    }
    log.finish((out_dir / "loss.png").string(), fmt::format("loom: {} on {}", mc.name, cfg.data_dir));
  } catch (const std::exception& e) {
    on_fail(e.what());
    throw;
  }
  return res;
}

}  // namespace

TrainResult run_training(const TrainConfig& cfg, const TrainOptions& opt) {
  const std::string where = opt.config_path.empty() ? "config" : opt.config_path;
  if (cfg.device == "cuda") {
    cfg.validate_cuda(where);  // throws naming the field, and in a build without CUDA
    throw Error(fmt::format("{}: train.device = \"cuda\": run_training runs the CPU trainers; the GPU trainer is "
                            "train::run_training_cuda (train/trainer_cuda.h), which `loom train` runs for this device",
                            where));
  }
  LOOM_CHECK(cfg.device == "cpu", "{}: train.device: '{}' is not cpu or cuda", where, cfg.device);
  if (needs_mesh(cfg)) return run_training_mesh(cfg, opt);  // tp / sp / cp / pp: trainer_parallel.cpp
  const int dp = int(cfg.dp);
  const comm::CommOptions co = comm_options(cfg);
  const FaultInjection fault = FaultInjection::from_env(dp);
  if (cfg.comm == "mpi")
    return run_mpi_rank(cfg, where, dp, fmt::format("parallel.dp is {}", dp), co,
                        [&](comm::Comm& world, std::function<void(const std::string&)> on_fail) {
                          return train_rank(cfg, opt, world, fault, on_fail);
                        });
  // Ranks as threads: each gets its share of the cores (at least one).
  const int total_threads = cfg.threads > 0 ? int(cfg.threads) : omp_get_max_threads();
  const int per_rank = std::max(1, total_threads / dp);
  if (dp == 1) {
    omp_set_num_threads(per_rank);
    comm::ThreadWorld world(1, co);
    auto c = world.comm(0);
    return train_rank(cfg, opt, *c, fault, [](const std::string&) {});
  }
  comm::ThreadWorld world(dp, co);
  std::vector<TrainResult> results(static_cast<size_t>(dp));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(dp));
  comm::run_rank_threads(
      world,
      [&](int r) {
        try {
          auto c = world.comm(r);
          omp_set_num_threads(per_rank);
          results[size_t(r)] =
              train_rank(cfg, opt, *c, fault, [&](const std::string& what) { world.fail(r, what); });
        } catch (const std::exception& e) {
          world.fail(r, e.what());
          errors[size_t(r)] = std::current_exception();
        } catch (...) {
          world.fail(r, "unknown exception");
          errors[size_t(r)] = std::current_exception();
        }
      },
      fmt::format("{}: parallel.dp {}", where, dp));
  int failed = world.failed_rank();
  if (failed >= 0) {
    try {
      std::rethrow_exception(errors[size_t(failed)]);
    } catch (const std::exception& e) {
      throw Error(fmt::format("rank {} of {} failed: {}", failed, dp, e.what()));
    }
  }
  return results[0];
}

}  // namespace loom::train

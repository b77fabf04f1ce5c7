#include "train/trainer.h"
#include "train/run_util.h"

#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/loader.h"
#include "data/tokenizer.h"
#include "kernels/cpu/matmul.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "comm/threads.h"
#include "parallel/data/data_parallel.h"
#include "parallel/data/trace.h"
#include "train/checkpoint.h"
#include "train/checkpoint_io.h"
#include "train/plot.h"
#include "train/sample.h"
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
  data::Loader& train = run_data.train;
  std::unique_ptr<data::Loader>& val = run_data.val;
  const model::GPTConfig mc = run_data.model;

  MemoryPool pool(fmt::format("cpu:{}", rank)), host_pool(fmt::format("host:{}", rank));
  model::GPT gpt(mc, pool, cfg.seed);
  optim::AdamWConfig oc;
  oc.lr = cfg.lr;
  oc.beta1 = cfg.beta1;
  oc.beta2 = cfg.beta2;
  oc.eps = cfg.eps;
  oc.weight_decay = cfg.weight_decay;
  oc.max_norm = cfg.grad_clip;
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
    std::string metrics_path = (out_dir / "metrics.jsonl").string();
    int64_t start_step = 0;
    if (opt.resume) {
      std::string ckpt = latest_checkpoint(cfg.out_dir);
      if (ckpt.empty()) {
        say(fmt::format("resume: no checkpoint in {}, starting from step 0", cfg.out_dir));
      } else {
        CheckpointMeta meta = read_checkpoint_meta(ckpt);
        check_resume_checkpoint(ckpt, meta, cfg, mc);
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

    std::unique_ptr<data::Tokenizer> tok;
    std::string tok_dir = cfg.tokenizer_dir.empty() ? cfg.data_dir : cfg.tokenizer_dir;
    if (lead && fs::exists(fs::path(tok_dir) / "encoder.json") && fs::exists(fs::path(tok_dir) / "vocab.bpe"))
      tok = std::make_unique<data::Tokenizer>(data::Tokenizer::from_dir(tok_dir));

    // Rank r reads samples [r * local, (r + 1) * local) of every step's global batch, in
    // grad_accum micro-batches of mb.
    const int64_t local = cfg.batch_size / dp, mb = local / cfg.grad_accum, T = cfg.seq_len;
    const int64_t val_mb = cfg.batch_size / cfg.grad_accum;  // the single-device validation batch
    const double tokens_per_step = double(cfg.batch_size * T);
    const double flops_per_token = 6.0 * double(gpt.num_nonembedding_parameters()) +
                                   6.0 * double(mc.n_embd) * double(mc.padded_vocab()) +
                                   6.0 * double(mc.n_layer) * double(mc.n_embd) * double(T);  // causal attention
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
    std::ofstream metrics;
    if (lead) metrics.open(metrics_path, std::ios::app);
    std::vector<std::pair<double, double>> train_pts, val_pts;
    if (lead && start_step > 0) read_loss_points(metrics_path, train_pts, val_pts);  // the steps before the resume

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
    auto sample_text = [&](int64_t step) -> std::string {
      if (cfg.sample_tokens == 0) return "";
      std::vector<int32_t> prompt;
      if (tok && !cfg.sample_prompt.empty()) prompt = tok->encode(cfg.sample_prompt);
      // Every rank samples (ZeRO-3 forwards are collective); the prompt must not depend on the
      // tokenizer only rank 0 loaded, so it is broadcast.
      int32_t np = int32_t(prompt.size());
      world.broadcast(&np, 1, DType::i32, 0);
      prompt.resize(size_t(np));
      if (np > 0) world.broadcast(prompt.data(), np, DType::i32, 0);
      if (prompt.empty()) {  // the first tokens of the validation split (or of training)
        std::vector<int32_t> xi(static_cast<size_t>(T)), yi(static_cast<size_t>(T));
        if (val && val->val_batches(1) > 0) val->val_batch(0, 1, 0, 1, xi.data(), yi.data());
        else train.train_batch(0, 1, 0, 1, xi.data(), yi.data());
        prompt.assign(xi.begin(), xi.begin() + std::min<int64_t>(8, T));
      }
      SampleOptions so;
      so.max_new_tokens = cfg.sample_tokens;
      so.temperature = cfg.sample_temperature;
      so.top_k = cfg.sample_top_k;
      so.seed = cfg.seed + uint64_t(step);
      auto out = sample_recompute(gpt, prompt, so);
      if (!tok) {
        std::string s;
        for (int32_t t : out) s += std::to_string(t) + " ";
        return s;
      }
      return tok->decode(prompt) + tok->decode(out);
    };
    auto checkpoint = [&](int64_t step) {
      auto full = ddp.gather_full_state();  // collective
      if (!lead) return;
      CheckpointMeta meta;
      meta.step = step;
      meta.optimizer_steps = ddp.optimizer_steps();
      meta.data_position = step;
      meta.seed = cfg.seed;
      meta.model = model::gpt_config_manifest(mc);
      meta.config_toml = config_to_toml(cfg);
      save_checkpoint(out_dir.string(), meta, named(full), cfg.keep_checkpoints);
    };

    pool.reset_peaks();
    host_pool.reset_peaks();
    ddp.reset_comm_stats();
    auto t_start = Clock::now();
    double window_time = 0, train_time = 0;
    int64_t window_steps = 0;
    for (int64_t step = start_step; step < cfg.steps; ++step) {
      fault.maybe_fire(rank, dp, step + 1);
      auto t0 = Clock::now();
      float lr = sched.at(step);
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
      LOOM_CHECK(std::isfinite(loss), "step {}: the loss is {} (diverged); lower optim.lr or raise optim.warmup_steps",
                 step + 1, loss);
      optim::StepStats st = ddp.step(lr);
      double dt = seconds_since(t0);
      train_time += dt;
      window_time += dt;
      ++window_steps;
      int64_t done = step + 1;
      res.last_loss = loss;
      res.steps_done = done;
      double tps = tokens_per_step / dt;
      double mfu = tps * flops_per_token / peak;  // model FLOPs over the GEMM peak measured at start
      if (lead) {
        nlohmann::json j = {{"step", done}, {"loss", loss}, {"lr", lr}, {"grad_norm", st.grad_norm},
                            {"tokens_per_s", tps}, {"mfu", mfu}, {"time_s", seconds_since(t_start)}};
        metrics << j.dump() << "\n";
        train_pts.push_back({double(done), loss});
      }
      bool eval_now = cfg.eval_every > 0 && (done % cfg.eval_every == 0 || done == cfg.steps);
      if (eval_now && val) {
        double vl = evaluate();
        res.last_val_loss = vl;
        if (lead) metrics << nlohmann::json{{"step", done}, {"val_loss", vl}}.dump() << "\n";
        val_pts.push_back({double(done), vl});
        say(fmt::format("step {:>6} | val loss {:.4f} (unigram {:.4f})", done, vl, res.unigram_val_loss));
      }
      if (lead) metrics.flush();
      if (done % cfg.log_every == 0 || done == cfg.steps || done == start_step + 1) {
        double avg = window_time / double(window_steps);
        double eta = avg * double(cfg.steps - done);
        say(fmt::format("step {:>6}/{} | loss {:.4f} | lr {:.2e} | norm {:.3f} | {:.0f} tok/s | MFU {:.1f}% | ETA {}",
                        done, cfg.steps, loss, lr, st.grad_norm, tokens_per_step / avg,
                        100 * tokens_per_step / avg * flops_per_token / peak, human_time(eta)));
        window_time = 0;
        window_steps = 0;
      }
      if (cfg.sample_every > 0 && done % cfg.sample_every == 0 && done != cfg.steps) {
        std::string text = sample_text(done);
        say(fmt::format("--- sample at step {} ---\n{}\n---", done, text));
      }
      if ((cfg.checkpoint_every > 0 && done % cfg.checkpoint_every == 0) || done == cfg.steps) checkpoint(done);
    }
    res.train_seconds = train_time;
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
    if (lead) metrics.close();
    res.last_sample = sample_text(cfg.steps);
    if (!res.last_sample.empty()) say(fmt::format("--- sample ---\n{}\n---", res.last_sample));
    if (!opt.trace_path.empty()) {
      std::string json = parallel::gather_trace(world, trace);
      if (lead) {
        parallel::write_text_file(opt.trace_path, json);
        say(fmt::format("wrote trace {}", opt.trace_path));
      }
    }
    if (lead)
      say(write_loss_curve((out_dir / "loss.png").string(), metrics_path,
                           fmt::format("loom: {} on {}", mc.name, cfg.data_dir), train_pts, val_pts,
                           res.unigram_val_loss));
  } catch (const std::exception& e) {
    on_fail(e.what());
    throw;
  }
  return res;
}

}  // namespace

TrainResult run_training(const TrainConfig& cfg, const TrainOptions& opt) {
  const std::string where = opt.config_path.empty() ? "config" : opt.config_path;
  if (needs_mesh(cfg)) return run_training_mesh(cfg, opt);  // tp / sp / cp / pp: trainer_parallel.cpp
  const int dp = int(cfg.dp);
  comm::CommOptions co;
  co.timeout = std::chrono::milliseconds(std::max<int64_t>(1, std::llround(double(cfg.timeout_s) * 1000.0)));
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
  std::vector<std::thread> threads;
  for (int r = 0; r < dp; ++r)
    threads.emplace_back([&, r] {
      try {
        auto c = world.comm(r);
        omp_set_num_threads(per_rank);
        results[size_t(r)] = train_rank(cfg, opt, *c, fault, [&](const std::string& what) { world.fail(r, what); });
      } catch (const std::exception& e) {
        world.fail(r, e.what());
        errors[size_t(r)] = std::current_exception();
      } catch (...) {
        world.fail(r, "unknown exception");
        errors[size_t(r)] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
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

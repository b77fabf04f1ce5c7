// Host code only (CUDA runtime calls, no kernels): compiled by the C++ compiler, like
// comm/nccl_comm.cu, so it shares the C++20 trainer headers.
#include "train/trainer_cuda.h"

#include <cuda_runtime.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cuda/allocator.cuh"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/backend.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cudnn_attention.cuh"
#include "kernels/cuda/matmul.cuh"
#include "parallel/data/flat_layout.h"
#include "comm/mpi_comm.h"
#include "comm/nccl_comm.h"
#include "comm/threads.h"
#include "model/gpt.h"
#include "train/step_runner.h"
#include "train/checkpoint.h"
#include "train/run_util.h"
#include "train/schedule.h"

namespace fs = std::filesystem;

namespace loom::train {

namespace {

using parallel::sum_over_ranks;

// The model's training state in the checkpoint layout: for each parameter, in the model's order,
// "param/<name>", "adam_m/<name>", "adam_v/<name>" as host f32 tensors of its logical shape.
std::vector<NamedTensor> host_state(model::GPT& gpt, MemoryPool& host) {
  std::vector<NamedTensor> state;
  for (const model::Parameter* p : gpt.parameters()) {
    const model::ParamSpec& s = p->spec;
    state.push_back({"param/" + s.name, Tensor::empty(s.shape, DType::f32, MemTag::workspace, host)});
    state.push_back({"adam_m/" + s.name, Tensor::empty(s.shape, DType::f32, MemTag::workspace, host)});
    state.push_back({"adam_v/" + s.name, Tensor::empty(s.shape, DType::f32, MemTag::workspace, host)});
  }
  return state;
}

void copy_into(const Tensor& t, const std::vector<float>& v) {
  LOOM_CHECK(int64_t(v.size()) == t.numel(), "GPU state: {} values for a tensor of {}", v.size(), t.numel());
  std::memcpy(t.f32(), v.data(), v.size() * sizeof(float));
}

void download_state(train::StepRunner& run, const std::vector<NamedTensor>& state) {
  const auto& params = run.model().parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& n = params[i]->spec.name;
    copy_into(state[3 * i].tensor, run.parameter(n));
    copy_into(state[3 * i + 1].tensor, run.exp_avg(n));
    copy_into(state[3 * i + 2].tensor, run.exp_avg_sq(n));
  }
}

void upload_state(train::StepRunner& run, const std::vector<NamedTensor>& state) {
  const auto& params = run.model().parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& n = params[i]->spec.name;
    run.set_parameter(n, state[3 * i].tensor.f32());
    run.set_exp_avg(n, state[3 * i + 1].tensor.f32());
    run.set_exp_avg_sq(n, state[3 * i + 2].tensor.f32());
  }
}

// One rank of the GPU trainer: the whole model replica on `device`, the rank's share of every
// batch (rank r of dp takes sequences r * B / dp .. (r + 1) * B / dp of the global batch, as the
// CPU trainers do), gradients summed over the replicas by `dcomm` (null with dp = 1).
TrainResult train_cuda_rank(const TrainConfig& cfg, const TrainOptions& opt, const std::string& where,
                            comm::Comm& world, int device, const FaultInjection& fault) {
  const int rank = world.rank(), dp = world.size();
  const bool lead = rank == 0;
  auto say = [&](const std::string& s) {
    if (lead && !opt.quiet) std::printf("%s\n", s.c_str()), std::fflush(stdout);
  };
  LOOM_CUDA_CHECK(cudaSetDevice(device));

  RunData run_data = open_run_data(cfg, opt.config_path);
  check_ranks_agree(world, cfg, run_data);  // before any other collective
  const std::string vocabulary = run_data.tokenizer ? run_data.tokenizer->fingerprint() : "";
  data::Loader& train = run_data.train;
  std::unique_ptr<data::Loader>& val = run_data.val;
  const model::GPTConfig mc = run_data.model;
  // Sequences per rank, per micro-batch, and in a validation batch (the CPU trainers' shapes).
  const int64_t local = cfg.batch_size / dp, mb = local / cfg.grad_accum, val_mb = cfg.batch_size / cfg.grad_accum;
  const int64_t T = cfg.seq_len;

  MemoryPool& pool = cuda::device_pool();
  MemoryPool host_pool("host");
  const AttnKernel attention = attn_kernel_from_name(cfg.cuda_attention);
  if (attention == AttnKernel::cudnn && !cuda::cudnn_available())
    throw Error(fmt::format("{}: train.cuda_attention: cudnn needs loom built with cuDNN (CMake did not find libcudnn)",
                            where));
  // The one model (model/gpt.h) on this rank's CUDA backend, its steps run by a StepRunner.
  cuda::CudaBackend be({.device_index = device, .pool = &pool, .attention = attention});
  model::GPT gpt(mc, be, cfg.seed);
  StepRunner run(gpt, {.B = mb, .T = T, .graphs = cfg.cuda_graph, .beta1 = cfg.beta1, .beta2 = cfg.beta2,
                       .eps = cfg.eps, .weight_decay = cfg.weight_decay, .grad_clip = cfg.grad_clip});
  // The attention kernel for the step's shape, chosen (and, for cuDNN, planned) now so that it
  // can be named below.
  const AttnShape attn_shape = static_cast<const model::TransformerBlock*>(gpt.chain().at(1))->attention_shape(mb, T);
  if (mc.n_layer > 0) be.prepare_attention(DType::bf16, attn_shape);
  LrSchedule sched{cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps, cfg.lr_schedule};

  // The gradients' collective, on the model's stream (ordered after the backward's kernels).
  std::unique_ptr<comm::Comm> dcomm;
  if (dp > 1) {
    comm::DeviceCommOptions dco;
    dco.path = cfg.comm == "nccl" ? comm::DevicePath::nccl : comm::DevicePath::automatic;
    dco.device = device;
    dco.stream = be.stream();
    dcomm = comm::make_device_comm(world.split(0, rank), dco);  // collective
  }

  TrainResult res;
  fs::path out_dir(cfg.out_dir);
  if (lead) fs::create_directories(out_dir);
  // The writing rank holds the run directory for the whole run (a second run into it is refused).
  std::unique_ptr<RunDirLock> dir_lock = lead ? std::make_unique<RunDirLock>(out_dir.string()) : nullptr;
  const std::string metrics_path = (out_dir / "metrics.jsonl").string();
  int64_t start_step = 0, optimizer_steps = 0;
  if (opt.resume) {
    // Every rank reads the checkpoint: the replicas start equal.
    std::vector<std::string> notes;
    const std::string ckpt = resume_checkpoint(cfg.out_dir, &notes);
    for (const std::string& n : notes) say("resume: " + n);
    if (ckpt.empty()) {
      say(fmt::format("resume: no checkpoint in {}, starting from step 0", cfg.out_dir));
    } else {
      const CheckpointMeta meta = read_checkpoint_meta(ckpt);
      check_resume_checkpoint(ckpt, meta, cfg, mc, vocabulary);
      std::vector<NamedTensor> state = host_state(gpt, host_pool);
      load_checkpoint_tensors(ckpt, state);
      upload_state(run, state);
      start_step = meta.step;
      optimizer_steps = meta.optimizer_steps;
      if (lead) truncate_metrics(metrics_path, start_step);
      say(fmt::format("resumed from {} (step {})", ckpt, start_step));
    }
  }
  if (lead && start_step == 0 && fs::exists(metrics_path)) fs::remove(metrics_path);
  world.barrier();  // rank 0 has prepared the output directory

  std::unique_ptr<data::Tokenizer> tok = lead ? std::move(run_data.tokenizer) : nullptr;
  cudaDeviceProp prop{};
  LOOM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  say(fmt::format("model {} | {:.2f}M parameters | cuda:{} {}{} | micro-batch {} x {}, grad_accum {} | {} attention "
                  "| {}",
                  mc.str(), double(gpt.num_parameters()) / 1e6, device, prop.name,
                  dp > 1 ? fmt::format(" | dp {} ({} processes, gradients reduced by {})", dp, world.backend(),
                                       comm::device_path_name(comm::device_comm_path(*dcomm)))
                         : "",
                  mb, T, cfg.grad_accum,
                  mc.n_layer > 0 ? std::string(attn_kernel_name(be.attention_kernel(attn_shape))) : "no",
                  cfg.cuda_graph ? "CUDA graphs" : "no CUDA graphs"));
  if (!be.attention_note().empty())
    say(fmt::format("train.cuda_attention auto: flash, as cuDNN's attention could not be set up: {}",
                    be.attention_note()));
  const double peak = job_gemm_peak(world, [&] { return cuda::measure_gemm_peak_bf16(be.blas(), be.stream()); });
  res.last_val_loss = NAN;
  res.unigram_val_loss = lead ? unigram_loss(train, val.get(), mc.vocab_size) : NAN;
  say(fmt::format("data {} | train {} tokens{} | unigram baseline loss {:.4f} | bf16 GEMM peak {:.1f} TFLOP/s{}",
                  cfg.data_dir, train.total_tokens(), val ? fmt::format(", val {} tokens", val->total_tokens()) : "",
                  res.unigram_val_loss, peak / 1e12, dp > 1 ? " (all ranks)" : ""));

  std::vector<int32_t> x(size_t(mb * T)), y(size_t(mb * T));  // i32 [mb, T]
  RunLog log(cfg, metrics_path, start_step, lead, opt.quiet, mc.flops_per_token(T), peak, res.unigram_val_loss);

  // The mean loss over the first eval_batches validation batches of the CPU trainers' shape
  // (batch_size / grad_accum sequences, this rank's share of each), averaged over the ranks.
  auto evaluate = [&]() -> double {
    if (!val) return NAN;
    const int64_t n = std::min(cfg.eval_batches, val->val_batches(val_mb));
    if (n == 0) return NAN;
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      val->val_batch(i, val_mb, rank * mb, mb, x.data(), y.data());
      sum += run.forward(x.data(), y.data());
    }
    return sum_over_ranks(world, sum) / double(n * dp);
  };
  // Samples run on a CPU model (train/sample.h) with a copy of the current weights. Every rank
  // samples, as in the CPU data-parallel trainer: the replicas hold the same weights, so they
  // draw the same text, and no rank waits for rank 0's sampling in the next step's collectives
  // (where parallel.timeout_s would count it). The prompt is rank 0's (it alone loaded the
  // tokenizer), broadcast.
  std::unique_ptr<MemoryPool> cpu_pool;
  std::unique_ptr<model::GPT> cpu_model;
  auto sample = [&](int64_t step) -> std::string {
    if (cfg.sample_tokens == 0) return "";
    if (!cpu_model) {
      cpu_pool = std::make_unique<MemoryPool>("cpu:sample");
      cpu_model = std::make_unique<model::GPT>(mc, *cpu_pool, cfg.seed);
    }
    for (model::Parameter* p : cpu_model->parameters()) copy_into(p->value, run.parameter(p->spec.name));
    return sample_text(cfg, *cpu_model, shared_sample_prompt(world, cfg, tok.get(), train, val.get()), step,
                       tok.get());
  };
  // Rank 0 writes; the barrier keeps every rank from starting the next step (and perhaps failing
  // in it, which ends the job) before the checkpoint is on disk.
  auto checkpoint = [&](int64_t step) {
    if (lead) {
      std::vector<NamedTensor> state = host_state(gpt, host_pool);
      download_state(run, state);
      save_checkpoint(out_dir.string(), checkpoint_meta(cfg, mc, step, optimizer_steps, vocabulary), state,
                      cfg.keep_checkpoints);
    }
    world.barrier();
  };

  pool.reset_peaks();
  RunHooks hooks;
  hooks.step = [&](int64_t step, float lr) {
    RunHooks::StepOut st;
    if (cfg.grad_accum == 1 && dp == 1) {
      train.train_batch(step, cfg.batch_size, 0, mb, x.data(), y.data());
      st.loss = run.train_step(x.data(), y.data(), lr, optimizer_steps + 1);
      st.grad_norm = run.last_grad_norm();
    } else {
      run.zero_grad();
      for (int64_t micro = 0; micro < cfg.grad_accum; ++micro) {
        train.train_batch(step, cfg.batch_size, rank * local + micro * mb, mb, x.data(), y.data());
        st.loss += run.accumulate(x.data(), y.data());
      }
      st.loss /= double(cfg.grad_accum);
      if (dp > 1) st.loss = sum_over_ranks(world, st.loss) / double(dp);
      // A non-finite loss stops the run before the optimizer touches the weights, as on the CPU
      // (every rank sees the same mean loss, so every rank stops).
      if (!std::isfinite(st.loss)) return st;
      // The replicas' gradient sums added; the update, its clipping and the norm are then the
      // mean gradient's over every micro-batch of every rank, as on the CPU.
      // (One collective over the model's one gradient buffer, on the backend's stream.)
      if (dcomm)
        dcomm->all_reduce(gpt.flat_gradients().raw(), gpt.flat_gradients().numel(), DType::f32, comm::ReduceOp::sum);
      st.grad_norm = run.optimizer_step(lr, optimizer_steps + 1, 1.0f / float(cfg.grad_accum * dp));
    }
    ++optimizer_steps;
    return st;
  };
  hooks.evaluate = evaluate;
  hooks.sample = sample;
  hooks.checkpoint = checkpoint;
  run_steps(cfg, log, sched, fault, rank, dp, start_step, val != nullptr, hooks, res);
  for (int t = 0; t < kNumMemTags; ++t) res.peak_bytes[size_t(t)] = pool.peak(MemTag(t));
  say(fmt::format("GPU memory{} (peak): params {} | grads {} | optimizer {} | activations {} | workspace {}",
                  dp > 1 ? " of rank 0" : "", format_bytes(res.peak_bytes[size_t(MemTag::params)]),
                  format_bytes(res.peak_bytes[size_t(MemTag::grads)]),
                  format_bytes(res.peak_bytes[size_t(MemTag::optimizer)]),
                  format_bytes(res.peak_bytes[size_t(MemTag::activations)]),
                  format_bytes(res.peak_bytes[size_t(MemTag::workspace)])));
  res.last_sample = sample(cfg.steps);
  if (!res.last_sample.empty()) say(fmt::format("--- sample ---\n{}\n---", res.last_sample));
  log.finish((out_dir / "loss.png").string(), fmt::format("loom: {} on {} (cuda)", mc.name, cfg.data_dir));
  return res;
}

// The number of visible GPUs; throws when there is none.
int visible_devices(const std::string& where) {
  int devices = 0;
  const cudaError_t derr = cudaGetDeviceCount(&devices);
  if (derr != cudaSuccess || devices == 0) {
    cudaGetLastError();
    throw Error(fmt::format("{}: train.device = \"cuda\" but no CUDA device is visible ({})", where,
                            derr != cudaSuccess ? cudaGetErrorString(derr) : "the device count is 0"));
  }
  return devices;
}

}  // namespace

TrainResult run_training_cuda(const TrainConfig& cfg, const TrainOptions& opt) {
  const std::string where = opt.config_path.empty() ? "config" : opt.config_path;
  LOOM_CHECK(cfg.device == "cuda", "{}: train.device is '{}', not cuda", where, cfg.device);
  cfg.validate_cuda(where);
  LOOM_CHECK(opt.trace_path.empty(), "--trace: the GPU trainer (train.device = \"cuda\") writes no trace");
  const int dp = int(cfg.dp);
  const comm::CommOptions co = comm_options(cfg);
  const FaultInjection fault = FaultInjection::from_env(dp);
  if (cfg.comm == "mpi" || cfg.comm == "nccl") {
    // One process per rank; a host's processes take its GPUs in turn (several share one when
    // there are more processes than GPUs: their gradients then go through host memory).
    return run_mpi_rank(cfg, where, dp, fmt::format("parallel.dp is {}", dp), co,
                        [&](comm::Comm& world, std::function<void(const std::string&)> on_fail) {
                          try {
#ifdef LOOM_HAVE_MPI
                            const int local = comm::mpi_local_rank();
#else
                            const int local = 0;  // (run_mpi_rank refuses first)
#endif
                            const int device = local % visible_devices(where);
                            return train_cuda_rank(cfg, opt, where, world, device, fault);
                          } catch (const std::exception& e) {
                            on_fail(e.what());
                            throw;
                          }
                        });
  }
  // threads: one rank (validate_cuda), on the current device.
  const int devices = visible_devices(where);
  int device = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&device));
  LOOM_CHECK(device < devices, "cuda: current device {} of {}", device, devices);
  if (cfg.threads > 0) omp_set_num_threads(int(cfg.threads));
  comm::ThreadWorld world(1, co);
  auto c = world.comm(0);
  return train_cuda_rank(cfg, opt, where, *c, device, fault);
}

}  // namespace loom::train

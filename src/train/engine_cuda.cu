// The training engine on GPUs (train.device = "cuda", in builds with CUDA; train/engine.h), run
// by the one training loop (train/trainer.cpp). Host code only (CUDA runtime calls, no kernels):
// compiled by the C++ compiler, like comm/nccl_comm.cu, so it shares the C++20 trainer headers.
//
//   - the one model (model/gpt.h) on a CUDA backend (bf16 compute, or f16 under train.precision
//     fp16; f32 master weights and AdamW moments), its steps run by train::StepRunner (captured as
//     CUDA graphs and replayed);
//   - fp16: dynamic loss scaling (train/loss_scale.h) around the step runner's loss scale: a step
//     whose scaled gradients overflow (the norm is not finite, the loss is) is skipped by the update
//     kernel and reported as an overflow, and the scale halves; the scale is in the metrics and
//     the checkpoints;
//   - (the layouts with tensor / sequence parallelism, ZeRO or offload run the mesh engine,
//     train/engine.h's make_mesh_engine, on the rank's GPU: make_cuda_engine below);
//   - data parallelism over parallel.dp processes (parallel.comm mpi or nccl, under mpirun; the
//     threads backend runs one rank): each holds a whole replica on the GPU local rank % GPUs of
//     its host, trains on its share of every batch (the CPU engines' split), and the replicas'
//     gradients are summed by a device communicator (comm/nccl_comm.h: NCCL when the build has
//     it and every process has a GPU of its own, else staged through host memory; parallel.comm
//     nccl requires NCCL) before the update, which every replica then applies alike;
//   - one micro-batch shape B x T, B = train.batch_size / (parallel.dp x train.grad_accum),
//     T = data.seq_len; with grad_accum 1 and one rank each step replays one graph (forward,
//     backward, update); else the gradients are zeroed, a forward + backward graph that
//     accumulates is replayed once per micro-batch, the ranks' sums are added, and the update runs
//     on them times 1 / (grad_accum x dp);
//   - validation: forward-only passes over the CPU engines' validation batches (each rank its
//     share); samples: the weights copied into a CPU model::GPT, sampled as on the CPU;
//   - checkpoints in the CPU format (train/checkpoint.h): the f32 master weights and both
//     moments, so a GPU checkpoint loads in `loom generate` and resumes on the CPU, and a CPU
//     checkpoint resumes here;
//   - MFU against the GEMM rate of the job's GPUs in the compute dtype, measured at start by every
//     rank at once and summed (cuda::measure_gemm_peak; ranks sharing a GPU share its rate).
// Not bit-identical from run to run: the token-embedding gradient and flash attention's dq are
// summed with f32 atomics (kernels/cuda/embedding.cuh, attention.cuh), so a resumed run matches
// the uninterrupted one to rounding.
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "comm/mpi_comm.h"
#include "comm/nccl_comm.h"
#include "core/dtype.h"
#include "core/error.h"
#include "kernels/cuda/allocator.cuh"
#include "kernels/cuda/backend.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cudnn_attention.cuh"
#include "kernels/cuda/matmul.cuh"
#include "model/gpt.h"
#include "parallel/data/flat_layout.h"
#include "train/engine.h"
#include "train/loss_scale.h"
#include "train/run_util.h"
#include "train/step_runner.h"

namespace loom::train {

namespace {

using parallel::sum_over_ranks;

// The GPU of this process: with MPI processes, a host's processes take its GPUs in turn (several
// share one when there are more processes than GPUs: their gradients then go through host
// memory); otherwise the current device.
int rank_device(const TrainConfig& cfg, const std::string& where) {
  int devices = 0;
  const cudaError_t derr = cudaGetDeviceCount(&devices);
  if (derr != cudaSuccess || devices == 0) {
    cudaGetLastError();
    throw Error(fmt::format("{}: train.device = \"cuda\" but no CUDA device is visible ({})", where,
                            derr != cudaSuccess ? cudaGetErrorString(derr) : "the device count is 0"));
  }
  if (cfg.comm == "mpi" || cfg.comm == "nccl") {
#ifdef LOOM_HAVE_MPI
    return comm::mpi_local_rank() % devices;
#endif
  }
  int device = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&device));
  LOOM_CHECK(device < devices, "cuda: current device {} of {}", device, devices);
  return device;
}

void copy_into(const Tensor& t, const std::vector<float>& v) {
  LOOM_CHECK(int64_t(v.size()) == t.numel(), "GPU state: {} values for a tensor of {}", v.size(), t.numel());
  std::memcpy(t.f32(), v.data(), v.size() * sizeof(float));
}

class CudaEngine : public Engine {
 public:
  explicit CudaEngine(const EngineArgs& a)
      : cfg_(a.cfg), mc_(a.model), world_(a.comms["dp"]), train_(a.train), device_(rank_device(a.cfg, a.where)),
        be_(backend(a, device_)), gpt_(a.model, *be_, a.cfg.seed),
        run_(gpt_, {.B = micro_batch(a.cfg, a.comms["dp"].size()), .T = a.cfg.seq_len, .graphs = a.cfg.cuda_graph,
                    .beta1 = a.cfg.beta1, .beta2 = a.cfg.beta2, .eps = a.cfg.eps,
                    .weight_decay = a.cfg.weight_decay, .grad_clip = a.cfg.grad_clip}),
        host_("host") {
    if (a.cfg.run_precision() == "fp16")
      scaler_ = std::make_unique<LossScaler>(a.cfg.loss_scale_init, a.cfg.loss_scale_window, a.cfg.loss_scale_min);
    const int dp = world_.size();
    local_ = cfg_.batch_size / dp;
    mb_ = micro_batch(cfg_, dp);
    x_.resize(size_t(mb_ * cfg_.seq_len));
    y_.resize(size_t(mb_ * cfg_.seq_len));
    // The attention kernel for the step's shape, chosen (and, for cuDNN, planned) now so that it
    // can be named in the header.
    if (mc_.n_layer > 0) {
      attn_shape_ = gpt_.block(0).attention_shape(mb_, cfg_.seq_len);
      be_->prepare_attention(be_->compute_dtype(), attn_shape_);
    }
    // The gradients' collective, on the model's stream (ordered after the backward's kernels).
    if (dp > 1) {
      comm::DeviceCommOptions dco;
      dco.path = cfg_.comm == "nccl" ? comm::DevicePath::nccl : comm::DevicePath::automatic;
      dco.device = device_;
      dco.stream = be_->stream();
      dcomm_ = comm::make_device_comm(world_.split(0, world_.rank()), dco);  // collective
    }
  }

  static int64_t micro_batch(const TrainConfig& cfg, int dp) { return cfg.batch_size / dp / cfg.grad_accum; }

  // The GEMM rate of the rank's GPU, its operands (three 4096^2 buffers) allocated above
  // train.memory_limit: a measurement at the start, not part of what a step holds.
  static double measure_peak(cuda::CudaBackend& be) {
    MemoryPool& pool = be.pool();
    const int64_t limit = pool.limit();
    pool.set_limit(0, "train.memory_limit");
    double peak = 0;
    try {
      peak = cuda::measure_gemm_peak(be.blas(), be.stream(), be.compute_dtype());
    } catch (...) {
      pool.set_limit(limit, "train.memory_limit");
      throw;
    }
    pool.set_limit(limit, "train.memory_limit");
    return peak;
  }

  static std::unique_ptr<cuda::CudaBackend> backend(const EngineArgs& a, int device) {
    LOOM_CUDA_CHECK(cudaSetDevice(device));
    const AttnKernel attention = attn_kernel_from_name(a.cfg.cuda_attention);
    if (attention == AttnKernel::cudnn && !cuda::cudnn_available())
      throw Error(fmt::format("{}: train.cuda_attention: cudnn needs loom built with cuDNN (CMake did not find "
                              "libcudnn)",
                              a.where));
    // A pool of the backend's own (not the process's device pool): the mesh engine's ranks may be
    // threads sharing the GPU, each with its own stream, and a pool frees a block for reuse at
    // once, ordered with its own stream's work only. Each rank's peaks are then its own too.
    auto be = std::make_unique<cuda::CudaBackend>(
        BackendOptions{.device_index = device,
                       .pool = nullptr,
                       .attention = attention,
                       .compute = a.cfg.run_precision() == "fp16" ? DType::f16 : DType::bf16});
    // Every allocation of the rank's device memory is checked against the limit before it is made.
    be->pool().set_limit(int64_t(a.cfg.memory_limit), "train.memory_limit");
    return be;
  }

  std::string describe() const override {
    cudaDeviceProp prop{};
    LOOM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    const int dp = world_.size();
    return fmt::format("cuda:{} {}{} | micro-batch {} x {}, grad_accum {} | {} attention | {}", device_, prop.name,
                       dp > 1 ? fmt::format(" | dp {} ({} processes, gradients reduced by {})", dp, world_.backend(),
                                            comm::device_path_name(comm::device_comm_path(*dcomm_)))
                              : "",
                       mb_, cfg_.seq_len, cfg_.grad_accum,
                       mc_.n_layer > 0 ? std::string(attn_kernel_name(be_->attention_kernel(attn_shape_))) : "no",
                       cfg_.cuda_graph ? "CUDA graphs" : "no CUDA graphs") +
           (scaler_ ? fmt::format(" | f16 compute, dynamic loss scaling (from {:g}, or a resumed checkpoint's; "
                                  "doubling after {} clean steps)",
                                  cfg_.loss_scale_init, cfg_.loss_scale_window)
                    : "");
  }

  std::vector<std::string> notes() const override {
    if (be_->attention_note().empty()) return {};
    return {fmt::format("train.cuda_attention auto: flash, as cuDNN's attention could not be set up: {}",
                        be_->attention_note())};
  }

  double gemm_peak(comm::Comm& world) override {
    return job_gemm_peak(world, [&] { return measure_peak(*be_); });
  }
  std::string peak_name() const override {
    const std::string dt(dtype_name(be_->compute_dtype()));
    return world_.size() > 1 ? dt + " GEMM peak (all ranks)" : dt + " GEMM peak";
  }

  StepOut step(int64_t step, float lr) override {
    const int dp = world_.size();
    StepOut st;
    const float scale = scaler_ ? float(scaler_->step_scale()) : 1.0f;
    if (scaler_) st.loss_scale = scale;
    if (cfg_.grad_accum == 1 && dp == 1) {
      train_.train_batch(step, cfg_.batch_size, 0, mb_, x_.data(), y_.data());
      st.loss = run_.train_step(x_.data(), y_.data(), lr, optimizer_steps_ + 1, scale);
      st.grad_norm = run_.last_grad_norm();
    } else {
      run_.zero_grad();
      for (int64_t micro = 0; micro < cfg_.grad_accum; ++micro) {
        train_.train_batch(step, cfg_.batch_size, world_.rank() * local_ + micro * mb_, mb_, x_.data(), y_.data());
        st.loss += run_.accumulate(x_.data(), y_.data(), scale);
      }
      st.loss /= double(cfg_.grad_accum);
      if (dp > 1) st.loss = sum_over_ranks(world_, st.loss) / double(dp);
      // A non-finite loss stops the run before the optimizer touches the weights, as on the CPU
      // (every rank sees the same mean loss, so every rank stops).
      if (!std::isfinite(st.loss)) {
        st.skipped = true;  // (no update has run)
        return st;
      }
      // The replicas' gradient sums added (one collective over the model's one gradient buffer,
      // on the backend's stream); the update, its clipping and the norm are then the mean
      // gradient's over every micro-batch of every rank, as on the CPU.
      if (dcomm_)
        dcomm_->all_reduce(gpt_.flat_gradients().raw(), gpt_.flat_gradients().numel(), DType::f32, comm::ReduceOp::sum);
      st.grad_norm = run_.optimizer_step(lr, optimizer_steps_ + 1, 1.0f / (float(cfg_.grad_accum * dp) * scale));
    }
    // The update kernel leaves parameters and moments as they were when the norm is not finite
    // (kernels/cuda/adamw.cu): the step was skipped, and AdamW's step count stays. Under fp16 a
    // finite loss with such a norm is the scaled gradients' overflow (the same on every rank: the
    // norm is the summed gradients'): the scale halves.
    const bool finite = std::isfinite(st.grad_norm);
    if (scaler_ && std::isfinite(st.loss)) scaler_->update(!finite, fmt::format("step {}", step + 1));
    if (!finite) {
      st.skipped = true;
      st.overflow = scaler_ && std::isfinite(st.loss);
      return st;
    }
    ++optimizer_steps_;
    return st;
  }

  // Each rank its share (of the micro-batch's size) of every validation batch, averaged over the
  // ranks.
  double evaluate(data::Loader& val, int64_t n, int64_t val_mb) override {
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      val.val_batch(i, val_mb, world_.rank() * mb_, mb_, x_.data(), y_.data());
      sum += run_.forward(x_.data(), y_.data());
    }
    return sum_over_ranks(world_, sum) / double(n * world_.size());
  }

  // The replicas are equal: rank r downloads and writes the parameters i with i % ranks == r, so
  // the ranks share the writing.
  CheckpointPart checkpoint_part() override {
    CheckpointPart out;
    out.optimizer_steps = optimizer_steps_;
    if (scaler_) {
      out.loss_scale = scaler_->scale();
      out.loss_scale_clean = scaler_->clean_steps();
    }
    const auto& ps = gpt_.parameters();
    for (size_t i = size_t(world_.rank()); i < ps.size(); i += size_t(world_.size())) {
      const model::ParamSpec& s = ps[i]->spec;
      const std::pair<const char*, std::vector<float>> kinds[] = {{"param/", run_.parameter(s.name)},
                                                                  {"adam_m/", run_.exp_avg(s.name)},
                                                                  {"adam_v/", run_.exp_avg_sq(s.name)}};
      for (const auto& [kind, v] : kinds) {
        out.storage.push_back(v);
        out.slices.push_back({kind + s.name, 0, s.numel(), out.storage.back().data()});
      }
    }
    return out;
  }

  // Every rank reads the checkpoint: the replicas start equal.
  void load(CheckpointReader& ckpt, int64_t optimizer_steps) override {
    std::vector<float> v;
    for (const model::Parameter* p : gpt_.parameters()) {
      const model::ParamSpec& s = p->spec;
      v.resize(size_t(s.numel()));
      ckpt.read("param/" + s.name, 0, s.numel(), v.data());
      run_.set_parameter(s.name, v.data());
      ckpt.read("adam_m/" + s.name, 0, s.numel(), v.data());
      run_.set_exp_avg(s.name, v.data());
      ckpt.read("adam_v/" + s.name, 0, s.numel(), v.data());
      run_.set_exp_avg_sq(s.name, v.data());
    }
    optimizer_steps_ = optimizer_steps;
  }

  void load_loss_scale(double scale, int64_t clean_steps) override {
    if (scaler_) scaler_->restore(scale, clean_steps);
  }

  bool poison(const std::string& kind) override {
    if (kind != "overflow") return false;
    LOOM_CHECK(scaler_, "LOOM_FAULT_INJECT kind=overflow needs train.precision = \"fp16\" (loss scaling)");
    scaler_->inject_overflow();
    return true;
  }

  // Every rank samples from a CPU copy of its weights, as in the CPU data-parallel runs: the
  // replicas hold the same weights, so they draw the same text, and no rank waits for rank 0's
  // sampling in the next step's collectives.
  std::vector<int32_t> sample(const std::vector<int32_t>& prompt, const SampleOptions& opt) override {
    if (!cpu_model_) {
      cpu_pool_ = std::make_unique<MemoryPool>("cpu:sample");
      cpu_model_ = std::make_unique<model::GPT>(mc_, *cpu_pool_, cfg_.seed);
    }
    for (model::Parameter* p : cpu_model_->parameters()) copy_into(p->value, run_.parameter(p->spec.name));
    return sample_recompute(*cpu_model_, prompt, opt);
  }

  MemoryPool& pool() override { return be_->pool(); }

  std::string summary(TrainResult& res) override {
    return fmt::format("workspace {} (GPU)", format_bytes(res.peak_bytes[size_t(MemTag::workspace)]));
  }

  void write_trace(comm::Comm&, const std::string&) override {
    LOOM_FAIL("--trace: train.device = \"cuda\" writes no trace");
  }

 private:
  const TrainConfig& cfg_;
  model::GPTConfig mc_;
  comm::Comm& world_;  // the dp group (the whole world: the GPU engine runs data parallelism alone)
  data::Loader& train_;
  int device_ = 0;
  std::unique_ptr<cuda::CudaBackend> be_;
  model::GPT gpt_;
  StepRunner run_;
  MemoryPool host_;
  std::unique_ptr<comm::Comm> dcomm_;
  std::unique_ptr<LossScaler> scaler_;  // train.precision fp16
  AttnShape attn_shape_;
  int64_t local_ = 0, mb_ = 0, optimizer_steps_ = 0;
  std::vector<int32_t> x_, y_;  // i32 [mb, T]
  std::unique_ptr<MemoryPool> cpu_pool_;
  std::unique_ptr<model::GPT> cpu_model_;
};

}  // namespace

// Whole replicas over dp run on the replica engine above; tensor / sequence parallelism, ZeRO
// and offload on the mesh engine (train/engine.h) over this rank's GPU.
std::unique_ptr<Engine> make_cuda_engine(const EngineArgs& a) {
  if (!a.cfg.cuda_mesh()) return std::make_unique<CudaEngine>(a);
  const int device = rank_device(a.cfg, a.where);
  std::unique_ptr<cuda::CudaBackend> be = CudaEngine::backend(a, device);
  be->require_nccl(a.cfg.comm == "nccl");  // (else NCCL where every rank has a GPU of its own)
  cuda::CudaBackend* raw = be.get();
  cudaDeviceProp prop{};
  LOOM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  DeviceMesh d;
  d.gemm_peak = [raw] { return CudaEngine::measure_peak(*raw); };
  d.peak_name = std::string(dtype_name(raw->compute_dtype())) + " GEMM peak";
  d.device = fmt::format("cuda:{} {}", device, prop.name);
  d.backend = std::move(be);
  d.host_allocator = &cuda::pinned_host_allocator();
  return make_mesh_engine(a, std::move(d));
}

}  // namespace loom::train

// Registration (train/engine.h); the anchor keeps this file in every program that links loom_cuda.
extern "C" {
int loom_cuda_engine_anchor = [] {
  loom::train::register_engine("cuda", loom::train::make_cuda_engine);
  return 0;
}();
}

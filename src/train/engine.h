// One rank's model, optimizer and step under a layout on a device, as the one training loop
// (train/trainer.cpp: data, schedule, progress line, validation, samples, metrics, checkpoints,
// resume, failure naming) drives it. The CPU's engines (every layout of the mesh) live in
// trainer.cpp; a device's engine registers itself by train.device from its own file (CUDA's:
// train/engine_cuda.cu, in builds with CUDA).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/backend.h"
#include "core/memory.h"
#include "data/loader.h"
#include "model/config.h"
#include "model/gpt.h"
#include "parallel/mesh.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/run_util.h"
#include "train/sample.h"
#include "train/trainer.h"

namespace loom::train {

// This rank's part of a checkpoint: slices of the full tensors (train/checkpoint.h) that point
// into the engine's state, or into `storage` (host copies of state held elsewhere); valid until
// the next step. Over all ranks the slices cover every tensor once.
struct CheckpointPart {
  std::vector<Slice> slices;
  std::vector<std::vector<float>> storage;
  int64_t optimizer_steps = 0;
  double loss_scale = 0;         // train.precision fp16: the loss scaler's state (0: none)
  int64_t loss_scale_clean = 0;
};

class Engine {
 public:
  virtual ~Engine() = default;
  // "model ... | <describe> (<comm>, N ranks) | ..." in the run's header.
  virtual std::string describe() const = 0;
  // Lines the run prints after its header (notes on choices made for the user), if any.
  virtual std::vector<std::string> notes() const { return {}; }
  // The job's GEMM rate in FLOP/s for MFU, and what it is ("GEMM peak", "bf16 GEMM peak", "f16
  // GEMM peak");
  // collective over world.
  virtual double gemm_peak(comm::Comm& world) = 0;
  virtual std::string peak_name() const { return "GEMM peak"; }
  // One optimizer step on training batch `step` at learning rate lr; the mean loss of the global
  // batch (every rank).
  virtual StepOut step(int64_t step, float lr) = 0;
  // Mean validation loss of n single-device batches of val_mb sequences, on every rank (collective).
  virtual double evaluate(data::Loader& val, int64_t n, int64_t val_mb) = 0;
  // This rank's slices of every parameter and both AdamW moments, and the optimizer's step count
  // (not collective; every rank writes its part of the checkpoint).
  virtual CheckpointPart checkpoint_part() = 0;
  // The inverse, on every rank: this rank's part of every parameter and of both AdamW moments,
  // read from the checkpoint (only the elements it holds), and the optimizer's step count (not
  // collective).
  virtual void load(CheckpointReader& ckpt, int64_t optimizer_steps) = 0;
  // After load: the loss scaler's state the checkpoint kept (train.precision fp16; engines
  // without loss scaling, and checkpoints without one, leave it).
  virtual void load_loss_scale(double scale, int64_t clean_steps) { (void)scale, (void)clean_steps; }
  // Collective: the tokens that continue `prompt` (the same on every rank), drawn on the mesh
  // itself: no rank assembles the weights.
  virtual std::vector<int32_t> sample(const std::vector<int32_t>& prompt, const SampleOptions& opt) = 0;
  // The pools whose peaks the run reports (the model's, and the host pool of offloaded state).
  virtual MemoryPool& pool() = 0;
  virtual MemoryPool* host_pool() { return nullptr; }
  // After the run: more of the summary line ("" for none), and the result's counters.
  virtual std::string summary(TrainResult& res) { (void)res; return ""; }
  // Collective: writes the trace of the run (rank 0 writes the file).
  virtual void write_trace(comm::Comm& world, const std::string& path) = 0;
  // Testing aid (LOOM_FAULT_INJECT kind=nan | nan_weight): the next step's gradients, or this
  // rank's weights from now on, get a NaN. false: the engine has no such aid.
  virtual bool poison(const std::string& kind) { (void)kind; return false; }
};

struct EngineArgs {
  const TrainConfig& cfg;
  const TrainOptions& opt;
  const std::string& where;  // the config, for messages
  const model::GPTConfig& model;
  parallel::MeshComms& comms;
  data::Loader& train;
};
using EngineFactory = std::unique_ptr<Engine> (*)(const EngineArgs& a);

// A rank's device for the mesh engine (make_mesh_engine): its backend (owned by the engine from
// then on), this rank's GEMM rate in the compute dtype (FLOP/s, measured when the run asks) and
// its name, and the device's name for the run's header.
struct DeviceMesh {
  std::unique_ptr<Backend> backend;
  std::function<double()> gemm_peak;
  std::string peak_name;  // e.g. "bf16 GEMM peak"
  std::string device;     // e.g. "cuda:0 NVIDIA H100 80GB HBM3"
  // Called with the rank's host pool once the engine has made it (before the first step).
  std::function<void(MemoryPool& host)> use_host_pool;
  // The host pool's memory (an offloaded optimizer's state and the staging of checkpoints): a
  // GPU's page-locked host memory, so its transfers run at the link's rate; null: ordinary host
  // memory.
  Allocator* host_allocator = nullptr;
};

// The CPU's mesh engine (train/trainer.cpp: dp x tp (+ sp) with ZeRO and offload over one chain of
// blocks, parallel::DataParallel) on a device backend: what a device's engine hands the layouts
// its own path does not run. Its buffers are in the device's memory; tokens, the host pool's
// offloaded state and checkpoints' staging in host memory.
std::unique_ptr<Engine> make_mesh_engine(const EngineArgs& a, DeviceMesh device);

// The engine of train.device = "cuda" (train/engine_cuda.cu, in builds with CUDA).
std::unique_ptr<Engine> make_cuda_engine(const EngineArgs& a);

// Registers the engine of train.device `device` (from a static initialiser in its file).
void register_engine(const std::string& device, EngineFactory factory);
// Whether this program has an engine for train.device `device`.
bool engine_available(const std::string& device);

}  // namespace loom::train

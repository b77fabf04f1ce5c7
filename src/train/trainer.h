// The training loop, on one device or data-parallel over dp ranks (threads of this process, or one
// process each under mpirun with parallel.comm = mpi), with ZeRO stages and offload: deterministic batches, LR schedule, gradient accumulation,
// clipping, AdamW, periodic validation, text samples, checkpoints (with bit-identical resume),
// a live progress line, metrics as JSONL and a loss-curve PNG at the end. The same loop on GPUs
// (train.device = "cuda", data-parallel) is train/trainer_cuda.h's run_training_cuda, in builds with CUDA only;
// `loom train` picks it by train.device, and run_training refuses "cuda" naming the field.
// Testing aid: LOOM_FAULT_INJECT="rank=R,step=S,kind=throw|exit|kill" makes rank R throw, _Exit(3) or SIGKILL itself at the start of step S.
#pragma once
#include <cstdint>
#include <functional>
#include <array>
#include <string>

#include "core/memory.h"

#include "train/config.h"

namespace loom::train {

struct TrainOptions {
  bool resume = false;        // continue from out_dir/latest when it exists
  bool quiet = false;         // no progress lines (tests)
  std::string config_path;    // for messages
  std::string trace_path;     // Chrome trace of every rank ("" = none)
};

struct TrainResult {
  int64_t steps_done = 0;
  double last_loss = 0;
  double last_val_loss = 0;   // NaN when never evaluated
  double unigram_val_loss = 0;
  std::string last_sample;
  // Rank 0's peak bytes per pool tag over the training steps (device pool, and host pool for
  // offloaded optimizer state), indexed by MemTag.
  std::array<int64_t, kNumMemTags> peak_bytes{}, host_peak_bytes{};
  // Gradient reduction on rank 0 over the run: time on the communication thread, and the part
  // the compute thread waited for (the rest was hidden behind backward).
  double reduce_busy_s = 0, reduce_exposed_s = 0, gather_s = 0;
  double train_seconds = 0;   // wall time of the training steps
};

TrainResult run_training(const TrainConfig& cfg, const TrainOptions& opt);

}  // namespace loom::train

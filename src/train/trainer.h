// The training loop, the one for every device and layout: deterministic batches, LR schedule,
// gradient accumulation, clipping, AdamW, periodic validation, text samples, checkpoints (with
// bit-identical resume), a live progress line, metrics as JSONL and a loss-curve PNG at the end.
// Ranks are threads of this process (parallel.comm = threads) or one process each under mpirun
// (mpi, or nccl for GPU ranks). What runs a step is an engine (train/engine.h):
//   - CPU, the mesh pp x dp x cp x tp (Mesh::standard): data parallelism over dp (ZeRO 0-3,
//     offload, gradient buckets reduced during backward) composed with tensor, sequence and
//     context parallelism (model::GPT over the tp and cp groups, reduced over dp x cp); or
//     pipeline parallelism (parallel::pipeline::PipelineExecutor, train.grad_accum micro-batches
//     under parallel.schedule) with dp (ZeRO 0 or 1) and tp / sp / cp inside each stage;
//   - CUDA (train.device = "cuda", in builds with CUDA; train/engine_cuda.cu): the model on one
//     GPU per rank, steps as CUDA graphs, data parallelism over GPU processes.
// Rank 0 prints and writes metrics.jsonl, validation losses and the loss PNG. Checkpoints are
// sharded (train/checkpoint.h): every rank writes its own slices of the parameters and AdamW
// moments, rank 0 commits the manifest once every part is durable; no rank assembles the model.
// --resume: every rank reads only the elements it holds from the latest checkpoint (train.out_dir
// on a filesystem all ranks share), whatever layout wrote it, so a run continues bit-identically
// under its own layout and, within rounding, under another. Validation and samples run on the
// mesh itself. A rank that fails ends the whole run with an error naming it (mpi: the job is
// aborted).
// Testing aid: LOOM_FAULT_INJECT="rank=R,step=S,kind=throw|exit|kill|nan|nan_weight" makes rank R
// throw, _Exit(3) or SIGKILL itself at the start of step S, or puts a NaN into its gradients of
// step S (nan) or into its weights from step S on (nan_weight).
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include "core/memory.h"

#include "train/config.h"

namespace loom::train {

struct TrainOptions {
  bool resume = false;        // continue from out_dir/latest when it exists
  bool overwrite = false;     // remove the run in out_dir (checkpoints, metrics) before the first step
  bool new_hparams = false;   // with resume: the config's schedule, AdamW settings and batch shape where they differ
  bool quiet = false;         // no progress lines (tests)
  std::string config_path;    // for messages
  std::string trace_path;     // Chrome trace of every rank ("" = none)
  std::string plan_note;      // what --plan auto chose (printed with the run's header)
  // When the run started, for train.time_limit_min (unset: when run_training is called).
  std::chrono::steady_clock::time_point started{};
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
  // Checkpoints written by this run, and the seconds of the last (every rank's part written, read
  // back and committed).
  int64_t checkpoints = 0;
  double last_checkpoint_s = 0;
  // Why the run stopped before train.steps (0: it did not; a signal's number, or kStopTimeLimit:
  // train/stop.h), and the step of the checkpoint it can resume from then (-1: none of this run).
  int stopped = 0;
  int64_t stop_checkpoint = -1;
};

TrainResult run_training(const TrainConfig& cfg, const TrainOptions& opt);

}  // namespace loom::train

// The training loop over a device mesh pp x dp x cp x tp (Mesh::standard), ranks as threads of
// this process (parallel.comm = "threads") or one process each under mpirun (parallel.comm =
// "mpi", the process count must equal the product):
//   - tensor / sequence / context parallelism (parallel.tp, parallel.sp, parallel.cp) with
//     model::GPT over the tp and cp groups, gradients averaged over parallel.dp with a plain all-reduce, or with
//     ZeRO-1 (parallel.zero = 1: parallel::Zero1Optimizer, AdamW moments sharded over dp x cp);
//   - pipeline parallelism (parallel.pp) with parallel::pipeline::PipelineExecutor, train.grad_accum
//     micro-batches per step under parallel.schedule (gpipe | 1f1b | interleaved | zb-h1), data
//     parallelism over parallel.dp through the executor's dp communicator, and tensor / sequence /
//     context parallelism inside each stage (the 4D layout dp x pp x tp, cp where it applies).
// ZeRO-1 with pp, ZeRO 2/3 and offload with any of tp/cp/sp/pp are refused with an error naming
// the field. Rank 0 prints the same progress lines and writes the same metrics.jsonl keys,
// validation losses, loss PNG and checkpoints as run_training: checkpoints hold full tensors
// (tensor-parallel shards, ZeRO-1 moment shards and pipeline stages gathered to rank 0) in the
// single-device format, so they load under any layout. --resume: every rank reads the latest
// checkpoint (train.out_dir on a filesystem all ranks share) and takes its own part of each full
// tensor, so a run continues bit-identically under its own layout and, within rounding, under
// another. A rank that fails ends the whole run with an error naming it (mpi: the job is
// aborted); LOOM_FAULT_INJECT (train/trainer.h) counts the mesh's ranks.
#pragma once
#include "train/config.h"
#include "train/trainer.h"

namespace loom::train {

// True when cfg asks for a layout run_training_mesh runs (tp, cp or pp > 1, or sp).
bool needs_mesh(const TrainConfig& cfg);

TrainResult run_training_mesh(const TrainConfig& cfg, const TrainOptions& opt);

}  // namespace loom::train

// The training loop on GPUs (train.device = "cuda", in builds with CUDA): the one model
// (model/gpt.h) on a CUDA backend (bf16 compute, f32 master weights and AdamW moments), its steps
// run by train::StepRunner (captured as CUDA graphs and replayed), fed by
// the CPU trainer's data pipeline, with its LR schedule, validation, samples, checkpoints,
// metrics and progress line (train/run_util.h):
//   - data parallelism over parallel.dp processes (parallel.comm mpi or nccl, under mpirun; the
//     threads backend runs one rank): each holds a whole replica on the GPU local rank % GPUs of
//     its host, trains on its share of every batch (the CPU trainers' split), and the replicas'
//     gradients are summed by a device communicator (comm/nccl_comm.h: NCCL when the build has
//     it and every process has a GPU of its own, else staged through host memory; parallel.comm
//     nccl requires NCCL) before the update, which every replica then applies alike. Rank 0
//     writes metrics and checkpoints and prints samples; a failing rank ends the job naming it;
//   - one micro-batch shape B x T, B = train.batch_size / (parallel.dp x train.grad_accum),
//     T = data.seq_len; with grad_accum 1 and one rank each step replays one graph (forward,
//     backward, update); else the gradients are zeroed, a forward + backward graph that
//     accumulates is replayed once per micro-batch, the ranks' sums are added, and the update runs
//     on them times 1 / (grad_accum x dp);
//   - validation: the mean loss of forward-only passes over the CPU trainers' validation batches
//     (each rank its share);
//   - samples: the weights copied into a CPU model::GPT, sampled as on the CPU;
//   - checkpoints in the CPU format (train/checkpoint.h): the f32 master weights and both
//     moments, so a GPU checkpoint loads in `loom generate` and resumes on the CPU, and a CPU
//     checkpoint resumes here;
//   - MFU against the bf16 GEMM rate of the job's GPUs, measured at start by every rank at once
//     and summed (cuda::measure_gemm_peak_bf16; ranks sharing a GPU share its rate).
// Not bit-identical from run to run: the token-embedding gradient and flash attention's dq are
// summed with f32 atomics (kernels/cuda/embedding.cuh, attention.cuh), so a resumed run matches
// the uninterrupted one to rounding. LOOM_FAULT_INJECT (train/trainer.h) names any rank.
#pragma once
#include "train/config.h"
#include "train/trainer.h"

namespace loom::train {

// cfg.device must be "cuda"; refusals (TrainConfig::validate_cuda) name the field, a machine
// without a visible GPU gets an error saying so.
TrainResult run_training_cuda(const TrainConfig& cfg, const TrainOptions& opt);

}  // namespace loom::train

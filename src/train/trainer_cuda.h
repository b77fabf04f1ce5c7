// The training loop on one GPU (train.device = "cuda", in builds with CUDA): model::GPTCuda
// (bf16 compute, f32 master weights and AdamW moments, the step captured as CUDA graphs) fed by
// the CPU trainer's data pipeline, with its LR schedule, validation, samples, checkpoints,
// metrics and progress line (train/run_util.h):
//   - one micro-batch shape B x T, B = train.batch_size / train.grad_accum, T = data.seq_len;
//     grad_accum 1 replays one graph per step (forward, backward, update); grad_accum > 1 zeroes
//     the gradients, replays a forward + backward graph that accumulates once per micro-batch,
//     then runs the update on the accumulated gradients times 1 / grad_accum;
//   - validation: the mean loss of forward-only passes over validation batches of that shape;
//   - samples: the weights copied into a CPU model::GPT, sampled as on the CPU;
//   - checkpoints in the CPU format (train/checkpoint.h): the f32 master weights and both
//     moments, so a GPU checkpoint loads in `loom generate` and resumes on the CPU, and a CPU
//     checkpoint resumes here;
//   - MFU against the bf16 GEMM rate of this GPU, measured at start (cuda::measure_gemm_peak_bf16).
// Not bit-identical from run to run: the token-embedding gradient and flash attention's dq are
// summed with f32 atomics (kernels/cuda/embedding.cuh, attention.cuh), so a resumed run matches
// the uninterrupted one to rounding. LOOM_FAULT_INJECT (train/trainer.h) works with rank 0.
#pragma once
#include "train/config.h"
#include "train/trainer.h"

namespace loom::train {

// cfg.device must be "cuda"; refusals (TrainConfig::validate_cuda) name the field, a machine
// without a visible GPU gets an error saying so.
TrainResult run_training_cuda(const TrainConfig& cfg, const TrainOptions& opt);

}  // namespace loom::train

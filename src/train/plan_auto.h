// `loom train --plan auto`: the planner's first choice (plan/planner.h) for this run, applied to
// the config's layout before the run starts.
//
// It keeps the number of ranks the config's layout has (pp x dp x cp x tp: what the user gave the
// run, threads or MPI processes) and chooses how to use them for the run's model, global batch
// (train.batch_size) and sequence length: dp, tp, pp (its schedule and virtual stages), cp, sp,
// the micro-batch size (train.grad_accum = batch / (dp x micro-batch)), the recompute policy
// (none, selective, full), the ZeRO stage and, on GPUs, offload. The ranks are:
// - on the CPU, the `cpu` cluster's (this host's calibrated rates where `loom calibrate` has run;
//   the ranks share the host), in f32;
// - on the emulated device, the same host's ranks holding what GPUs' pools hold (`loom plan
//   --precision device`; f32 where train.precision is);
// - on CUDA, one GPU each of this host's kind (its built-in profile, h100-sxm, h200 or a100-80gb,
//   with the GPU's memory, and as many on a node as the launcher's processes on this host or the
//   GPUs it sees), as loom's GPU runs hold memory; rank threads of one process, which would share
//   one GPU, are refused.
// A layout fits within 90% of the device's memory, or of train.memory_limit where smaller. Of the
// layouts that fit, the fastest predicted that the run accepts (TrainConfig::validate; a GPU's
// kernel widths, fp16's replica engine) is taken, and the line says which faster ones it refused.
// The planner's step times on this host are within 15% of the measured ones (bench/README.md,
// "Local truth"); on GPUs its rates are published runs' (plan/cluster.h).
#pragma once
#include <string>

#include "train/config.h"

namespace loom::train {

// Rewrites cfg's layout fields with the first choice and returns the line the run prints about
// it (the choice, its prediction, the runner-up). Deterministic: every MPI process chooses the
// same. Refuses a model no layout of these ranks fits, and GPUs it cannot plan, naming why.
std::string apply_auto_plan(TrainConfig& cfg, const std::string& config_path);

}  // namespace loom::train

// `loom train --plan auto`: the planner's first choice (plan/planner.h) for this run, applied to
// the config's layout before the run starts.
//
// It keeps the number of ranks the config's layout has (pp x dp x cp x tp: what the user gave the
// run, threads or MPI processes) and chooses how to use them for the run's model, global batch
// (train.batch_size) and sequence length: dp, tp, pp (its schedule and virtual stages), cp, sp,
// the micro-batch size (train.grad_accum = batch / (dp x micro-batch)), the recompute policy
// (none, selective, full) and the ZeRO stage, on the `cpu` cluster (this host's calibrated rates
// where `loom calibrate` has run; the ranks share the host) in f32, within 90% of
// train.memory_limit when one is set. The planner ranks by predicted tokens/s; its prediction of step time on this
// host is not yet within the 15% (bench/README.md, "Local truth").
#pragma once
#include <string>

#include "train/config.h"

namespace loom::train {

// Rewrites cfg's layout fields with the first choice and returns the line the run prints about
// it (the choice, its prediction, the runner-up). Deterministic: every MPI process chooses the
// same. Refuses train.device = "cuda" and a model no layout of these ranks fits, naming why.
std::string apply_auto_plan(TrainConfig& cfg, const std::string& config_path);

}  // namespace loom::train

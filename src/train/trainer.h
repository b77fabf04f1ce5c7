// The training loop on one device: deterministic batches, LR schedule, gradient accumulation,
// clipping, AdamW, periodic validation, text samples, checkpoints (with bit-identical resume),
// a live progress line, metrics as JSONL and a loss-curve PNG at the end.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "train/config.h"

namespace loom::train {

struct TrainOptions {
  bool resume = false;        // continue from out_dir/latest when it exists
  bool quiet = false;         // no progress lines (tests)
  std::string config_path;    // for messages
};

struct TrainResult {
  int64_t steps_done = 0;
  double last_loss = 0;
  double last_val_loss = 0;   // NaN when never evaluated
  double unigram_val_loss = 0;
  std::string last_sample;
};

TrainResult run_training(const TrainConfig& cfg, const TrainOptions& opt);

}  // namespace loom::train

// Checkpoints: one directory per checkpoint, DIR/ckpt_<step>/ with
//   state.safetensors  parameters ("param/<name>") and AdamW moments ("adam_m/<name>",
//                      "adam_v/<name>"), f32, logical shapes
//   manifest.json      format version, step, optimizer step count, data position, RNG seed and
//                      counters, the model config and the full training config (TOML text)
// A checkpoint is written into a temporary directory, every file fsynced, the directory renamed
// to its final name and fsynced, and only then DIR/latest (a one-line file naming it) replaced
// through rename: a crash at any moment leaves `latest` naming a complete checkpoint.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"

namespace loom::train {

constexpr int kCheckpointVersion = 1;

struct NamedTensor {
  std::string name;
  Tensor tensor;  // f32, CPU
};

struct CheckpointMeta {
  int64_t step = 0;              // optimizer steps completed
  int64_t optimizer_steps = 0;   // AdamW's bias-correction counter
  int64_t data_position = 0;     // the next training step's index into the sampler
  uint64_t seed = 0;             // initialisation, data order and sampling are counters on it
  nlohmann::json model;          // model config fields
  std::string config_toml;       // the training config as run
  std::string vocabulary;        // the run's tokenizer's fingerprint ("": none, or an older checkpoint)
};

// Writes DIR/ckpt_<step> and points DIR/latest at it, then deletes all but the newest `keep`.
// Returns the checkpoint's path.
std::string save_checkpoint(const std::string& dir, const CheckpointMeta& meta,
                            const std::vector<NamedTensor>& tensors, int64_t keep = 2);

// The checkpoint DIR/latest names; without DIR/latest, the newest complete DIR/ckpt_* ("" when
// there is none). Throws when `latest` names a missing or incomplete checkpoint.
std::string latest_checkpoint(const std::string& dir);

// Reads the manifest of checkpoint directory `ckpt` (validated: version, fields, types).
CheckpointMeta read_checkpoint_meta(const std::string& ckpt);

// Copies every tensor of `into` from checkpoint `ckpt`, checking that each exists with the
// expected dtype and shape; errors name the file and the tensor.
void load_checkpoint_tensors(const std::string& ckpt, const std::vector<NamedTensor>& into);

}  // namespace loom::train

// Checkpoints: one directory per checkpoint, DIR/ckpt_<step>/ with
//   state.safetensors  parameters ("param/<name>") and AdamW moments ("adam_m/<name>",
//                      "adam_v/<name>"), f32, logical shapes
//   manifest.json      format version, step, optimizer step count, data position, RNG seed and
//                      counters, the model config, the full training config (TOML text) and the
//                      CRC-32 of every tensor's bytes
//   manifest.crc32     the CRC-32 of manifest.json's bytes (decimal)
// A checkpoint is written into a temporary directory, every file fsynced, the directory renamed
// to its final name and fsynced, read back and verified, and only then DIR/latest (a one-line
// file naming it) replaced through rename and older checkpoints deleted: a crash at any moment
// leaves `latest` naming a complete checkpoint, and no checkpoint goes before a newer one is known
// good. Loading checks every checksum and the manifest's step against the directory's name, and
// refuses parameters that are not finite. Version 1 checkpoints (no checksums) still load.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"

namespace loom::train {

constexpr int kCheckpointVersion = 2;

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
  std::map<std::string, uint32_t> checksums;  // CRC-32 of each tensor's bytes (empty: version 1)
};

// Writes DIR/ckpt_<step> and points DIR/latest at it, then deletes all but the newest `keep`.
// Returns the checkpoint's path.
std::string save_checkpoint(const std::string& dir, const CheckpointMeta& meta,
                            const std::vector<NamedTensor>& tensors, int64_t keep = 2);

// The checkpoint DIR/latest names; without DIR/latest, the newest complete DIR/ckpt_* ("" when
// there is none). Throws when `latest` names a missing or incomplete checkpoint.
std::string latest_checkpoint(const std::string& dir);

// What in DIR shows that a run is there ("latest", "metrics.jsonl" or a "ckpt_*" directory), or
// "" when nothing does (or DIR does not exist).
std::string run_marker(const std::string& dir);

// Reads every tensor of checkpoint `ckpt` and checks it against the manifest's checksums (and the
// manifest against its own); throws naming the file and what differs.
void verify_checkpoint(const std::string& ckpt);

// The checkpoint a run in DIR resumes from: the one `latest` names, or, when it fails
// verification (or `latest` is unreadable), the newest older complete checkpoint that passes,
// each one passed over described in `notes` (for the run to say). "" when DIR holds none; throws,
// with every reason, when checkpoints exist but none verifies (nothing is started over).
std::string resume_checkpoint(const std::string& dir, std::vector<std::string>* notes);

// Reads the manifest of checkpoint directory `ckpt` (validated: version, fields, types).
CheckpointMeta read_checkpoint_meta(const std::string& ckpt);

// Copies every tensor of `into` from checkpoint `ckpt`, checking that each exists with the
// expected dtype and shape, that its bytes have the manifest's checksum, and that parameters
// ("param/...") are finite; errors name the file and the tensor (and the first bad index).
void load_checkpoint_tensors(const std::string& ckpt, const std::vector<NamedTensor>& into);

// The tensors of checkpoint `ckpt` read one at a time (a rank takes its parts of the full
// tensors), each checked as load_checkpoint_tensors does.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& ckpt);
  ~CheckpointReader();
  // Tensor `name` into t (its dtype and shape expected).
  void read_into(const std::string& name, const Tensor& t);
  // Tensor `name`, f32 of `shape`, into a buffer kept until the next call.
  const std::vector<float>& read(const std::string& name, const Shape& shape);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::vector<float> buf_;
};

}  // namespace loom::train

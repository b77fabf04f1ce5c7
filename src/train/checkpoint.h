// Checkpoints: one directory per checkpoint, DIR/ckpt_<step>/, written by every rank at once
// (version 3):
//   rank_<r>.safetensors  rank r's slices: per checkpoint tensor it holds part of, one 1-D f32
//                         tensor of that name, its slices one after another
//   rank_<r>.json         rank r's index: per tensor, its slices as [first element, elements] of
//                         the full tensor (row-major flat indices), in file order, and the CRC-32
//                         of the tensor's bytes in the file
//   manifest.json         format version, step, optimizer step count, data position, RNG seed and
//                         counters, the model config, the full training config (TOML text), every
//                         full tensor's name and shape ("param/<name>", "adam_m/<name>",
//                         "adam_v/<name>", f32, logical shapes; under GaLore a projected
//                         matrix's "galore_m/<name>", "galore_v/<name>" and "galore_p/<name>"
//                         instead of its adam_m/adam_v, per row block for a Llama block's
//                         fused matrices: "galore_m/<name>[q]", ..., or "adam_m/<name>[k]" for
//                         a block not above the rank), the training samples drawn
//                         (consumed_samples) and each rank index's CRC-32
//   manifest.crc32        the CRC-32 of manifest.json's bytes (decimal)
// Together the slices of all ranks cover every element of every tensor exactly once (checked
// before the checkpoint is committed), so no rank ever holds a full tensor it does not own, and
// any layout reads back just the elements it needs (reshard on load).
// Commit: every rank writes its files into DIR/.tmp_ckpt_<step>, fsyncs and reads them back;
// when every rank has succeeded rank 0 checks the cover, writes the manifest, renames the
// directory to its final name, fsyncs, and only then replaces DIR/latest (a one-line file naming
// it) through rename and deletes older checkpoints: a crash of any rank at any moment leaves
// `latest` naming a complete checkpoint, and no checkpoint goes before a newer one is known good.
// Loading checks every checksum and the manifest's step against the directory's name, and
// refuses parameters that are not finite. Versions 1 and 2 (one state.safetensors of full
// tensors, written by rank 0) still load.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.h"
#include "core/tensor.h"

namespace loom::train {

constexpr int kCheckpointVersion = 3;

struct NamedTensor {
  std::string name;
  Tensor tensor;  // f32, CPU
};

// A run of one checkpoint tensor's elements in a rank's memory: `n` elements of tensor `name` from
// its flat (row-major) element `global` on, at `data`.
struct Slice {
  std::string name;
  int64_t global = 0;
  int64_t n = 0;
  const float* data = nullptr;
};

// A full tensor of the checkpoint: its name and logical shape (f32).
struct TensorInfo {
  std::string name;
  Shape shape;
};

struct CheckpointMeta {
  int64_t step = 0;              // optimizer steps completed
  int64_t optimizer_steps = 0;   // AdamW's bias-correction counter
  double loss_scale = 0;         // train.precision fp16: the loss scaler's scale (0: none)
  int64_t loss_scale_clean = 0;  // and its clean steps since the scale last changed
  int64_t data_position = 0;     // the next training step's index into the sampler
  int64_t consumed_samples = -1;  // training samples drawn before `step` (-1: not recorded, an older
                                  // checkpoint's: step x its train.batch_size)
  uint64_t seed = 0;             // initialisation, data order and sampling are counters on it
  nlohmann::json model;          // model config fields
  std::string config_toml;       // the training config as run
  std::string vocabulary;        // the run's tokenizer's fingerprint ("": none, or an older checkpoint)
  std::map<std::string, uint32_t> checksums;  // version 2: CRC-32 of each tensor's bytes (version 1: none)
  std::vector<TensorInfo> tensors;            // version 3: every full tensor
  std::vector<uint32_t> index_crcs;           // version 3: the CRC-32 of rank r's index (rank_<r>.json)
};

// Collective over `world` (every rank of the run): each rank writes `mine`, its slices of the full
// tensors `tensors` (the same list on every rank; over all ranks the slices cover every element of
// every tensor once), then rank 0 commits DIR/ckpt_<step>, points DIR/latest at it and deletes all
// but the newest `keep`. Slices of parameters ("param/...") must be finite. Every rank returns the
// checkpoint's path, or throws when any rank failed (naming it; nothing of the new checkpoint is
// left, `latest` and the earlier checkpoints are kept). meta.tensors and meta.index_crcs are filled in.
std::string save_checkpoint(comm::Comm& world, const std::string& dir, const CheckpointMeta& meta,
                            const std::vector<TensorInfo>& tensors, const std::vector<Slice>& mine,
                            int64_t keep = 2);
// One writer, whole tensors (the same files as a one-rank run).
std::string save_checkpoint(const std::string& dir, const CheckpointMeta& meta,
                            const std::vector<NamedTensor>& tensors, int64_t keep = 2);

// The checkpoint DIR/latest names; without DIR/latest, the newest complete DIR/ckpt_* ("" when
// there is none). Throws when `latest` names a missing or incomplete checkpoint.
std::string latest_checkpoint(const std::string& dir);

// What in DIR shows that a run is there ("latest", "metrics.jsonl" or a "ckpt_*" directory), or
// "" when nothing does (or DIR does not exist).
std::string run_marker(const std::string& dir);
// Removes the run in `dir` (--overwrite): its checkpoints, interrupted checkpoint writes, `latest`,
// metrics.jsonl, loss.png and memory.json; whatever else the folder holds stays.
void remove_run(const std::string& dir);

// Checks checkpoint `ckpt`: the manifest against its own checksum, each rank index against the
// manifest's, that the slices cover every tensor once, and the stored bytes of every tensor
// against its checksum (parameters finite); throws naming the file and what differs. With
// parts > 1 only the data files i with i % parts == part are read (the rest is checked on every
// part), so that the ranks of a run share the reading.
void verify_checkpoint(const std::string& ckpt, int part = 0, int parts = 1);

// The checkpoint a run in DIR resumes from: the one `latest` names, or, when it fails
// verification (or `latest` is unreadable), the newest older complete checkpoint that passes,
// each one passed over described in `notes` (for the run to say). "" when DIR holds none; throws,
// with every reason, when checkpoints exist but none verifies (nothing is started over). With
// `world`, collective: its ranks share the verification and agree on the outcome.
std::string resume_checkpoint(const std::string& dir, std::vector<std::string>* notes, comm::Comm* world = nullptr);

// Reads the manifest of checkpoint directory `ckpt` (validated: version, fields, types).
CheckpointMeta read_checkpoint_meta(const std::string& ckpt);

// Copies every tensor of `into` from checkpoint `ckpt`, checking that each exists with the
// expected dtype and shape, that its bytes have the manifest's checksum, and that parameters
// ("param/...") are finite; errors name the file and the tensor (and the first bad index).
void load_checkpoint_tensors(const std::string& ckpt, const std::vector<NamedTensor>& into);

// Any elements of the full tensors of checkpoint `ckpt`, of any version, reading only the stored
// pieces that hold them (a rank takes its part under any layout). Parameters read are checked to
// be finite; with `verify`, each stored piece's checksum is checked the first time any of it is
// read (the trainer verifies a checkpoint whole before loading it, and passes false).
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& ckpt, bool verify = true);
  ~CheckpointReader();
  const CheckpointMeta& meta() const;
  const std::string& path() const;  // the checkpoint directory
  // The full tensor's shape; throws naming the checkpoint when it has no tensor `name`.
  Shape shape(const std::string& name) const;
  bool has(const std::string& name) const;
  // The names of the tensors it holds, sorted.
  std::vector<std::string> names() const;
  // Elements [global, global + n) of tensor `name` into dst.
  void read(const std::string& name, int64_t global, int64_t n, float* dst);
  // The whole tensor `name` into t (f32, its shape expected).
  void read_into(const std::string& name, const Tensor& t);

 private:
  friend void verify_checkpoint(const std::string& ckpt, int part, int parts);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::train

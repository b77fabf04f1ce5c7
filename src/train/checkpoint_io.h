// A model's weights in loom checkpoints (train/checkpoint.h): the model config of a manifest,
// loading "param/<name>" tensors into a GPT for inference or conversion, and writing a step-0
// checkpoint (AdamW moments zero) that `loom train --resume` continues from.
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/gpt.h"
#include "train/checkpoint.h"

// Declared in loom::model (these are the model's own file formats) but kept under train/, since
// they write and read loom checkpoints (train/checkpoint.h) and model/ depends on nothing above it.
namespace loom::model {

// The "model" object of a checkpoint manifest (the fields the trainer writes, plus ln_eps).
nlohmann::json gpt_config_manifest(const GPTConfig& cfg);
// The GPTConfig it describes; errors name `where` and the field.
GPTConfig gpt_config_from_manifest(const nlohmann::json& model, const std::string& where);

// `path` is either a checkpoint directory (holding manifest.json) or a run directory whose
// `latest` file names one. Returns the checkpoint directory or throws naming `path`.
std::string resolve_checkpoint(const std::string& path);

// The model config of checkpoint `ckpt` (a resolved checkpoint directory), checked against the
// parameters it holds (names and shapes; errors name manifest.json and the field).
GPTConfig checkpoint_model_config(const std::string& ckpt);

// Copies "param/<name>" of every parameter of gpt from checkpoint `ckpt` (dtype and shape
// checked; errors name the file and the tensor). A checkpoint of a pruned fine-tune
// (model.prune_embedding: its wte holds the rows of the tokens in "vocab/kept") is mapped back to
// the whole vocabulary: the other rows from pruned_rows_path of its run directory.
void load_checkpoint_params(const std::string& ckpt, GPT& gpt);

// Parameter `spec`'s logical elements (f32) from checkpoint `r` (at directory `ckpt`) into dst,
// a pruned checkpoint's wte mapped back as load_checkpoint_params does.
void read_checkpoint_param(train::CheckpointReader& r, const std::string& ckpt, const ParamSpec& spec, float* dst);

// Where a pruned fine-tune in run directory `run_dir` keeps the input embedding it started from.
std::string pruned_rows_path(const std::string& run_dir);
// Writes the whole vocabulary's input embedding `table` (f32 [V, C]) to `path` with its CRC-32 in
// the metadata (crc32).
void write_pruned_rows(const std::string& path, const Tensor& table, const std::string& source);
// Checks the file at `path` as read_checkpoint_param does, a piece at a time (its whole table is never
// held): the tensor's shape, its CRC-32 where the file has one, and finite values.
void verify_pruned_rows(const std::string& path, const Shape& shape);

// Writes dir/ckpt_00000000 (parameters of gpt, zero AdamW moments, step 0, `seed`) and points
// dir/latest at it. Refuses a directory that already holds a checkpoint, so nothing there is
// replaced. Returns the checkpoint directory.
std::string save_initial_checkpoint(const GPT& gpt, const std::string& dir, uint64_t seed);

}  // namespace loom::model

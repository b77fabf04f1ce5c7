// Hugging Face GPT-2 interop: parameter names and layouts, config.json, and whole-file import and
// export of model.safetensors.
//
// Hugging Face stores GPT-2's projections as Conv1D weights [in, out]; loom keeps PyTorch Linear
// layout [out, in], so h.{i}.attn.c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj weights are
// transposed on the way in and out. Every other tensor keeps its name and layout. Files may prefix
// keys with "transformer." (GPT2LMHeadModel.save_pretrained) or not (the hub's gpt2 files); the
// causal-mask buffers h.{i}.attn.bias / attn.masked_bias are ignored; lm_head.weight is absent or
// equal to wte.weight when the embeddings are tied.
//
// Export writes what transformers' GPT2LMHeadModel.from_pretrained loads: model.safetensors with
// the hub's key names and shapes (f32, no prefix, lm_head only when untied, __metadata__
// {"format": "pt"}) and a config.json of model_type "gpt2" with activation "gelu_new" (tanh GELU).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "model/config.h"
#include "model/gpt.h"
#include "train/hf_config.h"

// Declared in loom::model (these are the model's own file formats) but kept under train/, since
// they write and read loom checkpoints (train/checkpoint.h) and model/ depends on nothing above it.
namespace loom::model {

// The Hugging Face key of loom parameter `name` (no prefix) and whether it is a Conv1D weight.
struct HfKey {
  std::string name;
  bool conv1d = false;  // stored transposed: [in, out]
};
HfKey hf_key(const std::string& loom_name);
// The shape Hugging Face stores parameter `spec` with (Conv1D weights transposed).
Shape hf_shape(const ParamSpec& spec);

// Copies Hugging Face GPT-2 weights from safetensors file `path` into `gpt`, whose config must
// match the file's tensors (wrong shapes, non-float dtypes, missing or unknown tensors are
// errors naming the file and the tensor). F32, F16 and BF16 tensors are read (as f32).
void load_hf_gpt2(const std::string& path, GPT& gpt);

// Writes out_dir/model.safetensors and out_dir/config.json of a model of config cfg whose
// parameters `values` gives one at a time (values(spec, dst): f32 [spec.numel()] in loom's
// layout), so no more than one tensor is in memory. Both files are written under temporary names
// first and renamed only when complete, so files already there survive a failure.
void save_hf_gpt2(const GPTConfig& cfg, const std::function<void(const ParamSpec&, float*)>& values,
                  const std::string& out_dir);
// The same of a model in memory, and of loom checkpoint `ckpt` (any version, however many ranks
// wrote it: each tensor is assembled from its slices as it is written).
void save_hf_gpt2(const GPT& gpt, const std::string& out_dir);
void save_hf_gpt2_from_checkpoint(const std::string& ckpt, const std::string& out_dir);

// f32 [rows, cols] -> f32 [cols, rows].
void transpose_2d(const float* in, float* out, int64_t rows, int64_t cols);

}  // namespace loom::model

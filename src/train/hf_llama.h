// Hugging Face LlamaForCausalLM interop: the parameter names and layouts, and import and export
// of (sharded) safetensors.
//
// loom's Llama is the one chain with fused projections (model/param_specs.h): c_attn = [q_proj;
// k_proj; v_proj] and c_fc = [gate_proj; up_proj] by rows, c_proj = o_proj and down_proj, ln_1 /
// ln_2 = input_layernorm / post_attention_layernorm, ln_f = model.norm, wte = model.embed_tokens.
// Both keep PyTorch Linear layout [out, in], and loom's rotary embedding pairs element i with
// i + head_size / 2 as Hugging Face's does (rotate_half), so the q and k rows move as they are: the
// permutation Hugging Face's own conversion applies to Meta's original checkpoints (which pair
// 2i with 2i + 1) is already in these files. The rotary inv_freq buffers some files carry are
// ignored; lm_head.weight is absent, or equal to embed_tokens, when the embeddings are tied.
//
// Files: one model.safetensors, or shards named by model.safetensors.index.json's weight_map
// (written as model-0000k-of-0000n.safetensors beyond max_shard_bytes, as save_pretrained does).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/gpt.h"

namespace loom::model {

// One Hugging Face tensor: rows [row0, row0 + rows) of loom parameter `loom_name`.
struct HfPart {
  std::string hf_name;
  std::string loom_name;
  int64_t row0 = 0, rows = 0;
  Shape shape;  // the Hugging Face tensor's shape
};
// Every Hugging Face tensor of a Llama config, in loom's parameter order.
std::vector<HfPart> hf_llama_parts(const GPTConfig& cfg);

// The safetensors files of a Hugging Face model given as a directory (its model.safetensors, else
// its model.safetensors.index.json, as transformers looks), a model.safetensors or a
// model.safetensors.index.json, and which file holds each tensor (errors name the index and the
// field).
struct HfFiles {
  std::string dir;
  std::vector<std::string> files;
  std::map<std::string, std::string> weight_map;  // tensor -> file (empty: every tensor in files[0])
};
HfFiles hf_files(const std::string& path);

// Copies a Hugging Face Llama model's weights into `gpt` (a Llama config matching the files);
// F32, F16 and BF16 tensors are read as f32. Missing, unexpected or misshapen tensors are errors
// naming the file and the tensor.
void load_hf_llama(const std::string& path, GPT& gpt);

// Writes out_dir/config.json and the weights (model.safetensors, or shards of at most
// max_shard_bytes and model.safetensors.index.json) of a Llama config whose parameters `values`
// gives one at a time (f32 [spec.numel()] in loom's layout). Every file is written under a
// temporary name and renamed when all are complete, so files already there survive a failure.
void save_hf_llama(const GPTConfig& cfg, const std::function<void(const ParamSpec&, float*)>& values,
                   const std::string& out_dir, int64_t max_shard_bytes = int64_t(5) << 30);

}  // namespace loom::model

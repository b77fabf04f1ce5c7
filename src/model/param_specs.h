// The model's parameters by chain element: the one place that names them and gives their shapes,
// storage rows and initialisation. The CPU chain blocks, the tensor-parallel model (which shards
// these full tensors) and the CUDA model all build their parameters from here, so every layout
// and device starts from the same weights.
#pragma once
#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/param.h"

namespace loom::model {

// wte [V, C] (storage padded to the padded vocabulary); wpe [block_size, C] with learned positions.
std::vector<ParamSpec> embedding_param_specs(const GPTConfig& cfg);
// A block's parameters by role; a config has those block_param_present says (no biases of an
// RMSNorm, none of the linear layers without model.bias).
enum BlockParam : int {
  kLn1W, kLn1B, kQkvW, kQkvB, kAttnProjW, kAttnProjB, kLn2W, kLn2B, kFcW, kFcB, kMlpProjW, kMlpProjB, kBlockParams
};
bool block_param_present(const GPTConfig& cfg, BlockParam p);
// The parameters of block `layer` that the config has, in Hugging Face GPT-2 order (BlockParam
// order), weights in Linear layout [out, in]: c_attn [qkv_rows, C] (queries, keys, values), c_fc
// [fc_rows, C] (SwiGLU: gate, then up); the two output projections use std / sqrt(2 n_layer).
std::vector<ParamSpec> block_param_specs(const GPTConfig& cfg, int64_t layer);
// ln_f.weight, ln_f.bias (LayerNorm), and lm_head.weight [V, C] when embeddings are untied.
std::vector<ParamSpec> head_param_specs(const GPTConfig& cfg);
// Every parameter of the model, in Hugging Face order (embedding, blocks, head).
std::vector<ParamSpec> gpt_param_specs(const GPTConfig& cfg);

}  // namespace loom::model

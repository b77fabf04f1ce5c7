// Hugging Face GPT-2 config.json, read and written (train/hf_gpt2.h moves the weights): the reader
// reaches nothing but the model's config, so it is fuzzed alone (tests/fuzz).
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "model/config.h"

namespace loom::model {

// GPTConfig from a GPT-2 config.json (n_layer, n_head, n_embd, vocab_size, n_positions or n_ctx,
// layer_norm_epsilon, activation_function, tie_word_embeddings). Configurations loom cannot run
// the same way (another activation, n_inner != 4 n_embd, cross-attention, attention scaled by layer
// index) are refused. Errors name `where` and the field.
GPTConfig gpt_config_from_hf(const nlohmann::json& j, const std::string& where);
// GPTConfig from a LlamaForCausalLM config.json (model_type "llama": hidden_size,
// intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, vocab_size,
// max_position_embeddings, rms_norm_eps, rope_theta, rope_scaling of rope_type "llama3" or none,
// tie_word_embeddings, attention_bias and mlp_bias, hidden_act "silu", head_dim). What loom's Llama
// cannot run the same way (another activation or rope scaling, biases on attention only, a head_dim
// other than hidden_size / num_attention_heads, pretraining_tp > 1) is refused naming the field.
GPTConfig llama_config_from_hf(const nlohmann::json& j, const std::string& where);
// Either family, by the file's model_type ("gpt2" when absent).
GPTConfig read_hf_config(const std::string& path);
// The config.json transformers reads for `cfg` (dropout 0: loom trains without it): GPT2LMHeadModel
// for the GPT-2 architecture, LlamaForCausalLM for the Llama one (RMSNorm, SwiGLU, rotary
// positions); a mix of the two is refused naming the options.
nlohmann::json hf_config_json(const GPTConfig& cfg);
// Whether cfg is the Llama architecture (RMSNorm, SwiGLU, rotary positions).
bool is_llama(const GPTConfig& cfg);

}  // namespace loom::model

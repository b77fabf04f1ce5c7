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
GPTConfig read_hf_config(const std::string& path);
// The config.json transformers reads for `cfg` (dropout 0: loom trains without it).
nlohmann::json hf_config_json(const GPTConfig& cfg);

}  // namespace loom::model

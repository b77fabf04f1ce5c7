// What the planner knows of a model: a decoder-only transformer's dimensions (the GPT-2 family
// loom trains, and the options of the Llama family: grouped-query attention, SwiGLU with its own
// hidden size, untied embeddings, rotary instead of learned positions), its parameter count and
// its FLOPs.
//
// FLOPs count the matrix products only (2 per multiply-add), as Megatron-LM does: per token and
// layer the forward runs 2 x (the layer's matrix parameters) plus 4 s h for attention's scores and
// weighted sum over all s positions (causal masking not subtracted), and the head 2 V h. A
// training step runs three forwards' worth (forward, and backward at twice the forward); model
// FLOPs count those three, hardware FLOPs add what recomputation runs again.
#pragma once
#include <cstdint>
#include <string>

#include "model/config.h"

namespace loom::plan {

struct ModelSpec {
  std::string name = "model";
  int64_t layers = 0;
  int64_t hidden = 0;       // h
  int64_t heads = 0;        // a
  int64_t kv_heads = 0;     // grouped-query attention's key/value heads (0: heads)
  int64_t ffn = 0;          // feed-forward hidden size (0: 4 h)
  int64_t vocab = 0;        // V
  int64_t seq = 0;          // s, the training sequence length
  bool swiglu = false;      // gated feed-forward (3 matrices) instead of GELU (2)
  bool tied = true;         // lm_head shares wte
  bool bias = true;         // biases in the linear layers (GPT-2) or none (Llama)
  bool learned_positions = true;  // wpe [s, h] (GPT-2) or rotary (Llama: no parameters)

  int64_t kv() const { return kv_heads > 0 ? kv_heads : heads; }
  int64_t ffn_size() const { return ffn > 0 ? ffn : 4 * hidden; }
  int64_t head_dim() const { return hidden / heads; }
  // Parameters of one transformer layer: its matrices (the FLOP-carrying part) and all of it
  // (biases and norms too).
  int64_t layer_matrix_params() const;
  int64_t layer_params() const;
  int64_t embedding_params() const;  // wte, and wpe when learned
  int64_t head_params() const;       // final norm, and lm_head when untied
  int64_t params() const;            // the whole model
  // Forward FLOPs of one token: its layers and the head (see above).
  double layer_forward_flops_per_token() const;
  double head_forward_flops_per_token() const;
  double forward_flops_per_token() const;
  // Model FLOPs of a training step of `tokens` tokens (3 forwards' worth).
  double model_flops(double tokens) const;
  // Throws naming `where` and the field when a dimension is missing or inconsistent.
  void validate(const std::string& where) const;
  std::string str() const;
};

// A GPT-2 family model as loom builds it (model::GPTConfig) at training sequence length seq.
ModelSpec from_gpt(const model::GPTConfig& c, int64_t seq);
// The inverse: the model loom would build for a spec (block_size = seq; no biases means RMSNorm).
model::GPTConfig to_gpt(const ModelSpec& m);
// A model file: a TOML table [model] with layers, hidden, heads and vocab (required), seq,
// kv_heads, ffn, swiglu, tied, bias, learned_positions (optional). Errors name the file and field.
ModelSpec read_model(const std::string& path);
// A preset by name: gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b (seq 1024), llama-7b, llama-70b
// (seq 4096), llama3-405b (seq 8192), any of `loom train`'s presets (model::gpt_preset_names, at
// their block_size), or a path to a model file.
ModelSpec model_named(const std::string& name_or_path);

}  // namespace loom::plan

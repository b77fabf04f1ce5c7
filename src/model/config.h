// The model's configuration: the GPT-2 family and the Llama family as options of one chain of
// blocks (model/blocks.h): sizes, architecture options, presets and validation.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace loom::model {

// Normalisation of the blocks and the head: GPT-2's LayerNorm (weight and bias) or the Llama
// family's RMSNorm (weight only).
enum class Norm : uint8_t { layernorm, rmsnorm };
// The feed-forward: GPT-2's tanh-GELU MLP (c_fc [F, C], c_proj [C, F]) or the Llama family's SwiGLU
// (c_fc [2F, C] holds the gate projection's F rows, then the up projection's; c_proj [C, F]).
enum class Mlp : uint8_t { gelu, swiglu };
// Positions: GPT-2's learned table (wpe) or rotary embeddings applied to queries and keys.
enum class Position : uint8_t { learned, rope };

std::string_view norm_name(Norm n);
std::string_view mlp_name(Mlp m);
std::string_view position_name(Position p);
// Parse a name; throw loom::Error naming `where` and the known names.
Norm norm_from_name(std::string_view s, std::string_view where);
Mlp mlp_from_name(std::string_view s, std::string_view where);
Position position_from_name(std::string_view s, std::string_view where);

struct GPTConfig {
  std::string name = "custom";
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_embd = 768;
  int64_t vocab_size = 50257;
  int64_t block_size = 1024;    // longest sequence (rows of wpe)
  bool tied_embeddings = true;  // lm_head shares wte (GPT-2); otherwise lm_head.weight of its own
  float ln_eps = 1e-5f;
  float init_std = 0.02f;       // N(0, init_std); residual projections use init_std / sqrt(2 n_layer)
  // Architecture options (GPT-2's by default; the Llama family: rmsnorm, swiglu, rope, no bias,
  // n_kv_head < n_head, usually untied).
  Norm norm = Norm::layernorm;  // ln_eps is its epsilon either way
  Mlp mlp = Mlp::gelu;
  Position position = Position::learned;
  int64_t n_kv_head = 0;        // key/value heads (grouped-query attention); 0: n_head
  int64_t ffn_hidden = 0;       // the feed-forward's hidden width F; 0: 4 n_embd
  bool bias = true;             // biases of the linear layers (c_attn, c_proj, c_fc)
  double rope_theta = 10000.0;  // rotary base
  // Llama 3's frequency scaling (factor 0: none).
  double rope_scaling_factor = 0, rope_low_freq_factor = 1, rope_high_freq_factor = 4;
  int64_t rope_original_max_position = 8192;
  // Embedding pruning for fine-tuning (Williams & Aletras 2023; untied only): the token ids whose
  // rows the input embedding wte keeps, ascending (null: all of them). Ids are remapped to rows
  // as they enter the embedding; lm_head keeps the whole vocabulary.
  std::shared_ptr<const std::vector<int32_t>> kept_tokens;
  int64_t input_rows() const { return kept_tokens ? int64_t(kept_tokens->size()) : vocab_size; }

  // The vocabulary padded to a multiple of 128: wte (and lm_head) have this many rows, the rows
  // past vocab_size are zero and the loss masks their logits.
  int64_t padded_vocab() const { return (vocab_size + 127) / 128 * 128; }
  // Rows of wte (and columns of the logits) per rank of a vocabulary split over tp ranks (ceil;
  // the last shard may end in extra padding rows).
  int64_t vocab_shard_rows(int tp) const { return (padded_vocab() + tp - 1) / tp; }
  int64_t head_size() const { return n_embd / n_head; }
  int64_t kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  int64_t ffn() const { return ffn_hidden > 0 ? ffn_hidden : 4 * n_embd; }
  // Rows of c_attn: the queries' n_head heads, then the keys' and the values' kv_heads() heads.
  int64_t qkv_rows() const { return (n_head + 2 * kv_heads()) * head_size(); }
  // Rows of c_fc: F (GELU) or the gate's and the up projection's 2F (SwiGLU).
  int64_t fc_rows() const { return mlp == Mlp::swiglu ? 2 * ffn() : ffn(); }
  // The Llama family's layout (RMSNorm, SwiGLU, rotary positions): Hugging Face's
  // LlamaForCausalLM, whose q, k, v and gate, up projections are matrices of their own.
  bool is_llama() const { return norm == Norm::rmsnorm && mlp == Mlp::swiglu && position == Position::rope; }
  bool is_gpt2() const {
    return norm == Norm::layernorm && mlp == Mlp::gelu && position == Position::learned && kv_heads() == n_head &&
           ffn() == 4 * n_embd && bias;
  }
  // Parameters other than wte, wpe and an untied lm_head: the blocks and the final norm.
  int64_t nonembedding_parameters() const;
  // Model FLOPs of one trained token (forward and backward) at sequence length T, for MFU. One
  // definition for every figure loom prints, nanoGPT's and PaLM's: 6 per non-embedding
  // parameter, 6 C V for the lm_head (the padded vocabulary: the rows that are computed), and
  // 12 L C T for attention's scores and values (not halved for the causal mask).
  double flops_per_token(int64_t T) const {
    return 6.0 * double(nonembedding_parameters()) + 6.0 * double(n_embd) * double(padded_vocab()) +
           12.0 * double(n_layer) * double(n_embd) * double(T);
  }

  // Throws loom::Error naming `where` and the offending field.
  void validate(std::string_view where = "model config") const;
  std::string str() const;  // "gpt2-124m: n_layer=12 n_head=12 ..."
};

// Presets: gpt2-tiny (L=2, H=4, C=64, V=503, T=64: the reference-test size), gpt2-124m, gpt2-350m,
// gpt2-774m, gpt2-1558m (aliases gpt2, gpt2-medium, gpt2-large, gpt2-xl); the Llama family:
// llama-tiny (L=2, H=4, KV=2, C=64, F=176, V=503, T=64, untied: the reference-test size),
// llama-10m (the KJV quickstart's sibling), smollm-135m and tinyllama-1.1b (those models' shapes).
// Unknown names throw listing the known ones.
GPTConfig gpt_preset(std::string_view name);
std::vector<std::string> gpt_preset_names();

}  // namespace loom::model

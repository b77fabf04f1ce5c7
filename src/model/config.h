// GPT-2 family configuration: sizes, presets (gpt2-tiny ... gpt2-xl) and validation.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loom::model {

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

  // The vocabulary padded to a multiple of 128: wte (and lm_head) have this many rows, the rows
  // past vocab_size are zero and the loss masks their logits.
  int64_t padded_vocab() const { return (vocab_size + 127) / 128 * 128; }
  int64_t head_size() const { return n_embd / n_head; }
  // Parameters other than wte, wpe and an untied lm_head: the blocks and the final LayerNorm.
  int64_t nonembedding_parameters() const { return n_layer * (12 * n_embd * n_embd + 13 * n_embd) + 2 * n_embd; }
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
// gpt2-774m, gpt2-1558m (aliases gpt2, gpt2-medium, gpt2-large, gpt2-xl). Unknown names throw
// listing the known ones.
GPTConfig gpt_preset(std::string_view name);
std::vector<std::string> gpt_preset_names();

}  // namespace loom::model

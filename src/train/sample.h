// Text sampling from a model: temperature and top-k over the real vocabulary (padding excluded),
// drawn from counter-based random numbers keyed by (seed, position), so a sample is reproducible.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "model/gpt.h"

namespace loom::train {

struct SampleOptions {
  int64_t max_new_tokens = 64;
  float temperature = 1.0f;  // > 0
  int64_t top_k = 40;        // 0: the whole vocabulary; ties with the k-th are kept (k = 1: the argmax)
  uint64_t seed = 0;
  int32_t stop_token = -1;   // stop after emitting this token (-1: never)
  // Only these token ids (ascending) are drawn (null: all): a model with a pruned input embedding
  // can read only its kept tokens back.
  std::shared_ptr<const std::vector<int32_t>> allowed;
  // Only ids below this are drawn (0: the model's whole vocabulary): a model given more rows than
  // its tokenizer has (model.vocab_size) samples what the tokenizer can decode.
  int64_t vocab_limit = 0;
};

// Picks the next token from logits f32 [V] (one draw keyed by (seed, index)).
int32_t sample_logits(const float* logits, int64_t V, const SampleOptions& opt, uint64_t index);

// The logits of the last position of a context: the whole (padded) vocabulary row.
using LastLogits = std::function<std::vector<float>(const std::vector<int32_t>& context)>;
// Continues `prompt` (not empty), asking `logits` about the last block_size tokens for each new
// token. Returns only the new tokens.
std::vector<int32_t> sample_with(const LastLogits& logits, int64_t block_size, int64_t vocab,
                                 const std::vector<int32_t>& prompt, const SampleOptions& opt);

// A context as one sequence i32 [1, T'] that a model split in sequence units of `unit` takes:
// its last tokens up to the longest such length within block_size, padded on the right with
// zeros to a multiple of `unit`. A causal model's logits at a position ignore later tokens, so the
// padding changes nothing at *position, the context's last token.
Tensor padded_context(const std::vector<int32_t>& context, int64_t block_size, int64_t unit, int64_t* position);

// Continues `prompt` (not empty) by running the model on the last block_size tokens for each new
// token. Returns only the new tokens. A model split by tensor, sequence or context parallelism
// samples on its ranks together (collective over its groups).
std::vector<int32_t> sample_recompute(model::GPT& gpt, const std::vector<int32_t>& prompt, const SampleOptions& opt);

}  // namespace loom::train

// Text sampling from a model: temperature and top-k over the real vocabulary (padding excluded),
// drawn from counter-based random numbers keyed by (seed, position), so a sample is reproducible.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "model/gpt.h"

namespace loom::train {

struct SampleOptions {
  int64_t max_new_tokens = 64;
  float temperature = 1.0f;  // > 0
  int64_t top_k = 40;        // 0: the whole vocabulary
  uint64_t seed = 0;
  int32_t stop_token = -1;   // stop after emitting this token (-1: never)
};

// Picks the next token from logits f32 [V] (one draw keyed by (seed, index)).
int32_t sample_logits(const float* logits, int64_t V, const SampleOptions& opt, uint64_t index);

// The logits of the last position of a context: the whole (padded) vocabulary row.
using LastLogits = std::function<std::vector<float>(const std::vector<int32_t>& context)>;
// Continues `prompt` (not empty), asking `logits` about the last block_size tokens for each new
// token. Returns only the new tokens.
std::vector<int32_t> sample_with(const LastLogits& logits, int64_t block_size, int64_t vocab,
                                 const std::vector<int32_t>& prompt, const SampleOptions& opt);

// The logits of a context's last position, the whole padded row, on every rank of a model split
// by P: `forward` runs the model on tokens i32 [1, T'] and returns this rank's logits (its rows,
// its vocabulary columns). Under cp or sp the context is padded on the right to a length they
// divide (a causal model's logits at a position ignore later tokens); the row is taken from the
// cp rank holding the position and gathered over tp. Collective over P's cp and tp groups.
std::vector<float> last_position_logits(const model::ChainParallel& P, const model::GPTConfig& cfg,
                                        const std::vector<int32_t>& context,
                                        const std::function<const float*(const Tensor& tokens)>& forward);

// Continues `prompt` (not empty) by running the model on the last block_size tokens for each new
// token. Returns only the new tokens. A model split by tensor, sequence or context parallelism
// samples on its ranks together (collective over its groups).
std::vector<int32_t> sample_recompute(model::GPT& gpt, const std::vector<int32_t>& prompt, const SampleOptions& opt);

}  // namespace loom::train

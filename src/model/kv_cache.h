// Inference with a key/value cache, through the model's own chain blocks: a prompt is prefilled in
// one pass, then each new token costs one incremental forward (one row per sequence through every
// GEMM, attention over the cached keys and values). The decoder runs the model's embedding, every
// layer and the head as replicas over the model's parameters (read at every call, so later weight
// updates are seen), with buffers of its own (tag workspace): one transformer block's worth,
// reused by every layer, so the residual stream is updated in place.
//
// Cache layout: per layer, K and V are [B, T_max, NH, HS] (= [B, T_max, C]) in the backend's
// compute dtype, the row layout of the packed qkv the attention kernels read, so appending a
// token's keys is one copy per row and one attention call covers every head of a sequence
// (q_pos0 = the current position, Tq != Tkv).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/memory.h"
#include "core/tensor.h"
#include "model/gpt.h"

namespace loom::model {

class KVCache {
 public:
  // Room for B sequences of up to t_max positions (<= block_size) from the backend's pool, tag
  // activations.
  KVCache(const GPTConfig& cfg, int64_t B, int64_t t_max, Backend& be);
  int64_t batch() const { return B_; }
  int64_t capacity() const { return t_max_; }
  int64_t length() const { return len_; }  // positions filled (the same for every sequence)
  void clear() { len_ = 0; }
  void* k(int64_t layer) { return k_.at(size_t(layer)).raw(); }  // [B, T_max, C]
  void* v(int64_t layer) { return v_.at(size_t(layer)).raw(); }  // [B, T_max, C]
  int64_t bytes() const;

 private:
  friend class CachedDecoder;
  int64_t B_, t_max_, C_, len_ = 0;  // C_: a cached row's width, the key/value heads'
  std::vector<Tensor> k_, v_;
};

class CachedDecoder {
 public:
  // Decodes with gpt's weights; B sequences of up to t_max positions (0: block_size).
  CachedDecoder(const GPT& gpt, int64_t B, int64_t t_max = 0);

  // Runs tokens i32 [B, T] (host) at positions [length(), length() + T) of every sequence,
  // appending their keys and values to the cache. Returns host logits f32 [B, T, Vp] when
  // all_logits, otherwise f32 [B, 1, Vp] of the last position only (columns >= vocab_size are
  // padding).
  const Tensor& forward(const int32_t* tokens, int64_t T, bool all_logits = false);

  int64_t length() const { return cache_.length(); }
  int64_t capacity() const { return cache_.capacity(); }
  // The attention scratch for any call this decoder can make on `threads` OpenMP threads: what the
  // backend keeps for one sequence's call with every position of the cache as queries and keys
  // (the scratch grows with the keys and, through the team size, with the queries).
  int64_t attention_workspace_bytes(int threads) const;
  void reset() { cache_.clear(); }
  const KVCache& cache() const { return cache_; }

 private:
  const GPT& gpt_;
  GPTConfig cfg_;
  Backend& be_;
  KVCache cache_;
  std::unique_ptr<ChainBlock> emb_, layer_, head_;  // replicas over gpt's parameters
  Tensor last_;         // [B, 1, C]: the last position of each sequence (logits of the last only)
  Tensor host_logits_;  // f32 copy of a device's logits
  bool reserved_ = false;
};

// Picks the next token from logits f32 [vocab_size] of the sequence's `index`-th token.
using TokenSampler = std::function<int32_t(const float* logits, uint64_t index)>;

// Continues `prompt` (not empty) by max_new_tokens tokens with a KV cache, stopping after
// stop_token (-1: never). Identical to recomputing the whole window for every token (as
// train::sample_recompute does): while the context fits block_size the cache grows by one token
// per step; past it, the window of the last block_size tokens is prefilled again at every step
// (their positions shift, so no cached key stays valid). Returns only the new tokens.
std::vector<int32_t> generate_cached(const GPT& gpt, const std::vector<int32_t>& prompt, int64_t max_new_tokens,
                                     const TokenSampler& sample, int32_t stop_token = -1);

}  // namespace loom::model

// Training a byte-level BPE vocabulary: count the words of GPT-2's pre-tokenisation over a corpus,
// then repeatedly merge the most frequent adjacent pair of tokens (ties: the smaller pair of ids).
// The result is a Tokenizer whose save() writes GPT-2's encoder.json + vocab.bpe.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "data/bpe_hash.h"
#include "data/tokenizer.h"

namespace loom::data {

struct TrainOptions {
  // Size of the final vocabulary: 256 byte tokens + merges + special tokens.
  int32_t vocab_size = 0;
  // Added after the learned tokens, in this order; cut out of the training text.
  std::vector<std::string> special_tokens = {"<|endoftext|>"};
  // Stop early when the most frequent pair occurs fewer times than this.
  int64_t min_frequency = 2;
};

struct TrainStats {
  size_t bytes = 0;        // text seen
  size_t words = 0;        // pieces seen
  size_t unique_words = 0;
  size_t merges = 0;
  bool stopped_early = false;  // ran out of pairs at min_frequency before vocab_size
};

class BpeTrainer {
 public:
  explicit BpeTrainer(TrainOptions opt);

  // Counts the words of text (special tokens in it are cut out first).
  void add_text(std::string_view text);
  // Reads a file and counts its words; a loom::Error names the file when it cannot be read.
  void add_file(const std::string& path);

  // Learns the merges. May be called once.
  Tokenizer train();
  const TrainStats& stats() const { return stats_; }

 private:
  void count_words(std::string_view text);

  TrainOptions opt_;
  FlatStringMap<int64_t> counts_{1 << 12};
  TrainStats stats_;
  bool trained_ = false;
};

}  // namespace loom::data

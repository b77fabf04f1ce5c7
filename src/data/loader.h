// Deterministic batches from memory-mapped token shards.
//
// Training sample i of step s (i is the sample's index within the step's global batch of B) is the
// run's sample base + s * B + i, and starts at a position drawn from (seed, split, that index)
// alone, so the tokens a sample sees never depend on how many data-parallel ranks read the batch
// or on which rank reads it. The base is 0 unless a resumed run changed B: then it makes the
// resumed steps draw the samples after the ones the run has used (Megatron-LM's consumed samples).
// Validation batches are fixed, consecutive windows from the start of the split.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "data/shard.h"

namespace loom::data {

// Which shards' payloads (checksum, token ids against the vocabulary) a Loader verifies: those
// whose index i has i % parts == part (none for part -1); every shard's header and size are
// checked. The ranks of a `loom train` job each open the splits with their own part, so the job
// verifies each shard once, not once per rank (a rank that finds a damaged shard fails the job
// before its first step, naming the file). Every rank must then read the same files (a shared
// filesystem): with a copy of data.dir per node, a node's copy is verified only in the shards its
// own ranks' parts hold (ids out of the vocabulary are still refused wherever they are read).
struct VerifyShare {
  int part = 0, parts = 1;
  static VerifyShare none() { return {-1, 1}; }
};

class Loader {
 public:
  // Opens DIR/<split>_*.bin. Every window is seq_len + 1 tokens (inputs and shifted targets).
  Loader(const std::string& dir, const std::string& split, int64_t seq_len, uint64_t seed, VerifyShare verify = {});

  int64_t seq_len() const { return T_; }
  uint64_t total_tokens() const { return total_; }
  uint32_t vocab_size() const { return vocab_; }
  const std::vector<std::string>& files() const { return files_; }

  // Samples [first, first + n) of training step `step` whose global batch is `global_batch`:
  // inputs and targets i32 [n, T].
  void train_batch(int64_t step, int64_t global_batch, int64_t first, int64_t n, int32_t* inputs,
                   int32_t* targets) const;
  // Training sample `index` of the run (its window from the start of the split's draws: the same
  // for every step's batch and any resume): inputs and targets i32 [T].
  void sample(uint64_t index, int32_t* inputs, int32_t* targets) const {
    read_window(sample_start(index), inputs, targets);
  }
  // Step `step` of global batch `global_batch` starts at training sample `consumed` (the samples
  // the run drew before it): a resumed run whose batch differs from the checkpoint's.
  void resume_at(int64_t step, int64_t global_batch, int64_t consumed);
  // The training samples drawn before step `step` of global batch `global_batch`.
  int64_t consumed(int64_t step, int64_t global_batch) const { return base_ + step * global_batch; }
  // Validation batch `index` of `global_batch` consecutive windows; samples [first, first + n).
  void val_batch(int64_t index, int64_t global_batch, int64_t first, int64_t n, int32_t* inputs,
                 int32_t* targets) const;
  // How many whole validation batches of global_batch windows the split holds.
  int64_t val_batches(int64_t global_batch) const;
  // Start position of training sample `global_index` (exposed for tests).
  uint64_t sample_start(uint64_t global_index) const;

  // Tokens [pos, pos + n) of the split (across shards) into out.
  void read(uint64_t pos, uint64_t n, int32_t* out) const;
  // The shard holding token `pos` of the split, and the token's index in it.
  std::pair<std::string, uint64_t> locate(uint64_t pos) const;

 private:
  void read_window(uint64_t start, int32_t* inputs, int32_t* targets) const;
  std::vector<std::string> files_;
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<uint64_t> begin_;  // prefix sums of shard sizes
  uint64_t total_ = 0;
  int64_t T_;
  uint64_t seed_;
  uint64_t stream_;
  int64_t base_ = 0;  // the sample index of step 0's first sample (see resume_at)
  uint32_t vocab_ = 0;
};

}  // namespace loom::data

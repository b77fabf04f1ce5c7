#include "data/loader.h"

#include <algorithm>

#include "core/error.h"
#include "core/rng.h"

namespace loom::data {

Loader::Loader(const std::string& dir, const std::string& split, int64_t seq_len, uint64_t seed, VerifyShare verify)
    : T_(seq_len), seed_(seed), stream_(stream_of("data/" + split)) {
  LOOM_REQUIRE(seq_len > 0, "sequence length must be positive, got {}", seq_len);
  LOOM_CHECK(verify.parts >= 1 && verify.part >= -1 && verify.part < verify.parts, "Loader: verify part {} of {}",
             verify.part, verify.parts);
  files_ = list_shards(dir, split);
  LOOM_REQUIRE(!files_.empty(), "{}: no {}_*.bin token shards (run `loom prepare` first)", dir, split);
  for (size_t i = 0; i < files_.size(); ++i) {
    const std::string& f = files_[i];
    shards_.push_back(std::make_unique<Shard>(f, int(i % size_t(verify.parts)) == verify.part));
    begin_.push_back(total_);
    total_ += shards_.back()->size();
    const uint32_t v = shards_.back()->vocab_size();
    LOOM_REQUIRE(vocab_ == 0 || v == vocab_,
               "{}: vocabulary size {} differs from {}'s {}: the shards of one corpus share one tokenizer "
               "(re-run `loom prepare`)",
               f, v, files_.front(), vocab_);
    vocab_ = v;
  }
  LOOM_REQUIRE(total_ >= uint64_t(T_) + 1, "{}: the {} split holds {} tokens, fewer than one window of {}", dir, split,
             total_, T_ + 1);
}

uint64_t Loader::sample_start(uint64_t global_index) const {
  auto r = philox4x32(seed_, stream_, global_index);
  uint64_t x = (uint64_t(r[0]) << 32) | r[1];
  return x % (total_ - uint64_t(T_));  // windows [start, start + T + 1) fit in the split
}

void Loader::read(uint64_t pos, uint64_t n, int32_t* out) const {
  LOOM_CHECK(pos <= total_ && n <= total_ - pos, "tokens [{}, {}) outside the split's {}", pos, pos + n, total_);
  uint64_t done = 0;
  size_t s = size_t(std::upper_bound(begin_.begin(), begin_.end(), pos) - begin_.begin()) - 1;
  while (done < n) {
    const uint64_t local = pos - begin_[s];
    const uint64_t take = std::min(n - done, shards_[s]->size() - local);
    shards_[s]->read(local, take, out + done);
    done += take;
    pos += take;
    ++s;
  }
}

std::pair<std::string, uint64_t> Loader::locate(uint64_t pos) const {
  LOOM_CHECK(pos < total_, "token {} outside the split's {}", pos, total_);
  const size_t s = size_t(std::upper_bound(begin_.begin(), begin_.end(), pos) - begin_.begin()) - 1;
  return {files_[s], pos - begin_[s]};
}

void Loader::read_window(uint64_t start, int32_t* inputs, int32_t* targets) const {
  // The window may cross shard boundaries: gather T + 1 tokens, then split into inputs/targets.
  std::vector<int32_t> buf(size_t(T_) + 1);
  read(start, uint64_t(T_) + 1, buf.data());
  std::copy(buf.begin(), buf.begin() + T_, inputs);
  std::copy(buf.begin() + 1, buf.end(), targets);
}

void Loader::train_batch(int64_t step, int64_t global_batch, int64_t first, int64_t n, int32_t* inputs,
                         int32_t* targets) const {
  LOOM_CHECK(step >= 0 && first >= 0 && n >= 0 && first + n <= global_batch,
             "samples [{}, {}) outside the global batch of {}", first, first + n, global_batch);
  LOOM_CHECK(consumed(step, global_batch) >= 0, "training step {} of {} samples starts before the first sample",
             step, global_batch);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t g = uint64_t(consumed(step, global_batch) + first + i);
    read_window(sample_start(g), inputs + i * T_, targets + i * T_);
  }
}

void Loader::resume_at(int64_t step, int64_t global_batch, int64_t consumed) {
  LOOM_CHECK(step >= 0 && global_batch >= 1 && consumed >= 0, "resume_at: step {}, batch {}, consumed {}", step,
             global_batch, consumed);
  base_ = consumed - step * global_batch;
}

int64_t Loader::val_batches(int64_t global_batch) const {
  return int64_t((total_ - 1) / uint64_t(T_)) / global_batch;
}

void Loader::val_batch(int64_t index, int64_t global_batch, int64_t first, int64_t n, int32_t* inputs,
                       int32_t* targets) const {
  LOOM_CHECK(index >= 0 && index < val_batches(global_batch), "validation batch {} out of range ({} batches)", index,
             val_batches(global_batch));
  LOOM_CHECK(first >= 0 && n >= 0 && first + n <= global_batch, "samples [{}, {}) outside the batch of {}", first,
             first + n, global_batch);
  for (int64_t i = 0; i < n; ++i) {
    uint64_t w = uint64_t(index) * uint64_t(global_batch) + uint64_t(first + i);
    read_window(w * uint64_t(T_), inputs + i * T_, targets + i * T_);
  }
}

}  // namespace loom::data

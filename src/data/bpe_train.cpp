#include "data/bpe_train.h"

#include <algorithm>
#include <fstream>
#include <queue>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "core/file.h"
#include "data/bpe_pretokenize.h"

namespace loom::data {

BpeTrainer::BpeTrainer(TrainOptions opt) : opt_(std::move(opt)) {
  const size_t floor = 256 + opt_.special_tokens.size();
  if (opt_.vocab_size < 0 || size_t(opt_.vocab_size) < floor) {
    throw Error(fmt::format("tokenizer train: vocab_size {} is smaller than the 256 byte tokens + "
                            "{} special tokens", opt_.vocab_size, opt_.special_tokens.size()));
  }
  if (opt_.min_frequency < 1) {
    throw Error(fmt::format("tokenizer train: min_frequency must be at least 1, got {}",
                            opt_.min_frequency));
  }
  for (size_t i = 0; i < opt_.special_tokens.size(); ++i) {
    const std::string& s = opt_.special_tokens[i];
    if (s.size() < 2) {
      throw Error(fmt::format("tokenizer train: special token \"{}\" must be at least two bytes", s));
    }
    if (std::find(opt_.special_tokens.begin(), opt_.special_tokens.begin() + i, s) !=
        opt_.special_tokens.begin() + i) {
      throw Error(fmt::format("tokenizer train: special token \"{}\" is listed twice", s));
    }
  }
}

void BpeTrainer::count_words(std::string_view text) {
  stats_.bytes += text.size();
  PreTokenizer pre(text);
  std::string_view piece;
  while (pre.next(&piece)) {
    ++*counts_.insert(piece, 0).first;
    ++stats_.words;
  }
}

void BpeTrainer::add_text(std::string_view text) {
  LOOM_CHECK(!trained_, "BpeTrainer: add_text after train()");
  size_t pos = 0;
  while (pos < text.size()) {
    size_t at = std::string_view::npos, len = 0;
    for (const std::string& s : opt_.special_tokens) {
      const size_t k = text.find(s, pos);
      if (k < at || (k == at && s.size() > len)) {
        at = k;
        len = s.size();
      }
    }
    if (at == std::string_view::npos) {
      count_words(text.substr(pos));
      break;
    }
    count_words(text.substr(pos, at - pos));
    pos = at + len;
  }
}

void BpeTrainer::add_file(const std::string& path) {
  add_text(read_file(path));
}

namespace {

uint64_t pair_key(int32_t l, int32_t r) { return (uint64_t(uint32_t(l)) << 32) | uint32_t(r); }

struct Candidate {
  int64_t count;
  uint64_t key;
  // priority_queue pops the largest: higher count first, then the smaller pair.
  bool operator<(const Candidate& o) const {
    return count != o.count ? count < o.count : key > o.key;
  }
};

}  // namespace

Tokenizer BpeTrainer::train() {
  LOOM_CHECK(!trained_, "BpeTrainer: train() called twice");
  trained_ = true;
  // Ids 0-255 are the bytes, in GPT-2's order.
  std::vector<std::string> tokens;
  int32_t byte_id[256];
  for (uint8_t b : gpt2_byte_order()) {
    byte_id[b] = int32_t(tokens.size());
    tokens.emplace_back(1, char(b));
  }
  FlatStringMap<int32_t> token_ids(size_t(opt_.vocab_size));
  for (size_t id = 0; id < tokens.size(); ++id) token_ids.insert(tokens[id], int32_t(id));

  // The distinct words as token sequences, in a fixed order (by bytes) so training is
  // deterministic whatever order the hash table holds them in.
  std::vector<std::pair<std::string_view, int64_t>> sorted;
  sorted.reserve(counts_.size());
  std::vector<std::vector<int32_t>> words;
  std::vector<int64_t> freq;
  counts_.for_each([&](std::string_view w, int64_t c) { sorted.emplace_back(w, c); });
  std::sort(sorted.begin(), sorted.end());
  stats_.unique_words = sorted.size();
  words.reserve(sorted.size());
  freq.reserve(sorted.size());
  for (const auto& [w, c] : sorted) {
    std::vector<int32_t> ids(w.size());
    for (size_t i = 0; i < w.size(); ++i) ids[i] = byte_id[uint8_t(w[i])];
    words.push_back(std::move(ids));
    freq.push_back(c);
  }

  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<uint32_t>> where;
  for (uint32_t w = 0; w < words.size(); ++w) {
    const auto& ids = words[w];
    for (size_t i = 0; i + 1 < ids.size(); ++i) {
      const uint64_t k = pair_key(ids[i], ids[i + 1]);
      pair_count[k] += freq[w];
      auto& list = where[k];
      if (list.empty() || list.back() != w) list.push_back(w);
    }
  }
  std::priority_queue<Candidate> heap;
  for (const auto& [k, c] : pair_count) heap.push({c, k});

  std::vector<std::pair<int32_t, int32_t>> merges;
  std::vector<uint32_t> visited(words.size(), UINT32_MAX);
  std::unordered_map<uint64_t, int64_t> delta;
  const size_t target = size_t(opt_.vocab_size) - opt_.special_tokens.size();
  std::string joined;
  while (tokens.size() < target) {
    if (heap.empty()) {
      stats_.stopped_early = true;
      break;
    }
    const Candidate best = heap.top();
    heap.pop();
    auto it = pair_count.find(best.key);
    if (it == pair_count.end() || it->second != best.count) continue;  // stale entry
    if (best.count < opt_.min_frequency) {
      stats_.stopped_early = true;
      break;
    }
    const int32_t l = int32_t(best.key >> 32), r = int32_t(best.key & 0xFFFFFFFFu);
    joined = tokens[l] + tokens[r];
    if (std::find(opt_.special_tokens.begin(), opt_.special_tokens.end(), joined) !=
        opt_.special_tokens.end()) {
      pair_count.erase(it);  // never learn a special token as text
      continue;
    }
    int32_t made;
    if (const int32_t* id = token_ids.find(joined)) {
      made = *id;  // another pair already made these bytes
    } else {
      made = int32_t(tokens.size());
      tokens.push_back(joined);
      token_ids.insert(joined, made);
    }
    const uint32_t merge_index = uint32_t(merges.size());
    merges.emplace_back(l, r);

    // Rewrite every word holding the pair; keep the pair counts exact by difference.
    delta.clear();
    std::vector<uint32_t> list = std::move(where[best.key]);
    where.erase(best.key);
    for (uint32_t w : list) {
      if (visited[w] == merge_index) continue;
      visited[w] = merge_index;
      auto& ids = words[w];
      bool found = false;
      for (size_t i = 0; i + 1 < ids.size() && !found; ++i) found = ids[i] == l && ids[i + 1] == r;
      if (!found) continue;
      const int64_t c = freq[w];
      for (size_t i = 0; i + 1 < ids.size(); ++i) delta[pair_key(ids[i], ids[i + 1])] -= c;
      size_t out = 0;
      for (size_t i = 0; i < ids.size();) {
        if (i + 1 < ids.size() && ids[i] == l && ids[i + 1] == r) {
          ids[out++] = made;
          i += 2;
        } else {
          ids[out++] = ids[i++];
        }
      }
      ids.resize(out);
      for (size_t i = 0; i + 1 < ids.size(); ++i) {
        const uint64_t k = pair_key(ids[i], ids[i + 1]);
        delta[k] += c;
        if (ids[i] == made || ids[i + 1] == made) {
          auto& wl = where[k];
          if (wl.empty() || wl.back() != w) wl.push_back(w);
        }
      }
    }
    for (const auto& [k, d] : delta) {
      if (d == 0) continue;
      int64_t& c = pair_count[k];
      c += d;
      if (c <= 0) {
        pair_count.erase(k);
      } else {
        heap.push({c, k});
      }
    }
  }
  stats_.merges = merges.size();

  std::vector<int32_t> special;
  for (const std::string& s : opt_.special_tokens) {
    special.push_back(int32_t(tokens.size()));
    tokens.push_back(s);
  }
  return Tokenizer::from_parts(std::move(tokens), merges, special);
}

}  // namespace loom::data

#include "data/bpe_merge.h"

#include <algorithm>
#include <bit>

namespace loom::data {

void MergeTable::reserve(size_t n) {
  size_t c = 16;
  while (c < n * 2) c *= 2;
  if (c > slots_.size()) rehash(c);
  results_.reserve(n);
}

void MergeTable::rehash(size_t capacity) {
  std::vector<Slot> old = std::move(slots_);
  slots_.assign(capacity, Slot{});
  mask_ = capacity - 1;
  shift_ = 64 - std::countr_zero(capacity);
  for (const Slot& s : old) {
    if (s.key == kEmpty) continue;
    for (size_t i = slot_of(s.key);; i = (i + 1) & mask_) {
      if (slots_[i].key == kEmpty) {
        slots_[i] = s;
        break;
      }
    }
  }
}

bool MergeTable::insert(int32_t left, int32_t right, Merge m) {
  if ((size_ + 1) * 2 > slots_.size()) rehash(slots_.size() * 2);
  const uint64_t key = pair_key(left, right);
  for (size_t i = slot_of(key);; i = (i + 1) & mask_) {
    Slot& s = slots_[i];
    if (s.key == key) return false;
    if (s.key == kEmpty) {
      s.key = key;
      s.merge = m;
      const uint64_t f = filter_bit(key);
      filter_[f >> 6] |= uint64_t(1) << (f & 63);
      ++size_;
      if (results_.size() <= m.rank) results_.resize(size_t(m.rank) + 1, -1);
      results_[m.rank] = m.id;
      return true;
    }
  }
}

size_t bpe_merge_linear(const MergeTable& merges, int32_t* ids, size_t n, BpeScratch& sc) {
  if (n < 2) return n;
  sc.ranks.resize(n);
  sc.index.resize(n);
  sc.merged.resize(n);
  uint32_t* ranks = sc.ranks.data();  // [n - 1] rank of (ids[i], ids[i + 1])
  uint32_t* index = sc.index.data();  // [n] old position of each token after a pass
  uint8_t* merged = sc.merged.data();  // [n] 1 where the token was made in this pass
  for (size_t i = 0; i + 1 < n; ++i) ranks[i] = merges.rank(ids[i], ids[i + 1]);
  while (n > 1) {
    const uint32_t best = *std::min_element(ranks, ranks + n - 1);
    if (best == kNoRank) break;
    const int32_t made = merges.result(best);
    // One pass over the old word: every occurrence of the best pair, left to right.
    size_t w = 0;
    for (size_t i = 0; i < n;) {
      index[w] = uint32_t(i);
      if (i + 1 < n && ranks[i] == best) {
        ids[w] = made;
        merged[w++] = 1;
        i += 2;
      } else {
        ids[w] = ids[i];
        merged[w++] = 0;
        i += 1;
      }
    }
    // Two untouched neighbours were neighbours before: keep their rank; look up the rest.
    for (size_t k = 0; k + 1 < w; ++k) {
      ranks[k] = (merged[k] | merged[k + 1]) ? merges.rank(ids[k], ids[k + 1]) : ranks[index[k]];
    }
    n = w;
  }
  return n;
}

size_t bpe_merge_heap(const MergeTable& merges, int32_t* ids, size_t n, BpeScratch& sc) {
  if (n < 2) return n;
  using Entry = BpeScratch::HeapEntry;
  // Min-heap on (rank, position): std heap functions build max-heaps, so invert the order.
  auto later = [](const Entry& a, const Entry& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  sc.prev.resize(n);
  sc.next.resize(n);
  int32_t* prev = sc.prev.data();  // [n] linked list over surviving tokens, -1 at the ends
  int32_t* next = sc.next.data();  // [n]
  auto& heap = sc.heap;
  heap.clear();
  for (size_t i = 0; i < n; ++i) {
    prev[i] = int32_t(i) - 1;
    next[i] = i + 1 < n ? int32_t(i + 1) : -1;
    if (i + 1 < n) {
      const uint32_t r = merges.rank(ids[i], ids[i + 1]);
      if (r != kNoRank) heap.push_back({r, uint32_t(i), ids[i], ids[i + 1]});
    }
  }
  std::make_heap(heap.begin(), heap.end(), later);
  // A position whose token was merged into its left neighbour is dead: ids[pos] = -1.
  auto push_pair = [&](int32_t l) {
    if (l < 0 || next[l] < 0) return;
    const uint32_t r = merges.rank(ids[l], ids[next[l]]);
    if (r == kNoRank) return;
    heap.push_back({r, uint32_t(l), ids[l], ids[next[l]]});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  while (!heap.empty()) {
    const uint32_t best = heap.front().rank;
    const int32_t made = merges.result(best);
    sc.batch.clear();
    // All occurrences of the best pair, left to right, judged against the word as it was
    // before this pass (a token merged in this pass only ever appears at its own position).
    while (!heap.empty() && heap.front().rank == best) {
      std::pop_heap(heap.begin(), heap.end(), later);
      const Entry e = heap.back();
      heap.pop_back();
      const int32_t r = next[e.pos];
      if (ids[e.pos] != e.left || r < 0 || ids[r] != e.right) continue;
      ids[e.pos] = made;
      ids[r] = -1;
      next[e.pos] = next[r];
      if (next[r] >= 0) prev[next[r]] = int32_t(e.pos);
      sc.batch.push_back(e.pos);
    }
    for (uint32_t pos : sc.batch) {
      if (ids[pos] != made) continue;
      push_pair(prev[pos]);  // duplicates are harmless: the second one fails validation
      push_pair(int32_t(pos));
    }
  }
  size_t w = 0;
  for (int32_t i = 0; i >= 0; i = next[i]) ids[w++] = ids[i];
  return w;
}

size_t bpe_merge(const MergeTable& merges, int32_t* ids, size_t n, BpeScratch& scratch) {
  return n <= 64 ? bpe_merge_linear(merges, ids, n, scratch)
                 : bpe_merge_heap(merges, ids, n, scratch);
}

}  // namespace loom::data

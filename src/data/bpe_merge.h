// The merge step of byte-level BPE: a table of ranked merges and the function that applies them
// to a word's tokens exactly as GPT-2 does (repeatedly take the lowest-ranked adjacent pair and
// merge all its non-overlapping occurrences, left to right).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace loom::data {

inline constexpr uint32_t kNoRank = UINT32_MAX;

// (left id, right id) -> (rank, merged id), open addressing over 64-bit pair keys.
class MergeTable {
 public:
  struct Merge {
    uint32_t rank;
    int32_t id;
  };

  void reserve(size_t n);
  // Adds a merge; returns false (and changes nothing) when the pair already has one.
  bool insert(int32_t left, int32_t right, Merge m);
  size_t size() const { return size_; }

  const Merge* find(int32_t left, int32_t right) const {
    const uint64_t key = pair_key(left, right);
    // Most pairs in a word have no merge: a small bit filter (in L2) answers those without a
    // trip to the table.
    const uint64_t f = filter_bit(key);
    if (!((filter_[f >> 6] >> (f & 63)) & 1)) return nullptr;
    for (size_t i = slot_of(key);; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.key == key) return &s.merge;
      if (s.key == kEmpty) return nullptr;
    }
  }
  uint32_t rank(int32_t left, int32_t right) const {
    const Merge* m = find(left, right);
    return m ? m->rank : kNoRank;
  }
  // The merged id of the merge with this rank.
  int32_t result(uint32_t rank) const { return results_[rank]; }

 private:
  static constexpr uint64_t kEmpty = UINT64_MAX;
  struct Slot {
    uint64_t key = kEmpty;
    Merge merge{};
  };
  static uint64_t pair_key(int32_t l, int32_t r) { return (uint64_t(uint32_t(l)) << 32) | uint32_t(r); }
  size_t slot_of(uint64_t key) const { return size_t((key * 0x9E3779B97F4A7C15ull) >> shift_); }
  static constexpr int kFilterBits = 20;
  static uint64_t filter_bit(uint64_t key) { return (key * 0xD6E8FEB86659FD93ull) >> (64 - kFilterBits); }
  void rehash(size_t capacity);

  std::vector<Slot> slots_ = std::vector<Slot>(16);
  std::vector<uint64_t> filter_ = std::vector<uint64_t>(size_t(1) << (kFilterBits - 6));
  std::vector<int32_t> results_;  // [ranks] merged id per rank (kNoRank slots are -1)
  size_t mask_ = 15;
  int shift_ = 60;
  size_t size_ = 0;
};

// Reusable buffers for bpe_merge (one per thread).
struct BpeScratch {
  std::vector<uint32_t> ranks;
  std::vector<uint32_t> index;
  std::vector<uint8_t> merged;
  std::vector<int32_t> prev, next;
  struct HeapEntry {
    uint32_t rank;
    uint32_t pos;
    int32_t left, right;
  };
  std::vector<HeapEntry> heap;
  std::vector<uint32_t> batch;
};

// Merges ids[0, n) in place and returns the new length. Short words use a linear scan, long ones
// a heap, both with GPT-2's semantics.
size_t bpe_merge(const MergeTable& merges, int32_t* ids, size_t n, BpeScratch& scratch);
size_t bpe_merge_linear(const MergeTable& merges, int32_t* ids, size_t n, BpeScratch& scratch);
size_t bpe_merge_heap(const MergeTable& merges, int32_t* ids, size_t n, BpeScratch& scratch);

}  // namespace loom::data

// Open-addressing hash tables for the BPE tokenizer's hot paths: pair -> merge, and byte string
// -> value with string_view lookups (no allocation per lookup).
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace loom::data {

// The first min(8, n) bytes of p as a little-endian word, zero-padded, without reading past p + n.
inline uint64_t load_head(const char* p, size_t n) {
  uint64_t w = 0;
  if (n >= 8) {
    std::memcpy(&w, p, 8);
  } else if (n >= 4) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + n - 4, 4);
    w = uint64_t(lo) | (uint64_t(hi) << ((n - 4) * 8));
  } else if (n > 0) {
    w = uint64_t(uint8_t(p[0])) | (uint64_t(uint8_t(p[n / 2])) << (n / 2 * 8)) |
        (uint64_t(uint8_t(p[n - 1])) << ((n - 1) * 8));
  }
  return w;
}

// A fast 64-bit hash of a byte string (multiply-xorshift over 8-byte words).
inline uint64_t hash_bytes(std::string_view s) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  const char* p = s.data();
  size_t n = s.size();
  uint64_t h = (0x243F6A8885A308D3ull ^ n) * kMul;
  while (n > 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ w) * kMul;
    h ^= h >> 29;
    p += 8;
    n -= 8;
  }
  h = (h ^ load_head(p, n)) * kMul;
  return h ^ (h >> 32);
}

// Byte string -> V. Keys are copied into one arena; lookups take string_views.
template <class V>
class FlatStringMap {
 public:
  explicit FlatStringMap(size_t expected = 16) { rehash(capacity_for(expected)); }

  size_t size() const { return size_; }
  size_t arena_bytes() const { return arena_.size(); }

  const V* find(std::string_view key) const { return find(key, hash_bytes(key)); }
  const V* find(std::string_view key, uint64_t h) const {
    const uint64_t head = load_head(key.data(), key.size());
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.len == kEmpty) return nullptr;
      if (s.head == head && s.len == key.size() && s.hash == uint32_t(h >> 32) &&
          (key.size() <= 8 ||
           std::memcmp(arena_.data() + s.off + 8, key.data() + 8, key.size() - 8) == 0)) {
        return &s.value;
      }
    }
  }

  // Inserts key -> value unless key is present; returns the stored value and whether it is new.
  std::pair<V*, bool> insert(std::string_view key, const V& value) {
    return insert(key, hash_bytes(key), value);
  }
  std::pair<V*, bool> insert(std::string_view key, uint64_t h, const V& value) {
    if ((size_ + 1) * 2 > slots_.size()) rehash(slots_.size() * 2);
    const uint64_t head = load_head(key.data(), key.size());
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.len == kEmpty) {
        s = Slot{uint32_t(h >> 32), uint32_t(key.size()), head, uint32_t(arena_.size()), value};
        arena_.append(key);
        ++size_;
        return {&s.value, true};
      }
      if (s.head == head && s.len == key.size() && s.hash == uint32_t(h >> 32) &&
          std::memcmp(arena_.data() + s.off, key.data(), key.size()) == 0) {
        return {&s.value, false};
      }
    }
  }

  // Calls fn(key, value) for every entry, in no particular order.
  template <class F>
  void for_each(F&& fn) const {
    for (const Slot& s : slots_) {
      if (s.len != kEmpty) fn(std::string_view(arena_.data() + s.off, s.len), s.value);
    }
  }

  void clear() {
    arena_.clear();
    size_ = 0;
    for (Slot& s : slots_) s.len = kEmpty;
  }

 private:
  static constexpr uint32_t kEmpty = UINT32_MAX;
  // Keys of up to 8 bytes compare within the slot; longer ones also read the arena.
  struct Slot {
    uint32_t hash = 0;  // high half of the 64-bit hash (the low bits pick the slot)
    uint32_t len = kEmpty;
    uint64_t head = 0;  // load_head(key)
    uint32_t off = 0;   // key bytes in arena_
    V value{};
  };
  static size_t capacity_for(size_t n) {
    size_t c = 16;
    while (c < n * 2) c *= 2;
    return c;
  }
  std::string_view key_of(const Slot& s) const { return std::string_view(arena_.data() + s.off, s.len); }
  void rehash(size_t capacity) {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(capacity, Slot{});
    mask_ = capacity - 1;
    for (const Slot& s : old) {
      if (s.len == kEmpty) continue;
      for (size_t i = size_t(hash_bytes(key_of(s))) & mask_;; i = (i + 1) & mask_) {
        if (slots_[i].len == kEmpty) {
          slots_[i] = s;
          break;
        }
      }
    }
  }

  std::vector<Slot> slots_;
  std::string arena_;
  size_t mask_ = 0;
  size_t size_ = 0;
};

}  // namespace loom::data

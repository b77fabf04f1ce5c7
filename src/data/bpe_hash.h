// Open-addressing hash tables for the BPE tokenizer's hot paths: pair -> merge, and byte string
// -> value with string_view lookups (no allocation per lookup).
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace loom::data {

// A fast 64-bit hash of a byte string (multiply-xorshift over 8-byte words).
inline uint64_t hash_bytes(std::string_view s) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  uint64_t h = 0x243F6A8885A308D3ull ^ (uint64_t(s.size()) * kMul);
  const char* p = s.data();
  size_t n = s.size();
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = (h ^ w) * kMul;
    h ^= h >> 29;
    p += 8;
    n -= 8;
  }
  if (n > 0) {
    uint64_t w = 0;
    std::memcpy(&w, p, n);
    h = (h ^ w) * kMul;
    h ^= h >> 29;
  }
  h *= kMul;
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
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.len == kEmpty) return nullptr;
      if (s.hash == h && s.len == key.size() &&
          std::memcmp(arena_.data() + s.off, key.data(), key.size()) == 0) {
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
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.len == kEmpty) {
        s = Slot{h, uint32_t(arena_.size()), uint32_t(key.size()), value};
        arena_.append(key);
        ++size_;
        return {&s.value, true};
      }
      if (s.hash == h && s.len == key.size() &&
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
  struct Slot {
    uint64_t hash = 0;
    uint32_t off = 0;
    uint32_t len = kEmpty;
    V value{};
  };
  static size_t capacity_for(size_t n) {
    size_t c = 16;
    while (c < n * 2) c *= 2;
    return c;
  }
  void rehash(size_t capacity) {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(capacity, Slot{});
    mask_ = capacity - 1;
    for (const Slot& s : old) {
      if (s.len == kEmpty) continue;
      for (size_t i = s.hash & mask_;; i = (i + 1) & mask_) {
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

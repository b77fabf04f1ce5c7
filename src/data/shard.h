// Token shards: the on-disk form of a tokenised corpus, and the memory-mapped reader.
//
// Layout (little endian):
//   offset 0   char[8]  magic "LOOMTOK\0"
//   offset 8   u32      version (1)
//   offset 12  u32      token width in bytes (2: uint16 tokens, 4: uint32 tokens)
//   offset 16  u64      token count
//   offset 24  u32      vocabulary size (every token is < this)
//   offset 28  u32      CRC-32 of the token payload
//   offset 32  u32      CRC-32 of bytes [0, 32) of the header
//   offset 36  ...      zero up to 64
//   offset 64  tokens   count x width bytes
// The file size must be exactly 64 + count x width: truncation, trailing bytes and any flipped
// bit in the header or the payload are reported with the file name and the field.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace loom::data {

constexpr char kShardMagic[8] = {'L', 'O', 'O', 'M', 'T', 'O', 'K', '\0'};
constexpr uint32_t kShardVersion = 1;
constexpr size_t kShardHeaderBytes = 64;

// Writes a shard atomically (temporary name, fsync, rename). Width is 2 when vocab_size <= 65536.
void write_shard(const std::string& path, std::span<const uint32_t> tokens, uint32_t vocab_size);

// A read-only memory-mapped shard. The constructor validates the header and (unless
// verify_payload is false) the payload checksum.
class Shard {
 public:
  explicit Shard(const std::string& path, bool verify_payload = true);
  ~Shard();
  Shard(const Shard&) = delete;
  Shard& operator=(const Shard&) = delete;

  const std::string& path() const { return path_; }
  uint64_t size() const { return count_; }
  uint32_t vocab_size() const { return vocab_; }
  uint32_t width() const { return width_; }
  uint32_t at(uint64_t i) const;
  // Copies tokens [first, first + n) into out as int32.
  void read(uint64_t first, uint64_t n, int32_t* out) const;

 private:
  std::string path_;
  int fd_ = -1;
  const uint8_t* map_ = nullptr;
  size_t map_bytes_ = 0;
  uint64_t count_ = 0;
  uint32_t width_ = 0, vocab_ = 0;
};

uint32_t crc32(const void* data, size_t n, uint32_t crc = 0);

// The shard files of one split in a data directory, DIR/<split>_*.bin, in natural order (numbers
// compare as numbers: train_999.bin before train_1000.bin, the order `loom prepare` numbers them).
std::vector<std::string> list_shards(const std::string& dir, const std::string& split);

}  // namespace loom::data

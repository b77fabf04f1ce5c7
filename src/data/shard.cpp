#include "data/shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/file.h"

namespace loom::data {

namespace {

std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    t[i] = c;
  }
  return t;
}

// Slicing-by-8 tables for a fast CRC-32 (IEEE).
struct CrcTables {
  uint32_t t[8][256];
  CrcTables() {
    auto base = make_crc_table();
    for (int i = 0; i < 256; ++i) t[0][i] = base[size_t(i)];
    for (int k = 1; k < 8; ++k)
      for (int i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
  }
};

template <class T> void put(uint8_t* p, T v) { std::memcpy(p, &v, sizeof(T)); }
template <class T> T get(const uint8_t* p) { T v; std::memcpy(&v, p, sizeof(T)); return v; }

}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) {
  static const CrcTables tab;
  const uint8_t* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  while (n >= 8) {
    uint32_t a = get<uint32_t>(p) ^ crc, b = get<uint32_t>(p + 4);
    crc = tab.t[7][a & 0xff] ^ tab.t[6][(a >> 8) & 0xff] ^ tab.t[5][(a >> 16) & 0xff] ^ tab.t[4][a >> 24] ^
          tab.t[3][b & 0xff] ^ tab.t[2][(b >> 8) & 0xff] ^ tab.t[1][(b >> 16) & 0xff] ^ tab.t[0][b >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) crc = tab.t[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
  return ~crc;
}

void write_shard(const std::string& path, std::span<const uint32_t> tokens, uint32_t vocab_size) {
  LOOM_CHECK(vocab_size > 0, "{}: vocabulary size must be positive", path);
  uint32_t width = vocab_size <= 65536 ? 2 : 4;
  std::vector<uint8_t> payload(tokens.size() * width);
  for (size_t i = 0; i < tokens.size(); ++i) {
    LOOM_CHECK(tokens[i] < vocab_size, "{}: token {} at index {} is outside the vocabulary of {}", path, tokens[i],
               i, vocab_size);
    if (width == 2) put<uint16_t>(&payload[i * 2], uint16_t(tokens[i]));
    else put<uint32_t>(&payload[i * 4], tokens[i]);
  }
  uint8_t header[kShardHeaderBytes] = {};
  std::memcpy(header, kShardMagic, 8);
  put<uint32_t>(header + 8, kShardVersion);
  put<uint32_t>(header + 12, width);
  put<uint64_t>(header + 16, uint64_t(tokens.size()));
  put<uint32_t>(header + 24, vocab_size);
  put<uint32_t>(header + 28, crc32(payload.data(), payload.size()));
  put<uint32_t>(header + 32, crc32(header, 32));

  AtomicFile f(path, {.durable = true});
  f.write(header, sizeof header);
  f.write(payload.data(), payload.size());
  f.commit();
}

Shard::Shard(const std::string& path, bool verify_payload) : path_(path) {
  // O_NONBLOCK: a FIFO (or a device) under a shard's name opens at once and is refused below,
  // where a blocking open would wait for a writer forever. It changes nothing for a regular file.
  fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK);
  if (fd_ < 0) throw Error(fmt::format("{}: cannot open token shard: {}", path, std::strerror(errno)));
  struct stat st{};
  if (::fstat(fd_, &st) != 0) {
    ::close(fd_);
    throw Error(fmt::format("{}: cannot stat: {}", path, std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    throw Error(fmt::format("{}: is not a regular file (a token shard is one)", path));
  }
  map_bytes_ = size_t(st.st_size);
  auto fail = [&](const std::string& msg) {
    if (map_) ::munmap(const_cast<uint8_t*>(map_), map_bytes_);
    ::close(fd_);
    map_ = nullptr;
    fd_ = -1;
    throw Error(fmt::format("{}: {}", path, msg));
  };
  if (map_bytes_ < kShardHeaderBytes)
    fail(fmt::format("header: file is {} bytes, shorter than the {}-byte header (truncated?)", map_bytes_,
                     kShardHeaderBytes));
  void* m = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_SHARED, fd_, 0);
  if (m == MAP_FAILED) fail(fmt::format("mmap failed: {}", std::strerror(errno)));
  map_ = static_cast<const uint8_t*>(m);
  if (std::memcmp(map_, kShardMagic, 8) != 0) fail("magic: not a loom token shard");
  if (get<uint32_t>(map_ + 32) != crc32(map_, 32)) fail("header checksum: header is corrupt");
  uint32_t version = get<uint32_t>(map_ + 8);
  if (version != kShardVersion) fail(fmt::format("version: {} is not supported (expected {})", version, kShardVersion));
  width_ = get<uint32_t>(map_ + 12);
  if (width_ != 2 && width_ != 4) fail(fmt::format("token width: {} (expected 2 or 4)", width_));
  count_ = get<uint64_t>(map_ + 16);
  vocab_ = get<uint32_t>(map_ + 24);
  if (vocab_ == 0) fail("vocabulary size: 0");
  if (vocab_ > uint32_t(INT32_MAX))
    fail(fmt::format("vocabulary size: {} exceeds the largest token id a model takes ({})", vocab_, INT32_MAX));
  if (width_ == 2 && vocab_ > 65536u)
    fail(fmt::format("vocabulary size: {} does not fit 2-byte tokens (at most 65536)", vocab_));
  if (count_ > (map_bytes_ - kShardHeaderBytes) / width_ || kShardHeaderBytes + count_ * width_ != map_bytes_)
    fail(fmt::format("token count: header says {} tokens ({} bytes) but the file holds {} payload bytes (truncated?)",
                     count_, count_ * width_, map_bytes_ - kShardHeaderBytes));
  if (verify_payload) {
    uint32_t crc = crc32(map_ + kShardHeaderBytes, map_bytes_ - kShardHeaderBytes);
    if (crc != get<uint32_t>(map_ + 28)) fail("payload checksum: token data is corrupt");
    // The header's promise that every token is below the vocabulary size: a shard written with
    // another vocabulary (or by another tool) would otherwise index past the model's embedding.
    const uint8_t* p = map_ + kShardHeaderBytes;
    for (uint64_t i = 0; i < count_; ++i) {
      const uint32_t t = width_ == 2 ? get<uint16_t>(p + 2 * i) : get<uint32_t>(p + 4 * i);
      if (t >= vocab_) fail(fmt::format("token {}: id {} is not below the header's vocabulary size {}", i, t, vocab_));
    }
  }
  ::madvise(const_cast<uint8_t*>(map_), map_bytes_, MADV_RANDOM);
}

Shard::~Shard() {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), map_bytes_);
  if (fd_ >= 0) ::close(fd_);
}

uint32_t Shard::at(uint64_t i) const {
  LOOM_CHECK(i < count_, "{}: token index {} out of range ({} tokens)", path_, i, count_);
  const uint8_t* p = map_ + kShardHeaderBytes + i * width_;
  return width_ == 2 ? get<uint16_t>(p) : get<uint32_t>(p);
}

void Shard::read(uint64_t first, uint64_t n, int32_t* out) const {
  LOOM_CHECK(first + n <= count_, "{}: tokens [{}, {}) out of range ({} tokens)", path_, first, first + n, count_);
  const uint8_t* p = map_ + kShardHeaderBytes + first * width_;
  if (width_ == 2) {
    for (uint64_t i = 0; i < n; ++i) out[i] = int32_t(get<uint16_t>(p + 2 * i));
  } else {
    for (uint64_t i = 0; i < n; ++i) out[i] = int32_t(get<uint32_t>(p + 4 * i));
  }
}

namespace {

// Natural order: runs of digits compare as numbers (train_999 < train_1000, the order `loom
// prepare` wrote them in, whose names grow a digit past 999), the rest byte by byte.
bool natural_less(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const bool da = std::isdigit(static_cast<unsigned char>(a[i])), db = std::isdigit(static_cast<unsigned char>(b[j]));
    if (da && db) {
      size_t ie = i, je = j;
      while (ie < a.size() && std::isdigit(static_cast<unsigned char>(a[ie]))) ++ie;
      while (je < b.size() && std::isdigit(static_cast<unsigned char>(b[je]))) ++je;
      // Compare the numbers without leading zeros by length, then digit by digit.
      size_t ia = i, jb = j;
      while (ia + 1 < ie && a[ia] == '0') ++ia;
      while (jb + 1 < je && b[jb] == '0') ++jb;
      if (ie - ia != je - jb) return ie - ia < je - jb;
      if (const int c = a.compare(ia, ie - ia, b, jb, je - jb); c != 0) return c < 0;
      if (ie - i != je - j) return ie - i < je - j;  // (equal numbers: fewer leading zeros first)
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return static_cast<unsigned char>(a[i]) < static_cast<unsigned char>(b[j]);
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

}  // namespace

std::vector<std::string> list_shards(const std::string& dir, const std::string& split) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw Error(fmt::format("{}: {} (data.dir names the directory of the train_*.bin / val_*.bin shards)", dir,
                            fs::exists(dir, ec) ? "a file, not a directory" : "data directory does not exist"));
  std::vector<std::string> out;
  for (auto& e : fs::directory_iterator(dir)) {
    std::string name = e.path().filename().string();
    if (name.rfind(split + "_", 0) == 0 && e.path().extension() == ".bin") out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end(), natural_less);
  return out;
}

}  // namespace loom::data

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "core/error.h"
#include "data/loader.h"
#include "data/shard.h"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::data;

namespace {
struct TmpDir {
  fs::path p;
  TmpDir() {
    p = fs::temp_directory_path() / fmt::format("loom_shard_test_{}_{}", ::getpid(), std::rand());
    fs::create_directories(p);
  }
  ~TmpDir() { fs::remove_all(p); }
};

std::vector<uint32_t> random_tokens(size_t n, uint32_t vocab, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<uint32_t> t(n);
  for (auto& x : t) x = g() % vocab;
  return t;
}

std::string expect_error(const std::string& path) {
  try {
    Shard s(path);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error for " << path;
  return "";
}

void flip_bit(const std::string& path, size_t byte, int bit) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(std::streamoff(byte));
  char c;
  f.read(&c, 1);
  c = char(c ^ (1 << bit));
  f.seekp(std::streamoff(byte));
  f.write(&c, 1);
}
}  // namespace

TEST(Shard, RoundTripBothWidths) {
  TmpDir d;
  for (uint32_t vocab : {50257u, 100000u}) {
    auto toks = random_tokens(12345, vocab, vocab);
    std::string path = (d.p / "train_000.bin").string();
    write_shard(path, toks, vocab);
    Shard s(path);
    EXPECT_EQ(s.size(), toks.size());
    EXPECT_EQ(s.width(), vocab <= 65536 ? 2u : 4u);
    EXPECT_EQ(fs::file_size(path), kShardHeaderBytes + toks.size() * s.width());
    std::vector<int32_t> out(100);
    s.read(1000, 100, out.data());
    for (int i = 0; i < 100; ++i) EXPECT_EQ(uint32_t(out[size_t(i)]), toks[size_t(1000 + i)]);
    EXPECT_THROW(s.read(12300, 100, out.data()), Error);
  }
  EXPECT_FALSE(fs::exists(d.p / "train_000.bin.tmp"));
}

TEST(Shard, RejectsTokenOutsideVocabulary) {
  TmpDir d;
  std::vector<uint32_t> toks = {1, 2, 500};
  EXPECT_THROW(write_shard((d.p / "x.bin").string(), toks, 500), Error);
  EXPECT_FALSE(fs::exists(d.p / "x.bin"));
}

// A shard whose checksums hold but whose header promises a smaller vocabulary than its tokens use
// (another tool's shard, or a header edited with its checksum redone): refused when opened, naming
// the file, the token and the field, before a token could index past a model's embedding.
TEST(Shard, TokensAtOrAboveTheHeaderVocabularyAreRefused) {
  TmpDir d;
  const std::string path = (d.p / "train_000.bin").string();
  auto set_header_vocab = [&](uint32_t v) {
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    char h[32];
    f.read(h, 32);
    std::memcpy(h + 24, &v, 4);
    const uint32_t crc = crc32(h, 32);
    f.seekp(24);
    f.write(h + 24, 4);
    f.seekp(32);
    f.write(reinterpret_cast<const char*>(&crc), 4);
  };
  write_shard(path, std::vector<uint32_t>{1, 2, 3, 700, 5}, 1000);
  set_header_vocab(600);
  std::string msg = expect_error(path);
  EXPECT_NE(msg.find(path + ": token 3: id 700 is not below the header's vocabulary size 600"), std::string::npos)
      << msg;
  set_header_vocab(70000);  // more ids than 2-byte tokens can hold
  msg = expect_error(path);
  EXPECT_NE(msg.find("does not fit 2-byte tokens"), std::string::npos) << msg;
  set_header_vocab(1000);
  EXPECT_NO_THROW(Shard s(path));
}

TEST(Shard, TruncatedFileNamesFileAndField) {
  TmpDir d;
  std::string path = (d.p / "train_000.bin").string();
  write_shard(path, random_tokens(1000, 300, 1), 300);
  fs::resize_file(path, fs::file_size(path) - 3);
  std::string msg = expect_error(path);
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("token count"), std::string::npos) << msg;
  fs::resize_file(path, 10);
  msg = expect_error(path);
  EXPECT_NE(msg.find("header"), std::string::npos) << msg;
}

TEST(Shard, EveryFlippedBitIsCaught) {
  TmpDir d;
  std::string path = (d.p / "train_000.bin").string();
  auto toks = random_tokens(200, 1000, 2);
  write_shard(path, toks, 1000);
  size_t bytes = fs::file_size(path);
  std::mt19937 g(7);
  // Header bytes 0..35 all, then random payload bits.
  std::vector<size_t> positions;
  for (size_t b = 0; b < 36; ++b) positions.push_back(b);
  for (int i = 0; i < 40; ++i) positions.push_back(kShardHeaderBytes + g() % (bytes - kShardHeaderBytes));
  for (size_t b : positions) {
    int bit = int(g() % 8);
    flip_bit(path, b, bit);
    std::string msg = expect_error(path);
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    flip_bit(path, b, bit);
  }
  EXPECT_NO_THROW(Shard s(path));
}

TEST(Shard, NotAShard) {
  TmpDir d;
  std::string path = (d.p / "junk.bin").string();
  std::ofstream(path) << std::string(100, 'x');
  EXPECT_NE(expect_error(path).find("magic"), std::string::npos);
  EXPECT_NE(expect_error((d.p / "missing.bin").string()).find("cannot open"), std::string::npos);
  // A FIFO or a folder under a shard's name is refused at once (opening a FIFO waited forever).
  const std::string fifo = (d.p / "train_000.bin").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_NE(expect_error(fifo).find(fifo + ": is not a regular file"), std::string::npos);
  fs::create_directory(d.p / "val_000.bin");
  EXPECT_NE(expect_error((d.p / "val_000.bin").string()).find("is not a regular file"), std::string::npos);
}

TEST(Loader, BatchesDependOnlyOnGlobalSampleIndex) {
  TmpDir d;
  auto a = random_tokens(5000, 700, 3), b = random_tokens(3001, 700, 4);
  write_shard((d.p / "train_000.bin").string(), a, 700);
  write_shard((d.p / "train_001.bin").string(), b, 700);
  std::vector<uint32_t> all = a;
  all.insert(all.end(), b.begin(), b.end());
  const int64_t T = 64, GB = 8;
  Loader L(d.p.string(), "train", T, 1234);
  EXPECT_EQ(L.total_tokens(), all.size());
  std::vector<int32_t> x(GB * T), y(GB * T);
  for (int64_t step : {0, 1, 57}) {
    L.train_batch(step, GB, 0, GB, x.data(), y.data());
    // The same samples read as dp=2 and dp=4 slices are identical.
    for (int64_t dp : {2, 4}) {
      int64_t per = GB / dp;
      for (int64_t r = 0; r < dp; ++r) {
        std::vector<int32_t> xs(per * T), ys(per * T);
        L.train_batch(step, GB, r * per, per, xs.data(), ys.data());
        for (int64_t i = 0; i < per * T; ++i) {
          ASSERT_EQ(xs[size_t(i)], x[size_t(r * per * T + i)]);
          ASSERT_EQ(ys[size_t(i)], y[size_t(r * per * T + i)]);
        }
      }
    }
    for (int64_t s = 0; s < GB; ++s) {
      uint64_t start = L.sample_start(uint64_t(step * GB + s));
      for (int64_t t = 0; t < T; ++t) {
        ASSERT_EQ(uint32_t(x[size_t(s * T + t)]), all[start + uint64_t(t)]);
        ASSERT_EQ(uint32_t(y[size_t(s * T + t)]), all[start + uint64_t(t) + 1]);
      }
    }
  }
  // Another seed gives other windows.
  Loader L2(d.p.string(), "train", T, 99);
  int same = 0;
  for (uint64_t g = 0; g < 50; ++g) same += L.sample_start(g) == L2.sample_start(g);
  EXPECT_LT(same, 5);
}

// A run resumed at step 10 after 80 samples (8 per step) with 4 per step draws samples 80, 81, ...:
// neither the ones it drew (step 10 at 4 from the start would be 40-43) nor a gap.
TEST(Loader, AResumeWithAnotherBatchDrawsTheSamplesAfterTheRunsOwn) {
  TmpDir d;
  write_shard((d.p / "train_000.bin").string(), random_tokens(5000, 700, 3), 700);
  const int64_t T = 16;
  Loader fresh(d.p.string(), "train", T, 7), resumed(d.p.string(), "train", T, 7);
  EXPECT_EQ(resumed.consumed(10, 8), 80);
  resumed.resume_at(10, 4, 80);
  EXPECT_EQ(resumed.consumed(10, 4), 80);
  EXPECT_EQ(resumed.consumed(12, 4), 88);
  std::vector<int32_t> a(4 * T), b(4 * T), ya(4 * T), yb(4 * T);
  for (int64_t step : {10, 11, 12}) {
    resumed.train_batch(step, 4, 0, 4, a.data(), ya.data());
    fresh.train_batch(step - 10 + 20, 4, 0, 4, b.data(), yb.data());  // samples 80 + 4 (step - 10) on
    EXPECT_EQ(a, b) << "step " << step;
    EXPECT_EQ(ya, yb) << "step " << step;
  }
  // A larger batch after fewer samples: step 10 of 16 starts at sample 80 too.
  resumed.resume_at(10, 16, 80);
  std::vector<int32_t> c(16 * T), yc(16 * T), e(8 * T), ye(8 * T);
  resumed.train_batch(10, 16, 0, 16, c.data(), yc.data());
  fresh.train_batch(10, 8, 0, 8, e.data(), ye.data());  // samples 80-87
  EXPECT_TRUE(std::equal(e.begin(), e.end(), c.begin()));
  EXPECT_THROW(resumed.train_batch(4, 16, 0, 16, c.data(), yc.data()), Error);  // before sample 0
}

TEST(Loader, ValidationWindowsAreConsecutive) {
  TmpDir d;
  auto a = random_tokens(1000, 50, 5);
  write_shard((d.p / "val_000.bin").string(), a, 50);
  Loader L(d.p.string(), "val", 10, 0);
  EXPECT_EQ(L.val_batches(4), 24);  // 99 windows of 10 -> 24 batches of 4
  std::vector<int32_t> x(40), y(40);
  L.val_batch(3, 4, 0, 4, x.data(), y.data());
  for (int i = 0; i < 40; ++i) {
    EXPECT_EQ(uint32_t(x[size_t(i)]), a[size_t(120 + i)]);
    EXPECT_EQ(uint32_t(y[size_t(i)]), a[size_t(121 + i)]);
  }
  EXPECT_THROW(L.val_batch(24, 4, 0, 4, x.data(), y.data()), Error);
  EXPECT_THROW(Loader(d.p.string(), "train", 10, 0), Error);
}

// Past 999 shards `loom prepare` names them train_1000.bin, ...: they are read in the order they
// were written (natural order), not byte order (which put train_1000 between train_100 and
// train_101, and windows across that seam joined unrelated text).
TEST(Loader, ShardsPastNineHundredNinetyNineAreReadInTheOrderWritten) {
  TmpDir d;
  const int shards = 1003;
  for (int i = 0; i < shards; ++i)
    write_shard((d.p / fmt::format("val_{:03d}.bin", i)).string(), std::vector<uint32_t>(4, uint32_t(i % 1000)), 1000);
  const std::vector<std::string> names = list_shards(d.p.string(), "val");
  ASSERT_EQ(names.size(), size_t(shards));
  for (int i = 0; i < shards; ++i)
    EXPECT_EQ(fs::path(names[size_t(i)]).filename().string(), fmt::format("val_{:03d}.bin", i));
  // Consecutive validation windows of 3 tokens run through the shards in that order.
  Loader L(d.p.string(), "val", 3, 0);
  std::vector<int32_t> x(3), y(3);
  for (int64_t w : {int64_t(0), int64_t(133), int64_t(134), int64_t(1336)}) {
    L.val_batch(w, 1, 0, 1, x.data(), y.data());
    for (int k = 0; k < 3; ++k) EXPECT_EQ(x[size_t(k)], int32_t(((3 * w + k) / 4) % 1000)) << "window " << w;
  }
}

// The ranks of a job share the verification of the shards' payloads (each reads its part, so a
// job reads its corpus once): a damaged shard is found by the rank whose part holds it, and its
// header and size by every rank.
TEST(Loader, RanksShareTheVerificationOfThePayloads) {
  TmpDir d;
  for (int i = 0; i < 4; ++i) write_shard((d.p / fmt::format("train_{:03d}.bin", i)).string(), random_tokens(500, 50, uint32_t(i)), 50);
  flip_bit((d.p / "train_002.bin").string(), kShardHeaderBytes + 10, 3);
  for (int part = 0; part < 3; ++part) {
    SCOPED_TRACE(part);
    const VerifyShare share{part, 3};  // part 2 verifies shards 2 (and 5, ...)
    if (part != 2) {
      EXPECT_NO_THROW(Loader(d.p.string(), "train", 10, 0, share));
      continue;
    }
    try {
      Loader(d.p.string(), "train", 10, 0, share);
      ADD_FAILURE() << "the damaged shard was not found";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("train_002.bin"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("payload checksum"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(Loader(d.p.string(), "train", 10, 0), Error);  // one opening alone verifies every shard
  // A truncated shard is found by every part.
  fs::resize_file(d.p / "train_001.bin", fs::file_size(d.p / "train_001.bin") - 2);
  for (int part = 0; part < 3; ++part) EXPECT_THROW(Loader(d.p.string(), "train", 10, 0, VerifyShare{part, 3}), Error);
}

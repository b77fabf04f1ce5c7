// Drives the fuzz harnesses (harness.h) without libFuzzer: every seed of tests/fuzz/corpus and
// seeded random mutations of them (bit flips, byte overwrites with boundary values, insertions,
// deletions, truncations, splices of two seeds). A harness aborts on a crash or a broken invariant,
// so this test fails loudly; it also checks that the seeds themselves are accepted, so the
// mutations start from inputs that reach deep into each reader.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>

#include "data/shard.h"
#include "data/tokenizer.h"
#include "fuzz/harness.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/hf_config.h"
#include "train/safetensors.h"

namespace fs = std::filesystem;

namespace {

using Bytes = std::string;
using Harness = std::function<int(const uint8_t*, size_t)>;

std::vector<Bytes> seeds(const std::string& name) {
  std::vector<Bytes> out;
  const fs::path dir = fs::path(LOOM_SOURCE_DIR) / "tests/fuzz/corpus" / name;
  if (!fs::is_directory(dir)) return out;
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    out.push_back(ss.str());
  }
  return out;
}

Bytes mutate(const std::vector<Bytes>& pool, std::mt19937_64& g) {
  Bytes b = pool[g() % pool.size()];
  static const uint8_t kInteresting[] = {0x00, 0x01, 0x7f, 0x80, 0xff, '"', ',', ':', '[', ']', '{', '}', '-', '9', '\n', ' '};
  const int n = 1 + int(g() % 4);
  for (int k = 0; k < n; ++k) {
    const size_t at = b.empty() ? 0 : g() % b.size();
    switch (g() % 7) {
      case 0:
        if (!b.empty()) b[at] = char(uint8_t(b[at]) ^ uint8_t(1u << (g() % 8)));
        break;
      case 1:
        if (!b.empty()) b[at] = char(kInteresting[g() % sizeof(kInteresting)]);
        break;
      case 2:
        b.insert(b.begin() + std::ptrdiff_t(at), char(g()));
        break;
      case 3:
        if (!b.empty()) b.erase(at, 1 + g() % std::min<size_t>(8, b.size() - at));
        break;
      case 4:
        b.resize(at);
        break;
      case 5: {  // splice: a head of this input and a tail of another
        const Bytes& o = pool[g() % pool.size()];
        const size_t from = o.empty() ? 0 : g() % o.size();
        b = b.substr(0, at) + o.substr(from);
        break;
      }
      case 6:  // a digit run changed: numbers in JSON headers and vocabularies
        if (!b.empty()) {
          for (size_t i = at; i < b.size() && i < at + 4; ++i)
            if (b[i] >= '0' && b[i] <= '9') b[i] = char('0' + g() % 10);
        }
        break;
    }
  }
  return b;
}

void drive(const std::string& name, const Harness& h, int mutations) {
  const std::vector<Bytes> pool = seeds(name);
  ASSERT_FALSE(pool.empty()) << "no seed corpus tests/fuzz/corpus/" << name;
  for (const Bytes& s : pool) EXPECT_EQ(h(reinterpret_cast<const uint8_t*>(s.data()), s.size()), 0);
  std::mt19937_64 g(0x10011 + name.size());
  for (int i = 0; i < mutations; ++i) {
    const Bytes b = mutate(pool, g);
    ASSERT_EQ(h(reinterpret_cast<const uint8_t*>(b.data()), b.size()), 0);
  }
  // Degenerate inputs.
  EXPECT_EQ(h(nullptr, 0), 0);
  const Bytes zeros(4096, '\0'), ones(100, '\xff');
  EXPECT_EQ(h(reinterpret_cast<const uint8_t*>(zeros.data()), zeros.size()), 0);
  EXPECT_EQ(h(reinterpret_cast<const uint8_t*>(ones.data()), ones.size()), 0);
}

fs::path write_tmp(const std::string& name, const Bytes& b) {
  const fs::path p = fs::temp_directory_path() / ("loom_fuzz_test_" + std::to_string(::getpid()) + "_" + name);
  std::ofstream(p, std::ios::binary) << b;
  return p;
}

}  // namespace

TEST(FuzzHarness, SeedsAreAccepted) {
  for (const Bytes& s : seeds("safetensors")) {
    const fs::path p = write_tmp("st", s);
    EXPECT_NO_THROW(loom::train::SafetensorsReader r(p.string()));
    fs::remove(p);
  }
  for (const Bytes& s : seeds("shard")) {
    const fs::path p = write_tmp("shard", s.substr(1));  // the first byte is the harness's mode
    EXPECT_NO_THROW(loom::data::Shard sh(p.string()));
    fs::remove(p);
  }
  for (const Bytes& s : seeds("manifest")) {  // mode byte, then manifest.json of ckpt_00000003
    const fs::path dir = fs::temp_directory_path() / ("loom_fuzz_test_" + std::to_string(::getpid())) / "ckpt_00000003";
    fs::create_directories(dir);
    const Bytes text = s.substr(1);
    std::ofstream(dir / "manifest.json", std::ios::binary) << text;
    if (s[0] & 1) std::ofstream(dir / "manifest.crc32") << loom::data::crc32(text.data(), text.size()) << "\n";
    EXPECT_NO_THROW(loom::train::read_checkpoint_meta(dir.string()));
    fs::remove_all(dir.parent_path());
  }
  for (const Bytes& s : seeds("hf_config")) {
    const fs::path p = write_tmp("hf_config.json", s);
    EXPECT_NO_THROW(loom::model::read_hf_config(p.string()));
    fs::remove(p);
  }
  for (const Bytes& s : seeds("config")) {
    const fs::path p = write_tmp("config.toml", s);
    EXPECT_NO_THROW(loom::train::load_config(p.string(), {}));
    fs::remove(p);
  }
  for (const Bytes& s : seeds("tokenizer_json")) {
    const fs::path p = write_tmp("tokenizer.json", s);
    EXPECT_NO_THROW(loom::data::Tokenizer::from_tokenizer_json(p.string()));
    fs::remove(p);
  }
  for (const Bytes& s : seeds("vocab")) {
    const size_t cut = s.find('\0');
    ASSERT_NE(cut, Bytes::npos);
    const fs::path v = write_tmp("vocab.json", s.substr(0, cut)), m = write_tmp("merges.txt", s.substr(cut + 1));
    EXPECT_NO_THROW(loom::data::Tokenizer::from_files(v.string(), m.string()));
    fs::remove(v);
    fs::remove(m);
  }
}

TEST(FuzzHarness, SafetensorsMutations) { drive("safetensors", loom::fuzz::safetensors, 1000); }
TEST(FuzzHarness, ShardMutations) { drive("shard", loom::fuzz::shard, 1000); }
TEST(FuzzHarness, VocabMutations) { drive("vocab", loom::fuzz::vocab, 500); }
TEST(FuzzHarness, ManifestMutations) { drive("manifest", loom::fuzz::manifest, 1000); }
TEST(FuzzHarness, ConfigMutations) { drive("config", loom::fuzz::config, 500); }
TEST(FuzzHarness, HfConfigMutations) { drive("hf_config", loom::fuzz::hf_config, 1000); }
TEST(FuzzHarness, TokenizerJsonMutations) { drive("tokenizer_json", loom::fuzz::tokenizer_json, 300); }

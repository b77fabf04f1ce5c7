// GPT-2 encodings against an npm peer (gpt-tokenizer, and js-tiktoken on the smaller text) on
// megabytes of text: the King James Bible and the licence texts of the system when present, and
// a generated multilingual text drawing letters, digits and spaces from the whole Unicode table.
// Skips with a message where node, the npm packages (bench/tokenizer_vs_npm.sh installs them) or
// the GPT-2 files are absent.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>

#include "data/tokenizer.h"
#include "data/unicode.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;

const fs::path kSource = LOOM_SOURCE_DIR;
const fs::path kGpt2Dir = kSource / ".." / "shared" / "data" / "gpt2";
const fs::path kWork = fs::path(LOOM_BINARY_DIR) / "tokenizer_long_test";

fs::path npm_dir() {
  if (const char* d = std::getenv("LOOM_NPM_DIR")) return d;
  return fs::path(LOOM_BINARY_DIR) / "npm-peer";
}

bool have_node() { return std::system("node --version > /dev/null 2>&1") == 0; }

std::string slurp(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return std::move(ss).str();
}

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::istringstream in(s);
  int32_t v;
  while (in >> v) ids.push_back(v);
  return ids;
}

// Runs the npm peer on `file`; returns false (with a message) when node fails.
bool peer_encode(const std::string& library, const fs::path& file, std::vector<int32_t>* ids) {
  const fs::path out = kWork / (file.stem().string() + "." + library + ".ids");
  const std::string cmd = "node '" + (kSource / "bench" / "tokenizer_peer.js").string() + "' '" +
                          npm_dir().string() + "' " + library + " '" + file.string() + "' '" +
                          out.string() + "'";
  if (std::system(cmd.c_str()) != 0) return false;
  *ids = parse_ids(slurp(out));
  return true;
}

void expect_same(const Tokenizer& t, const std::string& text, const std::vector<int32_t>& ours,
                 const std::vector<int32_t>& peer, const std::string& what) {
  size_t i = 0;
  while (i < ours.size() && i < peer.size() && ours[i] == peer[i]) ++i;
  if (i == ours.size() && i == peer.size()) return;
  std::vector<int32_t> a(ours.begin() + i, ours.begin() + std::min(ours.size(), i + 8));
  std::vector<int32_t> b(peer.begin() + i, peer.begin() + std::min(peer.size(), i + 8));
  ADD_FAILURE() << what << ": first difference at token " << i << " of " << ours.size() << " (peer "
                << peer.size() << "): loom \"" << t.decode(a) << "\" vs peer \"" << t.decode(b)
                << "\"";
}

// A deterministic text of words from every letter and number range of the table, punctuation,
// symbols, contractions and many kinds of white space (not U+0085 or U+FEFF, where JavaScript's
// \s and White_Space disagree).
std::string multilingual_text(size_t bytes) {
  std::vector<uint32_t> letters, numbers;
  for (uint32_t cp = 0x20; cp < 0x110000; ++cp) {
    const CharClass c = char_class(cp);
    if (c == CharClass::kLetter) letters.push_back(cp);
    if (c == CharClass::kNumber) numbers.push_back(cp);
  }
  const std::vector<uint32_t> other = {'!', '"', '#', '$', '%', '&', '(', ')', '*', '+', ',', '-',
                                       '.', '/', ':', ';', '<', '=', '>', '?', '@', '[', '\\',
                                       ']', '^', '_', '`', '{', '|', '}', '~', 0x2014, 0x00A9,
                                       0x1F600, 0x20AC, 0x0301, 0x200B};
  const std::vector<uint32_t> spaces = {' ', ' ', ' ', '\n', '\t', 0x3000, 0x00A0, 0x2003, '\r'};
  const char* words[] = {"'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'", "the", " of",
                         "Hello", " 42"};
  std::mt19937_64 rng(42);
  auto pick = [&](const std::vector<uint32_t>& v) { return v[rng() % v.size()]; };
  std::string s;
  while (s.size() < bytes) {
    const int k = int(rng() % 100);
    const int n = 1 + int(rng() % 6);
    if (k < 45) {
      for (int i = 0; i < n; ++i) append_utf8(pick(letters), s);
    } else if (k < 55) {
      for (int i = 0; i < n; ++i) append_utf8(pick(numbers), s);
    } else if (k < 65) {
      for (int i = 0; i < n % 3 + 1; ++i) append_utf8(pick(other), s);
    } else if (k < 85) {
      s += words[rng() % (sizeof(words) / sizeof(words[0]))];
    } else {
      for (int i = 0; i < n % 4 + 1; ++i) append_utf8(pick(spaces), s);
    }
    if (rng() % 10 < 7) s.push_back(' ');
  }
  return s;
}

class NpmPeer : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kGpt2Dir / "encoder.json") || !fs::exists(kGpt2Dir / "vocab.bpe")) {
      GTEST_SKIP() << "GPT-2 vocabulary not found at " << kGpt2Dir.string() << "; skipping";
    }
    if (!have_node()) GTEST_SKIP() << "node is not installed; skipping the npm comparison";
    if (!fs::exists(npm_dir() / "node_modules" / "gpt-tokenizer") ||
        !fs::exists(npm_dir() / "node_modules" / "js-tiktoken")) {
      GTEST_SKIP() << "npm peer not installed in " << npm_dir().string()
                   << " (run bench/tokenizer_vs_npm.sh BUILD_DIR once, or set LOOM_NPM_DIR)";
    }
    fs::create_directories(kWork);
  }
  static const Tokenizer& gpt2() {
    static const Tokenizer t = Tokenizer::from_dir(kGpt2Dir.string());
    return t;
  }
  void compare(const fs::path& file, const std::vector<std::string>& libraries) {
    const std::string text = slurp(file);
    EncodeOptions two;
    two.threads = 2;
    const auto ours = gpt2().encode(text);
    EXPECT_EQ(gpt2().encode(text, two), ours) << "2 threads";
    EXPECT_EQ(gpt2().decode(ours), text);
    for (const std::string& lib : libraries) {
      std::vector<int32_t> peer;
      ASSERT_TRUE(peer_encode(lib, file, &peer)) << lib << " failed";
      expect_same(gpt2(), text, ours, peer, lib + " on " + file.filename().string());
    }
    std::printf("  %s: %zu bytes, %zu tokens, equal to %zu npm peer(s)\n",
                file.filename().string().c_str(), text.size(), ours.size(), libraries.size());
  }
};

TEST_F(NpmPeer, EnglishCorpus) {
  std::string text;
  if (std::system("command -v bible > /dev/null 2>&1") == 0) {
    const fs::path kjv = kWork / "kjv.txt";
    if (!fs::exists(kjv)) {
      ASSERT_EQ(std::system(("bible gen1:1-rev22:21 > '" + kjv.string() + "'").c_str()), 0);
    }
    text = slurp(kjv);
  }
  const fs::path licenses = "/usr/share/common-licenses";
  if (fs::exists(licenses)) {
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(licenses)) {
      if (e.is_regular_file()) files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    for (const auto& f : files) text += slurp(f);
  }
  if (text.size() < (size_t(1) << 20)) {
    GTEST_SKIP() << "no English corpus (the bible program of bible-kjv, or the system's "
                    "common-licenses); skipping";
  }
  const fs::path file = kWork / "english.txt";
  std::ofstream(file, std::ios::binary) << text;
  compare(file, {"gpt-tokenizer"});
}

TEST_F(NpmPeer, MultilingualText) {
  const fs::path file = kWork / "multilingual.txt";
  std::ofstream(file, std::ios::binary) << multilingual_text(size_t(2) << 20);
  compare(file, {"gpt-tokenizer", "js-tiktoken"});
}

// Llama 3's tokenizer (its 128K vocabulary and pattern from llama3-tokenizer-js, written out as
// a tokenizer.json that @huggingface/tokenizers reads too) on tests/data/multilingual.txt and a
// few MB of text: loom's ids (one thread and two) equal both peers' and decode back to the text
// (bench/llama3_tokenizer_vs_npm.sh, which prints each one's MB/s).
TEST(NpmPeerLlama3, MatchesBothPeers) {
  if (!have_node()) GTEST_SKIP() << "node is not installed; skipping the npm comparison";
  if (!fs::exists(npm_dir() / "node_modules" / "llama3-tokenizer-js") ||
      !fs::exists(npm_dir() / "node_modules" / "@huggingface" / "tokenizers"))
    GTEST_SKIP() << "npm peers not installed in " << npm_dir().string()
                 << " (run bench/llama3_tokenizer_vs_npm.sh BUILD_DIR once, or set LOOM_NPM_DIR)";
  const std::string cmd = "LOOM_NPM_DIR='" + npm_dir().string() + "' '" + (kSource / "bench/llama3_tokenizer_vs_npm.sh").string() +
                          "' '" + std::string(LOOM_BINARY_DIR) + "'";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
}

}  // namespace
}  // namespace loom::data

// Byte-level BPE tokenizer: GPT-2 reference ids, the pre-tokeniser against a regex reading of
// GPT-2's pattern, round trips of arbitrary bytes, both merge algorithms, training, bad files.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/bpe_pretokenize.h"
#include "data/bpe_train.h"
#include "data/tokenizer.h"
#include "data/unicode.h"

namespace loom::data {
namespace {

namespace fs = std::filesystem;

const std::string kGpt2Dir = std::string(LOOM_SOURCE_DIR) + "/../shared/data/gpt2";

bool have_gpt2() {
  return fs::exists(kGpt2Dir + "/encoder.json") && fs::exists(kGpt2Dir + "/vocab.bpe");
}

const Tokenizer& gpt2() {
  static const Tokenizer t = Tokenizer::from_dir(kGpt2Dir);
  return t;
}

#define REQUIRE_GPT2()                                                                    \
  if (!have_gpt2()) GTEST_SKIP() << "GPT-2 vocabulary not found at " << kGpt2Dir          \
                                 << " (encoder.json + vocab.bpe); skipping"

std::vector<std::string> pieces(std::string_view text) {
  std::vector<std::string> out;
  PreTokenizer p(text);
  std::string_view s;
  while (p.next(&s)) out.emplace_back(s);
  return out;
}

std::string random_bytes(std::mt19937& rng, size_t n) {
  // A mix of ASCII text, white space, multi-byte UTF-8 and raw (often invalid) bytes.
  static const char* kBits[] = {"a", "Z", "7", " ", "  ", "\n", "\t", "'", "'s", "'ll", ".", "!",
                                "é", "ß", "中", "文", "😀", "١", "Ⅷ", "\xC2\xA0", "\xE3\x80\x80",
                                "\xC2\x85", "<|endoftext|>", "\xEF\xBB\xBF", "ab", "the", " the"};
  std::string s;
  std::uniform_int_distribution<int> pick(0, 99);
  while (s.size() < n) {
    const int k = pick(rng);
    if (k < 70) {
      s += kBits[size_t(k) % (sizeof(kBits) / sizeof(kBits[0]))];
    } else {
      s.push_back(char(rng() & 0xFF));
    }
  }
  return s;
}

// ---- Unicode ----

TEST(Unicode, Classes) {
  EXPECT_EQ(char_class('a'), CharClass::kLetter);
  EXPECT_EQ(char_class('0'), CharClass::kNumber);
  EXPECT_EQ(char_class(' '), CharClass::kSpace);
  EXPECT_EQ(char_class('\''), CharClass::kOther);
  EXPECT_EQ(char_class(0x00E9), CharClass::kLetter);   // é
  EXPECT_EQ(char_class(0x4E2D), CharClass::kLetter);   // 中 (CJK range entry)
  EXPECT_EQ(char_class(0xAC00), CharClass::kLetter);   // first Hangul syllable (range entry)
  EXPECT_EQ(char_class(0x0661), CharClass::kNumber);   // Arabic-Indic one (Nd)
  EXPECT_EQ(char_class(0x2167), CharClass::kNumber);   // Roman numeral eight (Nl)
  EXPECT_EQ(char_class(0x00BD), CharClass::kNumber);   // ½ (No)
  EXPECT_EQ(char_class(0x00A0), CharClass::kSpace);    // no-break space
  EXPECT_EQ(char_class(0x0085), CharClass::kSpace);    // next line
  EXPECT_EQ(char_class(0x3000), CharClass::kSpace);    // ideographic space
  EXPECT_EQ(char_class(0xFEFF), CharClass::kOther);    // BOM is Cf, not White_Space
  EXPECT_EQ(char_class(0x1F600), CharClass::kOther);   // emoji (So)
  EXPECT_EQ(char_class(0x200B), CharClass::kOther);    // zero width space is not White_Space
  EXPECT_EQ(char_class(0x10FFFF), CharClass::kOther);
  EXPECT_EQ(char_class(kInvalidByteBase + 0xFF), CharClass::kOther);
}

TEST(Unicode, DecodeIsStrict) {
  auto first = [](std::string_view s, uint32_t* cp) {
    const auto* p = reinterpret_cast<const uint8_t*>(s.data());
    return decode_utf8(p, p + s.size(), cp);
  };
  uint32_t cp;
  EXPECT_EQ(first("\xE4\xB8\xAD", &cp), 3u);
  EXPECT_EQ(cp, 0x4E2Du);
  EXPECT_EQ(first("\xF0\x9F\x98\x80", &cp), 4u);
  EXPECT_EQ(cp, 0x1F600u);
  for (std::string_view bad : {"\xC0\x80", "\xE0\x80\x80", "\xED\xA0\x80", "\xF4\x90\x80\x80",
                               "\xE4\xB8", "\x80", "\xFF", "\xF0\x9F\x98"}) {
    EXPECT_EQ(first(bad, &cp), 1u) << bad.size();
    EXPECT_EQ(cp, kInvalidByteBase + uint8_t(bad[0]));
  }
  EXPECT_TRUE(is_valid_utf8("héllo 中文 😀"));
  EXPECT_FALSE(is_valid_utf8("h\xC3"));
}

// ---- pre-tokeniser ----

TEST(PreTokenizer, Gpt2Pattern) {
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(pieces("I'm here, they'll see it's 42!"),
            (V{"I", "'m", " here", ",", " they", "'ll", " see", " it", "'s", " 42", "!"}));
  EXPECT_EQ(pieces("   leading and trailing   "),
            (V{"  ", " leading", " and", " trailing", "   "}));
  // A white-space run before a word gives up its last code point, which is not ' ' here, so
  // GPT-2 encodes a paragraph break as two "\n" tokens.
  EXPECT_EQ(pieces("a\n\nb"), (V{"a", "\n", "\n", "b"}));
  EXPECT_EQ(pieces("a\n\n"), (V{"a", "\n\n"}));
  EXPECT_EQ(pieces("a  \n  b"), (V{"a", "  \n ", " b"}));
  EXPECT_EQ(pieces("x \ty"), (V{"x", " ", "\t", "y"}));
  EXPECT_EQ(pieces("''s 'S 'x"), (V{"''", "s", " '", "S", " '", "x"}));
  EXPECT_EQ(pieces("abc123def"), (V{"abc", "123", "def"}));
  EXPECT_EQ(pieces(" ... ?!"), (V{" ...", " ?!"}));
  EXPECT_EQ(pieces("héllo wörld 中文"), (V{"héllo", " wörld", " 中文"}));
  EXPECT_EQ(pieces("٣٤ ½"), (V{"٣٤", " ½"}));
  EXPECT_EQ(pieces("a\xC2\xA0" "b"), (V{"a", "\xC2\xA0", "b"}));  // U+00A0 is not ' '
  EXPECT_EQ(pieces("a\xFF\xFE!b"), (V{"a", "\xFF\xFE!", "b"}));    // invalid bytes are "other"
  EXPECT_EQ(pieces(" "), (V{" "}));
  EXPECT_EQ(pieces("a "), (V{"a", " "}));
  EXPECT_EQ(pieces("'"), (V{"'"}));
  EXPECT_EQ(pieces("'re've"), (V{"'re", "'ve"}));
  EXPECT_TRUE(pieces("").empty());
}

// A direct, slow reading of the regex (alternatives tried in order at each position, with the
// backtracking of \s+(?!\S) spelled out) to check the state machine on random text.
std::vector<std::string> pieces_reference(std::string_view text) {
  std::vector<uint32_t> cps;
  std::vector<size_t> at;  // byte offset of each code point
  const auto* b = reinterpret_cast<const uint8_t*>(text.data());
  for (size_t i = 0; i < text.size();) {
    uint32_t cp;
    at.push_back(i);
    i += decode_utf8(b + i, b + text.size(), &cp);
    cps.push_back(cp);
  }
  at.push_back(text.size());
  const size_t n = cps.size();
  auto cls = [&](size_t i) { return char_class(cps[i]); };
  auto run = [&](size_t i, CharClass c) {
    while (i < n && cls(i) == c) ++i;
    return i;
  };
  std::vector<std::string> out;
  for (size_t i = 0; i < n;) {
    size_t e = i;
    if (cps[i] == '\'') {
      for (std::u32string_view c : {U"s", U"t", U"re", U"ve", U"m", U"ll", U"d"}) {
        if (i + c.size() < n + 1 && std::equal(c.begin(), c.end(), cps.begin() + i + 1,
                                                 cps.begin() + std::min(n, i + 1 + c.size()))) {
          e = i + 1 + c.size();
          break;
        }
      }
    }
    for (CharClass c : {CharClass::kLetter, CharClass::kNumber, CharClass::kOther}) {
      if (e != i) break;
      const size_t s = (cps[i] == ' ' && i + 1 < n) ? i + 1 : i;
      if (cls(s) == c) e = run(s + 1, c);
    }
    if (e == i) {
      // \s+(?!\S): the longest run of spaces not followed by a non-space; else \s+.
      const size_t r = run(i, CharClass::kSpace);
      for (size_t k = r; k > i && e == i; --k) {
        if (k == n || cls(k) == CharClass::kSpace) e = k;
      }
      if (e == i) e = r;
    }
    out.emplace_back(text.substr(at[i], at[e] - at[i]));
    i = e;
  }
  return out;
}

TEST(PreTokenizer, MatchesRegexReadingOnRandomText) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 2000; ++trial) {
    const std::string s = random_bytes(rng, size_t(rng() % 60));
    ASSERT_EQ(pieces(s), pieces_reference(s)) << "trial " << trial;
  }
}

// ---- GPT-2 vocabulary ----

TEST(Gpt2, ReferenceIds) {
  REQUIRE_GPT2();
  const Tokenizer& t = gpt2();
  EXPECT_EQ(t.vocab_size(), 50257);
  EXPECT_EQ(t.num_merges(), 50000u);
  EXPECT_EQ(t.special_ids(), std::vector<int32_t>{50256});
  using V = std::vector<int32_t>;
  EXPECT_EQ(t.encode("Hello world"), (V{15496, 995}));
  EXPECT_EQ(t.encode(" The quick brown fox"), (V{383, 2068, 7586, 21831}));
  EXPECT_EQ(t.encode("   leading and trailing   "), (V{220, 220, 3756, 290, 25462, 220, 220, 220}));
  // Merge i of vocab.bpe makes token 256 + i.
  for (size_t rank : {0u, 1u, 1000u, 49999u}) {
    const auto [l, r] = t.merge(rank);
    EXPECT_EQ(t.find(std::string(t.token(l)) + std::string(t.token(r))), int32_t(256 + rank));
  }
}

TEST(Gpt2, HuggingFaceFileNames) {
  REQUIRE_GPT2();
  // Hugging Face ships the same vocabulary as vocab.json + merges.txt (its merges.txt header
  // line differs).
  const fs::path dir = fs::path(LOOM_BINARY_DIR) / "tokenizer_test_hf";
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy_file(kGpt2Dir + "/encoder.json", dir / "vocab.json");
  std::ifstream in(kGpt2Dir + "/vocab.bpe", std::ios::binary);
  std::string merges(std::istreambuf_iterator<char>(in), {});
  merges = "#version: 0.2 - Trained by huggingface/tokenizers\n" + merges.substr(merges.find('\n') + 1);
  std::ofstream(dir / "merges.txt", std::ios::binary) << merges;
  const Tokenizer hf = Tokenizer::from_dir(dir.string());
  EXPECT_EQ(hf.vocab_size(), 50257);
  EXPECT_EQ(hf.num_merges(), 50000u);
  const std::string text = "Hugging Face's tokenizers: the same 50,257 tokens.\n";
  EXPECT_EQ(hf.encode(text), gpt2().encode(text));
  fs::remove_all(dir);
}

TEST(Gpt2, SpecialTokens) {
  REQUIRE_GPT2();
  const Tokenizer& t = gpt2();
  const std::string text = "a<|endoftext|>b";
  const auto plain = t.encode(text);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 50256), 0);
  EncodeOptions opt;
  opt.allow_special = true;
  const auto with = t.encode(text, opt);
  EXPECT_EQ(with, (std::vector<int32_t>{t.encode("a")[0], 50256, t.encode("b")[0]}));
  EXPECT_EQ(t.decode(with), text);
  EXPECT_EQ(t.decode(plain), text);
}

TEST(Gpt2, RoundTripsArbitraryBytes) {
  REQUIRE_GPT2();
  const Tokenizer& t = gpt2();
  std::mt19937 rng(11);
  EncodeOptions special;
  special.allow_special = true;
  for (int trial = 0; trial < 500; ++trial) {
    const std::string s = random_bytes(rng, size_t(rng() % 300));
    ASSERT_EQ(t.decode(t.encode(s)), s) << "trial " << trial;
    ASSERT_EQ(t.decode(t.encode(s, special)), s) << "trial " << trial;
  }
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(char(b));
  EXPECT_EQ(t.decode(t.encode(all)), all);
}

TEST(Gpt2, ThreadsGiveTheSameIds) {
  REQUIRE_GPT2();
  const Tokenizer& t = gpt2();
  std::mt19937 rng(5);
  std::string text;
  while (text.size() < (size_t(1) << 19)) text += random_bytes(rng, 200) + "The end. ";
  const auto one = t.encode(text);
  for (int threads : {2, 3, 8}) {
    EncodeOptions opt;
    opt.threads = threads;
    EXPECT_EQ(t.encode(text, opt), one) << threads << " threads";
    opt.allow_special = true;
    EncodeOptions one_special;
    one_special.allow_special = true;
    EXPECT_EQ(t.encode(text, opt), t.encode(text, one_special)) << threads << " threads";
  }
}

TEST(Gpt2, LinearAndHeapMergesAgree) {
  REQUIRE_GPT2();
  const Tokenizer& t = gpt2();
  std::mt19937 rng(3);
  const std::string letters = "abcdefghijklmnopqrstuvwxyzeeeeettttaaaoooiinnsshhrr      ..";
  BpeScratch sc;
  for (int trial = 0; trial < 300; ++trial) {
    std::string w;
    const size_t n = 2 + rng() % 300;
    for (size_t i = 0; i < n; ++i) w.push_back(letters[rng() % letters.size()]);
    std::vector<int32_t> a, b;
    for (char c : w) a.push_back(t.byte_token(uint8_t(c)));
    b = a;
    a.resize(bpe_merge_linear(t.merge_table(), a.data(), a.size(), sc));
    b.resize(bpe_merge_heap(t.merge_table(), b.data(), b.size(), sc));
    ASSERT_EQ(a, b) << w;
    EXPECT_EQ(t.decode(a), w);
  }
  // A long run of one letter: GPT-2 merges pairs of equal tokens left to right.
  const std::string run(5000, 'a');
  const auto ids = t.encode(run);
  EXPECT_EQ(t.decode(ids), run);
  EXPECT_LT(ids.size(), run.size() / 2);
}

TEST(Gpt2, DecodeRejectsBadIds) {
  REQUIRE_GPT2();
  try {
    gpt2().decode(std::vector<int32_t>{15496, 50257});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("50257"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("position 1"), std::string::npos) << e.what();
  }
}

// ---- training ----

const char* kCorpus =
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.\n"
    "In the beginning was the word, and the word was with the fox.\n"
    "Numbers: 123 456 123 456 7890. Unicode: héllo wörld, naïve café, 中文 中文.\n"
    "<|endoftext|>Another document: the the the the the end.\n";

TEST(Train, LearnsMergesAndRoundTrips) {
  TrainOptions opt;
  opt.vocab_size = 256 + 80 + 1;
  BpeTrainer trainer(opt);
  for (int i = 0; i < 3; ++i) trainer.add_text(kCorpus);
  const Tokenizer t = trainer.train();
  EXPECT_EQ(t.vocab_size(), opt.vocab_size);
  EXPECT_EQ(t.num_merges(), 80u);
  EXPECT_EQ(trainer.stats().merges, 80u);
  ASSERT_EQ(t.special_ids().size(), 1u);
  EXPECT_EQ(t.token(t.special_ids()[0]), "<|endoftext|>");
  EXPECT_EQ(t.special_ids()[0], opt.vocab_size - 1);
  // Ids 0-255 are the bytes in GPT-2's order: '!' is 0, ' ' (byte 32) comes after the printable
  // ones.
  EXPECT_EQ(t.byte_token('!'), 0);
  EXPECT_EQ(t.byte_token(' '), 188 + 32);
  // Frequent words became single tokens; the first merge is the most frequent pair.
  EXPECT_EQ(t.encode(" the").size(), 1u);
  EXPECT_EQ(t.encode("he").size(), 1u);
  const auto ids = t.encode(kCorpus);
  EXPECT_LT(ids.size(), std::string_view(kCorpus).size() / 2) << "80 merges barely compress";
  EXPECT_EQ(t.decode(ids), kCorpus);
  // The special token was cut out of the training text, not learned.
  EXPECT_EQ(t.find("<|"), -1);
  EncodeOptions special;
  special.allow_special = true;
  const auto with = t.encode(kCorpus, special);
  EXPECT_EQ(std::count(with.begin(), with.end(), t.special_ids()[0]), 1);
  std::mt19937 rng(1);
  for (int trial = 0; trial < 200; ++trial) {
    const std::string s = random_bytes(rng, size_t(rng() % 200));
    ASSERT_EQ(t.decode(t.encode(s, special)), s);
  }
}

TEST(Train, SavedFilesLoadBackAndTrainingIsDeterministic) {
  TrainOptions opt;
  opt.vocab_size = 256 + 60 + 2;
  opt.special_tokens = {"<|endoftext|>", "<|pad|>"};
  auto train = [&] {
    BpeTrainer trainer(opt);
    trainer.add_text(kCorpus);
    trainer.add_text(kCorpus);
    return trainer.train();
  };
  const Tokenizer a = train();
  const fs::path dir = fs::path(LOOM_BINARY_DIR) / "tokenizer_test_vocab";
  fs::remove_all(dir);
  a.save(dir.string());
  const Tokenizer b = Tokenizer::from_dir(dir.string());
  ASSERT_EQ(b.vocab_size(), a.vocab_size());
  ASSERT_EQ(b.num_merges(), a.num_merges());
  for (int32_t id = 0; id < a.vocab_size(); ++id) ASSERT_EQ(a.token(id), b.token(id)) << id;
  EXPECT_EQ(b.special_ids(), a.special_ids());
  EXPECT_EQ(b.encode(kCorpus), a.encode(kCorpus));
  const Tokenizer c = train();
  for (size_t r = 0; r < a.num_merges(); ++r) ASSERT_EQ(a.merge(r), c.merge(r)) << r;
  fs::remove_all(dir);
}

TEST(Train, StopsEarlyWhenPairsRunOut) {
  TrainOptions opt;
  opt.vocab_size = 5000;
  opt.min_frequency = 2;
  BpeTrainer trainer(opt);
  trainer.add_text("abab abab");
  const Tokenizer t = trainer.train();
  EXPECT_TRUE(trainer.stats().stopped_early);
  EXPECT_LT(t.vocab_size(), 5000);
  EXPECT_EQ(t.decode(t.encode("abab abab")), "abab abab");
}

TEST(Train, RejectsBadOptions) {
  TrainOptions opt;
  opt.vocab_size = 200;
  EXPECT_THROW(BpeTrainer{opt}, Error);
  opt.vocab_size = 300;
  opt.special_tokens = {"x"};
  EXPECT_THROW(BpeTrainer{opt}, Error);
  opt.special_tokens = {"<a>", "<a>"};
  EXPECT_THROW(BpeTrainer{opt}, Error);
}

// ---- bad vocabulary files ----

class BadFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    // One directory per process and test: ctest runs the tests of this suite in parallel.
    dir_ = fs::path(LOOM_BINARY_DIR) /
           ("tokenizer_test_bad_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    save_trained(256 + 10 + 1, kCorpus);
  }
  void TearDown() override { fs::remove_all(dir_); }
  // Replaces the folder's files with a vocabulary of `size` tokens trained on `text`.
  void save_trained(int32_t size, const std::string& text) {
    TrainOptions opt;
    opt.vocab_size = size;
    BpeTrainer trainer(opt);
    trainer.add_text(text);
    trainer.train().save(dir_.string());
  }

  std::string read(const char* name) {
    std::ifstream f(dir_ / name, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  void write(const char* name, const std::string& text) {
    std::ofstream f(dir_ / name, std::ios::binary);
    f << text;
  }
  // The one-line error loading the folder gives; it must name the file and contain `what`.
  std::string error(const char* file, const std::string& what) {
    try {
      Tokenizer::from_dir(dir_.string());
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(file), std::string::npos) << msg;
      EXPECT_NE(msg.find(what), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
      return msg;
    }
    ADD_FAILURE() << "loading did not fail";
    return "";
  }

  fs::path dir_;
};

TEST_F(BadFiles, GoodFilesLoad) { EXPECT_NO_THROW(Tokenizer::from_dir(dir_.string())); }

TEST_F(BadFiles, MergeLineWithoutSpace) {
  write("vocab.bpe", read("vocab.bpe") + "abc\n");
  EXPECT_NE(error("vocab.bpe:12:", "bad merge line \"abc\"").find("one space"), std::string::npos);
}

TEST_F(BadFiles, MergeLineWithThreeTokens) {
  std::string v = read("vocab.bpe");
  v.insert(v.find('\n') + 1, "a b c\n");
  write("vocab.bpe", v);
  error("vocab.bpe:2:", "bad merge line \"a b c\"");
}

TEST_F(BadFiles, MergeOfUnknownToken) {
  write("vocab.bpe", read("vocab.bpe") + "zzzz q\n");
  error("vocab.bpe:12:", "token \"zzzz\" is not in");
}

TEST_F(BadFiles, MergeWhoseResultIsMissing) {
  write("vocab.bpe", read("vocab.bpe") + "q z\n");
  error("vocab.bpe", "merge 11 (\"q z\")");
}

// A merges file that lost one merge (the first, or one in the middle) would turn the token it made
// into a literal special token and encode every text differently: refused naming both files.
TEST_F(BadFiles, MergesFileMissingAMerge) {
  save_trained(256 + 100 + 1, std::string(kCorpus) + kCorpus);
  const std::string v = read("vocab.bpe");
  for (int line : {1, 40}) {
    size_t a = 0;
    for (int k = 0; k < line; ++k) a = v.find('\n', a) + 1;  // line 0 is "#version"
    write("vocab.bpe", v.substr(0, a) + v.substr(v.find('\n', a) + 1));
    error("encoder.json", "is made by no merge in");
    error("vocab.bpe", "a merge is missing");
  }
  // A special token among the text tokens (ids in frequency order, as RoBERTa's <|endoftext|>)
  // is no pair of tokens, and loads.
  write("vocab.bpe", v);
  nlohmann::json enc = nlohmann::json::parse(read("encoder.json"));
  const int64_t special = enc.at("<|endoftext|>").get<int64_t>();
  for (auto& [token, id] : enc.items())
    if (id.get<int64_t>() == 300) id = special;
  enc["<|endoftext|>"] = 300;
  write("encoder.json", enc.dump());
  const Tokenizer t = Tokenizer::from_dir(dir_.string());
  EXPECT_TRUE(t.is_special(300));
}

TEST_F(BadFiles, DuplicateMerge) {
  std::string v = read("vocab.bpe");
  const size_t a = v.find('\n') + 1;
  const std::string first = v.substr(a, v.find('\n', a) + 1 - a);
  write("vocab.bpe", v + first);
  error("vocab.bpe", "listed twice");
}

TEST_F(BadFiles, CharacterOutsideByteAlphabet) {
  // GPT-2's alphabet is U+0021-U+017E without a few gaps (U+0100 stands for byte 0); U+0200 is
  // outside it.
  write("vocab.bpe", read("vocab.bpe") + "a \xC8\x80\n");
  error("vocab.bpe:12:", "U+0200");
}

// A vocabulary of merged tokens whose merges file lost its merges would encode byte by byte: it is
// refused; one of bytes and special tokens only needs none and loads.
TEST_F(BadFiles, MergesFileWithoutMerges) {
  save_trained(256 + 100 + 1, std::string(kCorpus) + kCorpus);
  ASSERT_GT(Tokenizer::from_dir(dir_.string()).vocab_size(), 256 + 64 + 1);
  write("vocab.bpe", "#version: 0.2\n");
  error("vocab.bpe", "no merges, but");
  save_trained(256 + 1, kCorpus);
  EXPECT_NO_THROW(Tokenizer::from_dir(dir_.string()));
}

TEST_F(BadFiles, EncoderNotJson) {
  write("encoder.json", "{\"a\": 1,");
  error("encoder.json", "not valid JSON");
}

TEST_F(BadFiles, EncoderIdNotInteger) {
  std::string e = read("encoder.json");
  e.replace(e.find(": 0,"), 4, ": \"0\",");
  write("encoder.json", e);
  error("encoder.json", "id must be an integer");
}

TEST_F(BadFiles, EncoderIdOutOfRange) {
  std::string e = read("encoder.json");
  e.replace(e.find(": 0,"), 4, ": 99999,");
  write("encoder.json", e);
  error("encoder.json", "id 99999 outside");
}

TEST_F(BadFiles, EncoderDuplicateId) {
  std::string e = read("encoder.json");
  e.replace(e.find(": 1,"), 4, ": 0,");
  write("encoder.json", e);
  error("encoder.json", "id 0 is also used");
}

TEST_F(BadFiles, EncoderMissingByte) {
  std::string e = read("encoder.json");
  e.replace(e.find("{\"!\": 0,"), 8, "{\"!!!\": 0,");
  write("encoder.json", e);
  error("encoder.json", "no token for byte 0x21");
}

TEST_F(BadFiles, MissingFiles) {
  fs::remove(dir_ / "vocab.bpe");
  error(dir_.string().c_str(), "no tokenizer here");
  EXPECT_THROW(Tokenizer::from_files((dir_ / "encoder.json").string(), (dir_ / "nope").string()),
               Error);
}

}  // namespace
}  // namespace loom::data

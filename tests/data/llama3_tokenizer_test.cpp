// Llama 3's pre-tokenisation and Hugging Face tokenizer.json files. The expected splits are what
// Llama 3's pattern gives under JavaScript's regex engine (the form llama3-tokenizer-js runs); the
// whole 128K tokenizer against llama3-tokenizer-js and @huggingface/tokenizers is the long test
// NpmPeer.Llama3MatchesBothPeers (bench/llama3_tokenizer_vs_npm.sh).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/bpe_pretokenize.h"
#include "data/tokenizer.h"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::data;

namespace {

std::vector<std::string> split(std::string_view text) {
  Llama3PreTokenizer p(text);
  std::vector<std::string> out;
  std::string_view piece;
  while (p.next(&piece)) out.emplace_back(piece);
  return out;
}

// A byte-level tokenizer.json: the 256 bytes, the merges "a b", "ab c", "h e", "he l", and the
// token "xyz" that no merge makes, "<|eot|>" special; Llama 3's pre-tokeniser unless `pre` is given.
nlohmann::json tiny_json(bool ignore_merges) {
  using json = nlohmann::json;
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) {
    std::string key;
    const uint32_t cp = gpt2_byte_to_char(uint8_t(b));
    if (cp < 0x80) key += char(cp);
    else key += char(0xC0 | (cp >> 6)), key += char(0x80 | (cp & 0x3F));
    vocab[key] = b;
  }
  vocab["ab"] = 256;
  vocab["abc"] = 257;
  vocab["he"] = 258;
  vocab["hel"] = 259;
  vocab["xyz"] = 260;
  const std::string pattern =
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
      "\\s+(?!\\S)|\\s+";
  return {{"added_tokens", {{{"id", 261}, {"content", "<|eot|>"}, {"special", true}}}},
          {"normalizer", nullptr},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"}, {"pattern", {{"Regex", pattern}}}, {"behavior", "Isolated"}, {"invert", false}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
          {"model",
           {{"type", "BPE"},
            {"byte_fallback", false},
            {"ignore_merges", ignore_merges},
            {"vocab", vocab},
            {"merges", {"a b", {"ab", "c"}, "h e", "he l"}}}}};
}

struct TmpDir {
  fs::path p;
  TmpDir() {
    static int n = 0;
    p = fs::temp_directory_path() / fmt::format("loom_llama3_tok_{}_{}", ::getpid(), n++);
    fs::create_directories(p);
  }
  ~TmpDir() { fs::remove_all(p); }
};

std::string write_json(const fs::path& dir, const nlohmann::json& j) {
  const std::string path = (dir / "tokenizer.json").string();
  std::ofstream(path) << j.dump();
  return path;
}

}  // namespace

TEST(Llama3PreTokenizer, SplitsAsThePattern) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"Hello world!", {"Hello", " world", "!"}},
      {"It'S THE DOG'S", {"It", "'S", " THE", " DOG", "'S"}},
      {"12345 678", {"123", "45", " ", "678"}},
      {"(hello) $5", {"(hello", ")", " $", "5"}},
      {"a  \n  b", {"a", "  \n", " ", " b"}},
      {"x\r\n\r\ny", {"x", "\r\n\r\n", "y"}},
      {"  lead", {" ", " lead"}},
      {"end  ", {"end", "  "}},
      {"\thello\tworld", {"\thello", "\tworld"}},
      {"don't-stop", {"don", "'t", "-stop"}},
      {"l'\xC3\xA9t\xC3\xA9 \xC3\xA9t\xC3\xA9", {"l", "'\xC3\xA9t\xC3\xA9", " \xC3\xA9t\xC3\xA9"}},
      {"\xE4\xB8\xAD\xE6\x96\x87\xE5\xAD\x97\xE7\xAC\xA6", {"\xE4\xB8\xAD\xE6\x96\x87\xE5\xAD\x97\xE7\xAC\xA6"}},
      {"1a2b", {"1", "a", "2", "b"}},
      {"a1b2", {"a", "1", "b", "2"}},
      {".\n\nNext", {".\n\n", "Next"}},
      {" !!!\n", {" !!!\n"}},
      {"x \n", {"x", " \n"}},
      {"\xF0\x9F\xA6\x99\xF0\x9F\x94\xA5 ok", {"\xF0\x9F\xA6\x99\xF0\x9F\x94\xA5", " ok"}},
  };
  for (const auto& [text, want] : cases) EXPECT_EQ(split(text), want) << text;
}

TEST(TokenizerJson, ReadsLlama3StyleFilesAndIgnoreMerges) {
  TmpDir d;
  const Tokenizer t = Tokenizer::from_tokenizer_json(write_json(d.p, tiny_json(true)));
  EXPECT_EQ(t.pre_tokenization(), PreTokenization::llama3);
  EXPECT_TRUE(t.ignore_merges());
  EXPECT_EQ(t.vocab_size(), 262);
  EXPECT_TRUE(t.is_special(261));
  EXPECT_FALSE(t.is_special(260));  // no merge makes "xyz", but only added special tokens are special
  // "abc" by merges, "xyz" whole under ignore_merges, "hello" -> "hel" + l + o; the special
  // spelling only with allow_special.
  // Pieces 'abc', ' xyz', ' hello': a piece is looked up whole (' xyz' is no token, so its bytes
  // stay), and merges join inside it (' ', 'hel', 'l', 'o').
  EXPECT_EQ(t.encode("abc xyz hello"), (std::vector<int32_t>{257, ' ', 'x', 'y', 'z', ' ', 259, 'l', 'o'}));
  EXPECT_EQ(t.encode("xyz"), (std::vector<int32_t>{260}));
  EXPECT_EQ(t.encode("hello"), (std::vector<int32_t>{259, 'l', 'o'}));
  EXPECT_EQ(t.encode("ab<|eot|>", {.allow_special = true}), (std::vector<int32_t>{256, 261}));
  EXPECT_EQ(t.decode(t.encode("ab<|eot|>")), "ab<|eot|>");
  // Without ignore_merges the whole-token shortcut is taken only where merges give the token.
  const Tokenizer m = Tokenizer::from_tokenizer_json(write_json(d.p, tiny_json(false)));
  EXPECT_EQ(m.encode("xyz"), (std::vector<int32_t>{'x', 'y', 'z'}));
  EXPECT_NE(m.fingerprint(), t.fingerprint());
  // Saved (as tokenizer.json: GPT-2's files cannot hold the pattern) and read back: the same.
  TmpDir s;
  t.save(s.p.string());
  EXPECT_TRUE(fs::exists(s.p / "tokenizer.json"));
  EXPECT_FALSE(fs::exists(s.p / "encoder.json"));
  const Tokenizer back = Tokenizer::from_dir(s.p.string());
  EXPECT_EQ(back.fingerprint(), t.fingerprint());
  EXPECT_EQ(back.encode("abc xyz hello <|eot|>", {.allow_special = true}),
            t.encode("abc xyz hello <|eot|>", {.allow_special = true}));
}

// SmolLM's pre-tokenisation: each ASCII digit alone, GPT-2's pattern on the text between (so " 12"
// is " ", "1", "2", not GPT-2's " 12"); saved and read back the same.
TEST(TokenizerJson, DigitsThenByteLevel) {
  TmpDir d;
  auto j = tiny_json(false);
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Digits"}, {"individual_digits", true}},
                          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}}}};
  const Tokenizer t = Tokenizer::from_tokenizer_json(write_json(d.p, j));
  EXPECT_EQ(t.pre_tokenization(), PreTokenization::gpt2_digits);
  EXPECT_EQ(t.encode("ab 12abc"), (std::vector<int32_t>{256, ' ', '1', '2', 257}));
  EXPECT_EQ(t.encode("he7l"), (std::vector<int32_t>{258, '7', 'l'}));
  TmpDir s;
  t.save(s.p.string());
  const Tokenizer back = Tokenizer::from_dir(s.p.string());
  EXPECT_EQ(back.pre_tokenization(), PreTokenization::gpt2_digits);
  EXPECT_EQ(back.fingerprint(), t.fingerprint());
}

// Added tokens that are not special are matched in any text, as Hugging Face splits every added
// token out before the model (allow_special or not); the post-processor's template gives the
// special tokens tokenizer(text) adds (Llama 3's <|begin_of_text|> before, here after too), in a
// Sequence after ByteLevel as Llama 3.1 writes it; both survive a save.
TEST(TokenizerJson, AddedTokensAndThePostProcessorsTemplate) {
  TmpDir d;
  auto j = tiny_json(false);
  j["added_tokens"].push_back({{"id", 262}, {"content", "<tag>"}, {"special", false}, {"lstrip", false},
                               {"rstrip", false}, {"single_word", false}, {"normalized", true}});
  j["added_tokens"].push_back({{"id", 263}, {"content", "<|bos|>"}, {"special", true}});
  j["post_processor"] = nlohmann::json::parse(R"({
    "type": "Sequence",
    "processors": [
      {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
      {"type": "TemplateProcessing",
       "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": "<|eot|>", "type_id": 0}}],
       "pair": [],
       "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [263], "tokens": ["<|bos|>"]},
                          "<|eot|>": {"id": "<|eot|>", "ids": [261], "tokens": ["<|eot|>"]}}}]})");
  const Tokenizer t = Tokenizer::from_tokenizer_json(write_json(d.p, j));
  EXPECT_FALSE(t.is_special(262));
  EXPECT_EQ(t.added_ids(), std::vector<int32_t>{262});
  EXPECT_EQ(t.encode("ab<tag>c"), (std::vector<int32_t>{256, 262, 'c'}));
  EXPECT_EQ(t.encode("ab<tag><|eot|>"), (std::vector<int32_t>{256, 262, '<', '|', 'e', 'o', 't', '|', '>'}));
  EXPECT_EQ(t.encode("ab<tag><|eot|>", {.allow_special = true}), (std::vector<int32_t>{256, 262, 261}));
  // On threads: an added token across a chunk's natural cut stays whole.
  std::string long_text;
  for (int i = 0; i < 30000; ++i) long_text += "ab <tag>x";
  EXPECT_EQ(t.encode(long_text, {.threads = 4}), t.encode(long_text));
  EXPECT_EQ(t.template_prefix(), std::vector<int32_t>{263});
  EXPECT_EQ(t.template_suffix(), std::vector<int32_t>{261});
  EXPECT_EQ(t.end_of_text(), -1);  // (<|eot|> is none of the names looked for)
  const Tokenizer plain = Tokenizer::from_tokenizer_json(write_json(d.p, tiny_json(false)));
  EXPECT_TRUE(plain.template_prefix().empty() && plain.template_suffix().empty());
  EXPECT_NE(plain.fingerprint(), Tokenizer::from_tokenizer_json(write_json(d.p, j)).fingerprint());
  TmpDir s;
  t.save(s.p.string());
  EXPECT_TRUE(fs::exists(s.p / "tokenizer.json"));
  const Tokenizer back = Tokenizer::from_dir(s.p.string());
  EXPECT_EQ(back.fingerprint(), t.fingerprint());
  EXPECT_EQ(back.encode("ab<tag>c"), t.encode("ab<tag>c"));
  EXPECT_EQ(back.template_prefix(), t.template_prefix());
  EXPECT_EQ(back.template_suffix(), t.template_suffix());
  // An added token that is not special stays in the saved model.vocab (Hugging Face's BPE refuses
  // merges into a token missing from it).
  const auto saved = nlohmann::json::parse(std::ifstream(s.p / "tokenizer.json"));
  EXPECT_EQ(saved["model"]["vocab"].value("<tag>", -1), 262) << saved["model"]["vocab"].dump().substr(0, 200);
  EXPECT_FALSE(saved["model"]["vocab"].contains("<|bos|>"));
  // RoBERTa's post-processor: cls $A sep.
  auto r = tiny_json(false);
  r["added_tokens"].push_back({{"id", 262}, {"content", "<s>"}, {"special", true}});
  r["post_processor"] = {{"type", "RobertaProcessing"}, {"cls", {"<s>", 262}}, {"sep", {"<|eot|>", 261}}};
  const Tokenizer roberta = Tokenizer::from_tokenizer_json(write_json(d.p, r));
  EXPECT_EQ(roberta.template_prefix(), std::vector<int32_t>{262});
  EXPECT_EQ(roberta.template_suffix(), std::vector<int32_t>{261});
  // GPT-2's files (a vocabulary made by training) name their end of text.
  j = tiny_json(false);
  j["added_tokens"][0]["content"] = "<|end_of_text|>";
  EXPECT_EQ(Tokenizer::from_tokenizer_json(write_json(d.p, j)).end_of_text(), 261);
}

TEST(TokenizerJson, BadFilesNameTheField) {
  TmpDir d;
  auto expect_error = [&](nlohmann::json j, const std::string& want) {
    const std::string path = write_json(d.p, j);
    try {
      (void)Tokenizer::from_tokenizer_json(path);
      ADD_FAILURE() << "no error, want " << want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  };
  auto j = tiny_json(true);
  j["model"]["type"] = "Unigram";
  expect_error(j, "field 'model.type' is \"Unigram\"");
  j = tiny_json(true);
  j["model"]["byte_fallback"] = true;
  expect_error(j, "field 'model.byte_fallback'");
  j = tiny_json(true);
  j["normalizer"] = {{"type", "NFC"}};
  expect_error(j, "field 'normalizer'");
  // Fields with which Hugging Face would encode otherwise (a dropout of 0 and empty affixes do
  // nothing and are taken).
  j = tiny_json(true);
  j["model"]["dropout"] = 0.5;
  expect_error(j, "field 'model.dropout' is 0.5");
  j = tiny_json(true);
  j["model"]["continuing_subword_prefix"] = "##";
  expect_error(j, "field 'model.continuing_subword_prefix' is \"##\"");
  j = tiny_json(true);
  j["model"]["end_of_word_suffix"] = "</w>";
  expect_error(j, "field 'model.end_of_word_suffix'");
  j = tiny_json(true);
  j["model"]["dropout"] = 0;
  j["model"]["end_of_word_suffix"] = "";
  (void)Tokenizer::from_tokenizer_json(write_json(d.p, j));
  j = tiny_json(true);
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\s+";
  expect_error(j, "field 'pre_tokenizer'");
  j = tiny_json(true);
  j["model"]["vocab"].erase("ab");  // id 256 missing: the added token's 261 is then beyond the 261 listed
  expect_error(j, "id 261 is outside 0 .. 260 (the file lists 261 tokens)");
  j = tiny_json(true);
  j["model"]["merges"].push_back("q zz");
  expect_error(j, "\"zz\" is not a token of the vocabulary");
  j = tiny_json(true);
  j["added_tokens"][0]["id"] = 256;
  expect_error(j, "id 256 is also token \"ab\"");
  // An id far beyond the tokens listed is refused before the table grows to it (it threw
  // bad_alloc); fields of another JSON type are named (they threw the JSON library's type errors).
  j = tiny_json(true);
  j["model"]["vocab"]["ab"] = 2147483646;
  expect_error(j, "id 2147483646 is outside 0 .. ");
  j = tiny_json(true);
  j["model"]["type"] = 5;
  expect_error(j, "field 'model.type' must be a string, not 5");
  j = tiny_json(true);
  j["model"]["ignore_merges"] = "yes";
  expect_error(j, "field 'model.ignore_merges' must be true or false, not \"yes\"");
  j = tiny_json(true);
  j["added_tokens"][0]["special"] = "yes";
  expect_error(j, "field 'added_tokens.special' must be true or false");
  j = tiny_json(true);
  j["pre_tokenizer"]["pretokenizers"] = {5, 6};
  expect_error(j, "field 'pre_tokenizer' is ");
  j = tiny_json(true);
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"] = "\\s+";
  expect_error(j, "field 'pre_tokenizer' is ");
  // Added tokens that take the white space beside them or match whole words only; post-processors
  // loom does not implement, and templates it cannot read.
  for (const char* flag : {"lstrip", "rstrip", "single_word"}) {
    j = tiny_json(true);
    j["added_tokens"][0][flag] = true;
    expect_error(j, fmt::format("token \"<|eot|>\" (id 261): {} is true", flag));
  }
  j = tiny_json(true);
  j["post_processor"] = {{"type", "PostProcessorX"}};
  expect_error(j, "field 'post_processor' is {\"type\":\"PostProcessorX\"}");
  j["post_processor"] = {{"type", "RobertaProcessing"}, {"cls", {"<s>", 0}}, {"sep", {"<|eot|>", 261}}};
  expect_error(j, "field 'post_processor.cls' is [\"<s>\",0]: a [token, id] pair of the vocabulary");
  j = tiny_json(true);
  j["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", {{{"SpecialToken", {{"id", "<s>"}}}}, {{"Sequence", {{"id", "A"}}}}}},
                         {"special_tokens", nlohmann::json::object()}};
  expect_error(j, "field 'post_processor.special_tokens' has no ids for \"<s>\"");
  j["post_processor"]["single"] = {{{"Sequence", {{"id", "B"}}}}};
  expect_error(j, "is not the sequence $A");
  std::ofstream(d.p / "tokenizer.json") << "{\"model\": ";
  try {
    (void)Tokenizer::from_tokenizer_json((d.p / "tokenizer.json").string());
    ADD_FAILURE() << "no error for truncated JSON";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("malformed JSON"), std::string::npos) << e.what();
  }
}

#include "data/tokenizer.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>  // for writing keys
#include <sstream>
#include <thread>
#include <type_traits>

#include "core/error.h"
#include "core/file.h"
#include "data/bpe_pretokenize.h"
#include "data/unicode.h"

namespace loom::data {
namespace {

[[noreturn]] void bad_input(const std::string& msg) { throw Error(msg); }

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes
// take the code points 256, 257, ... in byte order.
struct ByteMap {
  uint32_t to_char[256];
  int16_t from_char[324];  // code point -> byte, -1 when not in the alphabet
  std::vector<uint8_t> order;

  ByteMap() {
    std::fill(std::begin(from_char), std::end(from_char), int16_t(-1));
    auto printable = [](int b) { return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174; };
    for (int b = 0; b < 256; ++b) {
      if (printable(b)) order.push_back(uint8_t(b));
    }
    uint32_t extra = 256;
    for (int b = 0; b < 256; ++b) {
      if (!printable(b)) order.push_back(uint8_t(b));
    }
    for (int b = 0; b < 256; ++b) to_char[b] = printable(b) ? uint32_t(b) : 0;
    for (int b = 0; b < 256; ++b) {
      if (!printable(b)) to_char[b] = extra++;
    }
    for (int b = 0; b < 256; ++b) from_char[to_char[b]] = int16_t(b);
  }
};

const ByteMap& byte_map() {
  static const ByteMap m;
  return m;
}

// Bytes of a token written in GPT-2's alphabet; false when a character is not in it.
bool chars_to_bytes(std::string_view s, std::string* out, uint32_t* bad) {
  const ByteMap& m = byte_map();
  out->clear();
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const auto* end = p + s.size();
  while (p < end) {
    uint32_t cp;
    p += decode_utf8(p, end, &cp);
    if (cp >= 324 || m.from_char[cp] < 0) {
      *bad = cp;
      return false;
    }
    out->push_back(char(m.from_char[cp]));
  }
  return true;
}

std::string bytes_to_chars(std::string_view s) {
  std::string out;
  for (unsigned char b : s) append_utf8(byte_map().to_char[b], out);
  return out;
}

// s for an error message: valid UTF-8 and printable ASCII as they are, other bytes as \xNN.
std::string printable(std::string_view s, size_t max = 60) {
  std::string out;
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const auto* end = p + std::min(s.size(), max);
  while (p < end) {
    uint32_t cp;
    const size_t len = decode_utf8(p, end, &cp);
    if (cp >= 32 && cp < kInvalidByteBase && cp != 127 && cp != '\\' && !(cp >= 0x80 && cp < 0xA0)) {
      out.append(reinterpret_cast<const char*>(p), len);
    } else {
      out += fmt::format("\\x{:02x}", *p);
    }
    p += cp >= kInvalidByteBase ? 1 : len;
  }
  if (s.size() > max) out += "...";
  return out;
}

std::string describe_char(uint32_t cp) {
  return cp >= kInvalidByteBase ? fmt::format("invalid UTF-8 byte 0x{:02x}", cp - kInvalidByteBase)
                                : fmt::format("character U+{:04X}", cp);
}

// A strict reader for the one JSON shape a vocabulary file has: an object of string -> integer.
// (A general JSON library spends most of its time building a tree we do not need.)
class VocabJsonReader {
 public:
  VocabJsonReader(const std::string& path, std::string_view text) : path_(path), s_(text) {}

  // Calls fn(key, id) for every member, in file order.
  template <class F>
  void read(F&& fn) {
    skip_ws();
    expect('{', "'{' (a JSON object of token -> id)");
    skip_ws();
    if (peek() == '}') {
      ++i_;
    } else {
      std::string key;
      for (;;) {
        skip_ws();
        expect('"', "a string key");
        read_string(&key);
        skip_ws();
        expect(':', "':'");
        skip_ws();
        const size_t at = i_;
        int64_t id = 0;
        if (!read_integer(&id)) {
          size_t e = at;
          while (e < s_.size() && s_[e] != ',' && s_[e] != '}' && e - at < 20) ++e;
          bad_input(fmt::format("{}: token \"{}\": id must be an integer, got {}", path_,
                                printable(key), s_.substr(at, e - at)));
        }
        fn(key, id);
        skip_ws();
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect('}', "',' or '}'");
        break;
      }
    }
    skip_ws();
    if (i_ != s_.size()) fail("the end of the file after the object");
  }

 private:
  char peek() const { return i_ < s_.size() ? s_[i_] : '\0'; }
  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
  }
  [[noreturn]] void fail(const char* expected) const {
    bad_input(fmt::format("{}: not valid JSON at byte {}: expected {}", path_, i_, expected));
  }
  void expect(char c, const char* what) {
    if (peek() != c) fail(what);
    ++i_;
  }
  uint32_t hex4() {
    if (i_ + 4 > s_.size()) fail("four hex digits after \\u");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s_[i_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= uint32_t(c - '0');
      else if (c >= 'a' && c <= 'f') v |= uint32_t(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= uint32_t(c - 'A' + 10);
      else fail("four hex digits after \\u");
    }
    return v;
  }
  void read_string(std::string* out) {
    out->clear();
    for (;;) {
      if (i_ >= s_.size()) fail("'\"' to close the string");
      const char c = s_[i_++];
      if (c == '"') return;
      if (uint8_t(c) < 0x20) fail("no control characters inside a string");
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (i_ >= s_.size()) fail("an escape after '\\'");
      const char e = s_[i_++];
      switch (e) {
        case '"': out->push_back('"'); break;
        case '\\': out->push_back('\\'); break;
        case '/': out->push_back('/'); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (i_ + 2 > s_.size() || s_[i_] != '\\' || s_[i_ + 1] != 'u') fail("a low surrogate");
            i_ += 2;
            const uint32_t lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("a low surrogate");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("a high surrogate before a low one");
          }
          append_utf8(cp, *out);
          break;
        }
        default: --i_; fail("a valid escape");
      }
    }
  }
  bool read_integer(int64_t* v) {
    size_t j = i_;
    bool neg = false;
    if (j < s_.size() && s_[j] == '-') {
      neg = true;
      ++j;
    }
    const size_t digits = j;
    int64_t x = 0;
    while (j < s_.size() && s_[j] >= '0' && s_[j] <= '9' && j - digits < 12) x = x * 10 + (s_[j++] - '0');
    if (j == digits) return false;
    if (j < s_.size() && (s_[j] == '.' || s_[j] == 'e' || s_[j] == 'E' || (s_[j] >= '0' && s_[j] <= '9'))) {
      return false;
    }
    i_ = j;
    *v = neg ? -x : x;
    return true;
  }

  const std::string& path_;
  std::string_view s_;
  size_t i_ = 0;
};

}  // namespace

uint32_t gpt2_byte_to_char(uint8_t b) { return byte_map().to_char[b]; }
const std::vector<uint8_t>& gpt2_byte_order() { return byte_map().order; }

// ---- loading and saving ----

Tokenizer Tokenizer::from_files(const std::string& vocab_json, const std::string& merges_txt) {
  // The vocabulary: {"token in GPT-2's alphabet": id, ...} with ids 0..N-1.
  const std::string json = read_file(vocab_json);
  std::vector<std::pair<int64_t, std::string>> entries;  // (id, bytes) in file order
  entries.reserve(json.size() / 16);
  std::string bytes;
  VocabJsonReader(vocab_json, json).read([&](const std::string& key, int64_t id) {
    uint32_t bad = 0;
    if (!chars_to_bytes(key, &bytes, &bad)) {
      bad_input(fmt::format("{}: token \"{}\": {} is not in GPT-2's byte alphabet", vocab_json,
                            printable(key), describe_char(bad)));
    }
    if (bytes.empty()) bad_input(fmt::format("{}: empty token (id {})", vocab_json, id));
    entries.emplace_back(id, bytes);
  });
  constexpr int64_t kMaxVocab = int64_t(1) << 24;
  const int64_t n = int64_t(entries.size());
  std::vector<std::string> tokens(entries.size());
  std::vector<uint8_t> seen(entries.size(), 0);
  for (auto& [id, b] : entries) {
    if (id < 0 || id >= n || id >= kMaxVocab) {
      bad_input(fmt::format("{}: token \"{}\": id {} outside 0..{} (ids must be 0..N-1)",
                            vocab_json, printable(bytes_to_chars(b)), id, n - 1));
    }
    if (seen[id]) {
      bad_input(fmt::format("{}: token \"{}\": id {} is also used by another token", vocab_json,
                            printable(bytes_to_chars(b)), id));
    }
    seen[id] = 1;
    tokens[id] = std::move(b);
  }

  Tokenizer t;
  t.offsets_.reserve(tokens.size() + 1);
  t.offsets_.push_back(0);
  for (const std::string& s : tokens) {
    t.bytes_ += s;
    t.offsets_.push_back(uint32_t(t.bytes_.size()));
  }
  t.vocab_ = FlatStringMap<int32_t>(tokens.size());
  for (size_t id = 0; id < tokens.size(); ++id) {
    if (!t.vocab_.insert(tokens[id], int32_t(id)).second) {
      bad_input(fmt::format("{}: id {}: token \"{}\" appears twice", vocab_json, id,
                            printable(tokens[id])));
    }
  }

  // The merges: an optional "#version" line, then one "left right" per line in rank order.
  const std::string text = read_file(merges_txt);
  std::vector<std::pair<int32_t, int32_t>> merges;
  std::string left, right;
  size_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos) eol = text.size();
    std::string_view line(text.data() + pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && line.starts_with("#version"))) continue;
    const auto where = [&] { return fmt::format("{}:{}", merges_txt, line_no); };
    const size_t sp = line.find(' ');
    if (sp == std::string_view::npos || sp == 0 || sp + 1 == line.size() ||
        line.find(' ', sp + 1) != std::string_view::npos) {
      bad_input(fmt::format("{}: bad merge line \"{}\": expected two tokens separated by one space",
                            where(), printable(line)));
    }
    uint32_t bad = 0;
    if (!chars_to_bytes(line.substr(0, sp), &left, &bad) ||
        !chars_to_bytes(line.substr(sp + 1), &right, &bad)) {
      bad_input(fmt::format("{}: bad merge line \"{}\": {} is not in GPT-2's byte alphabet",
                            where(), printable(line), describe_char(bad)));
    }
    const int32_t l = t.find(left), r = t.find(right);
    if (l < 0 || r < 0) {
      bad_input(fmt::format("{}: bad merge line \"{}\": token \"{}\" is not in {}", where(),
                            printable(line), printable(l < 0 ? line.substr(0, sp) : line.substr(sp + 1)),
                            vocab_json));
    }
    merges.emplace_back(l, r);
  }
  t.build(merges, vocab_json, merges_txt);
  return t;
}

std::vector<std::string> Tokenizer::files_in_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path d(dir);
  for (const std::vector<std::string>& set : std::vector<std::vector<std::string>>{
           {"encoder.json", "vocab.bpe"}, {"tokenizer.json"}, {"vocab.json", "merges.txt"}}) {
    std::vector<std::string> paths;
    for (const std::string& f : set)
      if (fs::exists(d / f)) paths.push_back((d / f).string());
    if (paths.size() == set.size()) return paths;
  }
  return {};
}

bool Tokenizer::dir_has_tokenizer(const std::string& dir) { return !files_in_dir(dir).empty(); }

Tokenizer Tokenizer::from_dir(const std::string& dir) {
  const std::vector<std::string> f = files_in_dir(dir);
  if (f.size() == 2) return from_files(f[0], f[1]);
  if (f.size() == 1) return from_tokenizer_json(f[0]);
  bad_input(fmt::format("{}: no tokenizer here (expected encoder.json + vocab.bpe, tokenizer.json, or "
                        "vocab.json + merges.txt)", dir));
}

Tokenizer Tokenizer::from_parts(std::vector<std::string> tokens,
                                const std::vector<std::pair<int32_t, int32_t>>& merges,
                                const std::vector<int32_t>& special) {
  Tokenizer t;
  t.offsets_.push_back(0);
  t.vocab_ = FlatStringMap<int32_t>(tokens.size());
  for (size_t id = 0; id < tokens.size(); ++id) {
    LOOM_CHECK(!tokens[id].empty(), "tokenizer: token {} is empty", id);
    LOOM_CHECK(t.vocab_.insert(tokens[id], int32_t(id)).second,
               "tokenizer: token {} (\"{}\") appears twice", id, printable(tokens[id]));
    t.bytes_ += tokens[id];
    t.offsets_.push_back(uint32_t(t.bytes_.size()));
  }
  for (auto [l, r] : merges) {
    LOOM_CHECK(l >= 0 && r >= 0 && l < t.vocab_size() && r < t.vocab_size(),
               "tokenizer: merge ({}, {}) names an id outside the vocabulary", l, r);
  }
  t.build(merges, "tokens", "merges");
  for (int32_t id : special) {
    LOOM_CHECK(id >= 0 && id < t.vocab_size(), "tokenizer: special id {} out of range", id);
    t.add_special(t.token(id));
  }
  return t;
}

// Fills the merge table, byte ids, the whole-token flags and the special tokens (the tokens that
// are neither single bytes nor made by a merge).
void Tokenizer::build(const std::vector<std::pair<int32_t, int32_t>>& merges,
                      const std::string& vocab_where, const std::string& where) {
  const int32_t n = vocab_size();
  for (int b = 0; b < 256; ++b) {
    const char c = char(b);
    byte_id_[b] = find(std::string_view(&c, 1));
    if (byte_id_[b] < 0) {
      bad_input(fmt::format("{}: the vocabulary has no token for byte 0x{:02x} (\"{}\"); a byte-level "
                            "BPE vocabulary needs all 256", vocab_where, b,
                            bytes_to_chars(std::string_view(&c, 1))));
    }
  }
  merges_ = MergeTable();
  merges_.reserve(merges.size());
  merge_pairs_ = merges;
  std::vector<uint8_t> made(size_t(n), 0);
  std::string joined;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto [l, r] = merges[rank];
    joined.assign(token(l));
    joined.append(token(r));
    const int32_t id = find(joined);
    if (id < 0) {
      bad_input(fmt::format("{}: merge {} (\"{} {}\"): the joined token \"{}\" is not in the "
                            "vocabulary", where, rank + 1, bytes_to_chars(token(l)),
                            bytes_to_chars(token(r)), bytes_to_chars(joined)));
    }
    if (!merges_.insert(l, r, {uint32_t(rank), id})) {
      bad_input(fmt::format("{}: merge {} (\"{} {}\") is listed twice", where, rank + 1,
                            bytes_to_chars(token(l)), bytes_to_chars(token(r))));
    }
    made[id] = 1;
  }
  special_ids_.clear();
  special_flag_.assign(size_t(n), 0);
  // The text tokens (the bytes and what merges make) span ids first_text .. last_made.
  int32_t first_text = n, last_made = -1;
  for (int b = 0; b < 256; ++b) first_text = std::min(first_text, byte_id_[b]);
  for (int32_t id = 0; id < n; ++id)
    if (made[id]) first_text = std::min(first_text, id), last_made = id;
  for (int32_t id = 0; id < n; ++id) {
    if (!made[id] && token(id).size() > 1) {
      // Special tokens sit before or after the text tokens (GPT-2's <|endoftext|> last, RoBERTa's
      // <s> first) or, where ids follow frequency (RoBERTa's <|endoftext|>), are no pair of tokens:
      // one among the text tokens that two tokens join into is a token whose merge was lost.
      const std::string_view tok = token(id);
      bool pair = false;
      for (size_t k = 1; k < tok.size() && !pair; ++k) pair = find(tok.substr(0, k)) >= 0 && find(tok.substr(k)) >= 0;
      if (id > first_text && id < last_made && pair)
        bad_input(fmt::format("{}: token {} (\"{}\") is made by no merge in {}, but it sits among the tokens "
                              "bytes and merges make (ids {} to {}): a merge is missing",
                              vocab_where, id, printable(token(id)), where, first_text, last_made));
      special_ids_.push_back(id);
      special_flag_[id] = 1;
    }
  }
  // Tokens longer than a byte that no merge makes are special tokens (<|endoftext|>), matched only
  // literally. A vocabulary of many such tokens and no merges at all has lost its merges: it would
  // encode every text byte by byte.
  constexpr size_t kSpecialsWithoutMerges = 64;
  if (merges.empty() && special_ids_.size() > kSpecialsWithoutMerges)
    bad_input(fmt::format("{}: no merges, but {} holds {} tokens longer than one byte that no merge makes (a "
                          "byte-level BPE vocabulary lists the merges that make its tokens; only special tokens such "
                          "as <|endoftext|> come from none): the merges file is missing its merges",
                          where, vocab_where, special_ids_.size()));
  build_special_index();
  compute_whole();
}

void Tokenizer::compute_whole() {
  // A word that is itself a token usually encodes to that token; remember where that holds so
  // encoding can skip the merge loop for it (and stay exact where it does not).
  const int32_t n = vocab_size();
  whole_.assign(size_t(n), 0);
  BpeScratch scratch;
  std::vector<int32_t> work;
  for (int32_t id = 0; id < n; ++id) {
    if (special_flag_[id]) continue;
    const std::string_view s = token(id);
    work.resize(s.size());
    for (size_t i = 0; i < s.size(); ++i) work[i] = byte_id_[uint8_t(s[i])];
    const size_t m = bpe_merge(merges_, work.data(), work.size(), scratch);
    whole_[id] = m == 1 && work[0] == id;
  }
}

void Tokenizer::set_special(const std::vector<int32_t>& ids, const std::vector<int32_t>& added) {
  special_ids_ = ids;
  added_ids_ = added;
  special_flag_.assign(size_t(vocab_size()), 0);
  for (int32_t id : ids) special_flag_[size_t(id)] = 1;
  build_special_index();
  compute_whole();
}

void Tokenizer::build_special_index() {
  special_by_length_.clear();
  std::fill(std::begin(special_first_byte_), std::end(special_first_byte_), uint8_t(0));
  special_max_len_ = 0;
  for (const bool always : {false, true})
    for (int32_t id : always ? added_ids_ : special_ids_) {
      const std::string_view s = token(id);
      special_by_length_.push_back({std::string(s), id, always});
      special_first_byte_[uint8_t(s[0])] |= always ? 2 : 1;
      special_max_len_ = std::max(special_max_len_, s.size());
    }
  std::stable_sort(special_by_length_.begin(), special_by_length_.end(),
                   [](const Matched& a, const Matched& b) { return a.text.size() > b.text.size(); });
}

int32_t Tokenizer::end_of_text() const {
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>"})
    if (const int32_t id = find(name); id >= 0 && is_special(id)) return id;
  return -1;
}

int32_t Tokenizer::add_special(std::string_view text) {
  LOOM_CHECK(!text.empty(), "tokenizer: a special token cannot be empty");
  int32_t id = find(text);
  if (id >= 0) {
    if (special_flag_[id]) return id;
    // build() marks every token that no merge makes; the others are ordinary text.
    LOOM_FAIL("tokenizer: special token \"{}\" is already an ordinary token (id {})",
              printable(text), id);
  } else {
    id = vocab_size();
    bytes_.append(text);
    offsets_.push_back(uint32_t(bytes_.size()));
    vocab_.insert(text, id);
    whole_.push_back(0);
    special_flag_.push_back(0);
  }
  special_flag_[id] = 1;
  special_ids_.push_back(id);
  build_special_index();
  return id;
}

void Tokenizer::save(const std::string& dir) const {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (dir.empty()) bad_input("tokenizer: the folder to save it in has an empty name");
  fs::create_directories(dir, ec);
  if (ec) bad_input(fmt::format("{}: cannot create directory: {}", dir, ec.message()));
  const fs::path d(dir);
  // (GPT-2's files cannot say another pre-tokenisation, ignored merges, added tokens that are not
  // special, or a post-processor.)
  if (pre_ != PreTokenization::gpt2 || ignore_merges_ || !added_ids_.empty() || !post_processor_.empty())
    return save_tokenizer_json((d / "tokenizer.json").string());
  {
    std::string out = "{";
    for (int32_t id = 0; id < vocab_size(); ++id) {
      if (id) out += ", ";
      out += nlohmann::json(bytes_to_chars(token(id))).dump();
      out += fmt::format(": {}", id);
    }
    out += "}";
    write_file_atomically((d / "encoder.json").string(), out);
  }
  {
    std::string out = "#version: 0.2\n";
    for (auto [l, r] : merge_pairs_) {
      out += bytes_to_chars(token(l));
      out += ' ';
      out += bytes_to_chars(token(r));
      out += '\n';
    }
    write_file_atomically((d / "vocab.bpe").string(), out);
  }
}

// ---- lookups ----

std::string_view Tokenizer::token(int32_t id) const {
  LOOM_CHECK(id >= 0 && id < vocab_size(), "tokenizer: token id {} outside 0..{}", id,
             vocab_size() - 1);
  return std::string_view(bytes_).substr(offsets_[id], offsets_[id + 1] - offsets_[id]);
}

int32_t Tokenizer::find(std::string_view bytes) const {
  const int32_t* id = vocab_.find(bytes);
  return id ? *id : -1;
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && size_t(id) < special_flag_.size() && special_flag_[id];
}

// ---- encoding ----

void Tokenizer::encode_piece(std::string_view piece, EncodeCache& c,
                             std::vector<int32_t>* out) const {
  if (piece.size() == 1) {
    out->push_back(byte_id_[uint8_t(piece[0])]);
    return;
  }
  const uint64_t h = hash_bytes(piece);
  if (const int32_t* id = vocab_.find(piece, h); id && (whole_[*id] || (ignore_merges_ && !special_flag_[*id]))) {
    out->push_back(*id);
    return;
  }
  if (const EncodeCache::Span* s = c.words_.find(piece, h)) {
    out->insert(out->end(), c.ids_.begin() + s->off, c.ids_.begin() + s->off + s->len);
    return;
  }
  c.work_.resize(piece.size());
  for (size_t i = 0; i < piece.size(); ++i) c.work_[i] = byte_id_[uint8_t(piece[i])];
  const size_t n = bpe_merge(merges_, c.work_.data(), piece.size(), c.scratch_);
  out->insert(out->end(), c.work_.begin(), c.work_.begin() + n);
  if (piece.size() > 256) return;  // long runs rarely repeat; do not fill the cache with them
  if (c.words_.size() >= c.max_words_) {
    c.words_.clear();
    c.ids_.clear();
  }
  c.words_.insert(piece, h, EncodeCache::Span{uint32_t(c.ids_.size()), uint32_t(n)});
  c.ids_.insert(c.ids_.end(), c.work_.begin(), c.work_.begin() + n);
}

void Tokenizer::encode_ordinary(std::string_view text, EncodeCache& cache,
                                std::vector<int32_t>* out) const {
  std::string_view piece;
  if (pre_ == PreTokenization::llama3) {
    Llama3PreTokenizer pre(text);
    while (pre.next(&piece)) encode_piece(piece, cache, out);
    return;
  }
  if (pre_ == PreTokenization::gpt2_digits) {
    // Each ASCII digit alone; GPT-2's pattern on the text between them.
    size_t i = 0;
    while (i < text.size()) {
      if (text[i] >= '0' && text[i] <= '9') {
        encode_piece(text.substr(i, 1), cache, out);
        ++i;
        continue;
      }
      size_t j = i;
      while (j < text.size() && !(text[j] >= '0' && text[j] <= '9')) ++j;
      PreTokenizer pre(text.substr(i, j - i));
      while (pre.next(&piece)) encode_piece(piece, cache, out);
      i = j;
    }
    return;
  }
  PreTokenizer pre(text);
  while (pre.next(&piece)) encode_piece(piece, cache, out);
}

std::pair<size_t, int32_t> Tokenizer::find_special(std::string_view text, size_t from, bool allow_special) const {
  const uint8_t want = allow_special ? 3 : 2;
  for (size_t i = from; i < text.size(); ++i) {
    if (!(special_first_byte_[uint8_t(text[i])] & want)) continue;
    for (const Matched& m : special_by_length_) {
      if ((m.always || allow_special) && text.compare(i, m.text.size(), m.text) == 0) return {i, m.id};
    }
  }
  return {std::string_view::npos, -1};
}

void Tokenizer::encode(std::string_view text, const EncodeOptions& opt, EncodeCache& cache,
                       std::vector<int32_t>* out) const {
  if ((!opt.allow_special && added_ids_.empty()) || special_by_length_.empty()) {
    encode_ordinary(text, cache, out);
    return;
  }
  size_t pos = 0;
  while (pos < text.size()) {
    const auto [at, id] = find_special(text, pos, opt.allow_special);
    if (at == std::string_view::npos) {
      encode_ordinary(text.substr(pos), cache, out);
      break;
    }
    encode_ordinary(text.substr(pos, at - pos), cache, out);
    out->push_back(id);
    pos = at + token(id).size();
  }
}

// Splits text into up to `parts` chunks at positions where GPT-2's pattern always ends a piece
// whatever follows: between two ASCII characters of different classes, neither white space and
// the first not an apostrophe (so no contraction spans it). A special token may not span a cut.
std::vector<std::pair<size_t, size_t>> Tokenizer::split_for_threads(std::string_view text,
                                                                    int parts,
                                                                    bool allow_special) const {
  std::vector<std::pair<size_t, size_t>> chunks;
  auto cls = [](unsigned char c) { return detail::kAsciiClass[c]; };
  auto safe = [&](size_t b) {
    const auto x = uint8_t(text[b - 1]), y = uint8_t(text[b]);
    if (x >= 0x80 || y >= 0x80 || x == '\'') return false;
    const uint8_t cx = cls(x), cy = cls(y);
    if (pre_ == PreTokenization::llama3) {
      // Llama 3's pattern ends a piece after a letter or digit followed by another class (a run of
      // letters or of up to 3 digits stops there; no piece starts with a letter or digit prefix).
      if ((cx != uint8_t(CharClass::kLetter) && cx != uint8_t(CharClass::kNumber)) || cx == cy) return false;
    } else if (cx == uint8_t(CharClass::kSpace) || cy == uint8_t(CharClass::kSpace) || cx == cy) {
      return false;
    }
    if ((allow_special || !added_ids_.empty()) && special_max_len_ > 1) {
      const std::string_view near = text.substr(0, b + special_max_len_);
      for (size_t from = b >= special_max_len_ ? b - special_max_len_ + 1 : 0;;) {
        const auto [at, id] = find_special(near, from, allow_special);
        if (at >= b) break;
        if (at + token(id).size() > b) return false;
        from = at + 1;
      }
    }
    return true;
  };
  size_t start = 0;
  for (int k = 1; k < parts; ++k) {
    size_t b = std::max(start + 1, text.size() * size_t(k) / size_t(parts));
    const size_t limit = text.size() * size_t(k + 1) / size_t(parts);
    while (b < limit && b < text.size() && !safe(b)) ++b;
    if (b >= limit || b >= text.size()) continue;
    chunks.emplace_back(start, b);
    start = b;
  }
  chunks.emplace_back(start, text.size());
  return chunks;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, const EncodeOptions& opt) const {
  std::vector<int32_t> out;
  constexpr size_t kMinChunk = size_t(1) << 16;
  const int parts = int(std::min<size_t>(size_t(std::max(opt.threads, 1)), text.size() / kMinChunk + 1));
  if (parts <= 1) {
    EncodeCache cache;
    out.reserve(text.size() / 3);
    encode(text, opt, cache, &out);
    return out;
  }
  const auto chunks = split_for_threads(text, parts, opt.allow_special);
  std::vector<std::vector<int32_t>> results(chunks.size());
  std::vector<std::thread> pool;
  std::vector<std::exception_ptr> errors(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    pool.emplace_back([&, i] {
      try {
        EncodeCache cache;
        const auto [b, e] = chunks[i];
        results[i].reserve((e - b) / 4);
        encode(text.substr(b, e - b), opt, cache, &results[i]);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  }
  for (auto& t : pool) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  size_t total = 0;
  for (const auto& r : results) total += r.size();
  out.reserve(total);
  for (const auto& r : results) out.insert(out.end(), r.begin(), r.end());
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  size_t total = 0;
  const int32_t n = vocab_size();
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= n) {
      bad_input(fmt::format("decode: token {} (position {}) is outside the vocabulary 0..{}", id, i,
                            n - 1));
    }
    total += offsets_[id + 1] - offsets_[id];
  }
  out.resize(total);
  char* p = out.data();
  for (int32_t id : ids) {
    const uint32_t len = offsets_[id + 1] - offsets_[id];
    std::memcpy(p, bytes_.data() + offsets_[id], len);
    p += len;
  }
  return out;
}

}  // namespace loom::data

namespace loom::data {

std::string Tokenizer::fingerprint() const {
  uint64_t h = 1469598103934665603ull;  // FNV-1a, 64 bits
  auto mix = [&](const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  };
  auto mix_u32 = [&](uint32_t x) { mix(&x, sizeof x); };
  mix_u32(uint32_t(vocab_size()));
  for (int32_t id = 0; id < vocab_size(); ++id) {
    const std::string_view t = token(id);
    mix_u32(uint32_t(t.size()));
    mix(t.data(), t.size());
  }
  mix_u32(uint32_t(merge_pairs_.size()));
  for (const auto& [l, r] : merge_pairs_) {
    mix_u32(uint32_t(l));
    mix_u32(uint32_t(r));
  }
  for (int32_t id : special_ids_) mix_u32(uint32_t(id));
  // (Added tokens change the encoding; none, the fingerprints checkpoints already record.)
  if (!added_ids_.empty()) {
    mix_u32(0xadded);
    for (int32_t id : added_ids_) mix_u32(uint32_t(id));
  }
  // (GPT-2's pre-tokenisation with merges applied adds nothing, so its fingerprints stay those
  // that checkpoints already record.)
  if (pre_ != PreTokenization::gpt2 || ignore_merges_) {
    mix_u32(uint32_t(pre_));
    mix_u32(uint32_t(ignore_merges_));
  }
  return fmt::format("{:016x}", h);
}

}  // namespace loom::data

namespace loom::data {

namespace {

// The patterns of the Split pre-tokenisers loom implements, as tokenizer.json files write them.
constexpr std::string_view kLlama3Pattern =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
    "\\s+(?!\\S)|\\s+";
constexpr std::string_view kGpt2Pattern = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

}  // namespace

Tokenizer Tokenizer::from_tokenizer_json(const std::string& path) {
  using json = nlohmann::json;
  json j;
  try {
    j = json::parse(read_file(path));
  } catch (const json::exception& e) {
    bad_input(fmt::format("{}: malformed JSON: {}", path, e.what()));
  }
  auto field = [&](const std::string& f) { return fmt::format("{}: field '{}'", path, f); };
  // o[key] as def's type; def where o is not an object or has no key; another type is an error
  // naming the field `name`.
  auto opt = [&]<class T>(const json& o, const char* key, T def, const std::string& name) -> T {
    if (!o.is_object() || !o.contains(key)) return def;
    const json& v = o[key];
    if constexpr (std::is_same_v<T, bool>) {
      if (!v.is_boolean()) bad_input(field(name) + fmt::format(" must be true or false, not {}", v.dump().substr(0, 80)));
    } else {
      if (!v.is_string()) bad_input(field(name) + fmt::format(" must be a string, not {}", v.dump().substr(0, 80)));
    }
    return v.get<T>();
  };
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object()) bad_input(field("model") + " is missing");
  const json& m = j["model"];
  if (opt(m, "type", std::string(), "model.type") != "BPE")
    bad_input(field("model.type") + fmt::format(" is {}; loom reads byte-level BPE models (\"BPE\")",
                                                m.contains("type") ? m["type"].dump() : "missing"));
  if (opt(m, "byte_fallback", false, "model.byte_fallback"))
    bad_input(field("model.byte_fallback") + " is true (a SentencePiece-style model); loom reads byte-level BPE");
  // Fields that change how Hugging Face encodes, which loom's byte-level BPE does not do: taken
  // silently, the same text would encode otherwise.
  if (m.contains("dropout") && !m["dropout"].is_null() && !(m["dropout"].is_number() && m["dropout"].get<double>() == 0))
    bad_input(field("model.dropout") + fmt::format(" is {} (BPE dropout: random merges); loom encodes deterministically",
                                                   m["dropout"].dump().substr(0, 80)));
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (m.contains(k) && !m[k].is_null() && !(m[k].is_string() && m[k].get<std::string>().empty()))
      bad_input(field(std::string("model.") + k) +
                fmt::format(" is {}; loom's byte-level BPE has no such affix", m[k].dump().substr(0, 80)));
  if (j.contains("normalizer") && !j["normalizer"].is_null())
    bad_input(field("normalizer") + fmt::format(" is {}; loom's tokenizer applies none", j["normalizer"].dump()));
  // The pre-tokeniser: GPT-2's ByteLevel regex, or a Split on one of the two patterns then a
  // ByteLevel without its own regex.
  PreTokenization pre = PreTokenization::gpt2;
  const json pt = j.value("pre_tokenizer", json());
  auto byte_level = [&](const json& b, bool want_regex, const std::string& name) {
    return b.is_object() && opt(b, "type", std::string(), name + ".type") == "ByteLevel" &&
           !opt(b, "add_prefix_space", false, name + ".add_prefix_space") &&
           opt(b, "use_regex", true, name + ".use_regex") == want_regex;
  };
  const std::string seq0 = "pre_tokenizer.pretokenizers[0]", seq1 = "pre_tokenizer.pretokenizers[1]";
  bool ok = byte_level(pt, true, "pre_tokenizer");
  const bool sequence = pt.is_object() && opt(pt, "type", std::string(), "pre_tokenizer.type") == "Sequence" &&
                        pt.contains("pretokenizers") && pt["pretokenizers"].is_array() &&
                        pt["pretokenizers"].size() == 2;
  if (!ok && sequence && opt(pt["pretokenizers"][0], "type", std::string(), seq0 + ".type") == "Digits" &&
      opt(pt["pretokenizers"][0], "individual_digits", false, seq0 + ".individual_digits") &&
      byte_level(pt["pretokenizers"][1], true, seq1))
    ok = true, pre = PreTokenization::gpt2_digits;
  if (!ok && sequence) {
    const json& split = pt["pretokenizers"][0];
    const json none = json::object();
    const std::string pattern =
        opt(split.is_object() && split.contains("pattern") ? split["pattern"] : none, "Regex", std::string(),
            seq0 + ".pattern.Regex");
    if (opt(split, "type", std::string(), seq0 + ".type") == "Split" &&
        opt(split, "behavior", std::string(), seq0 + ".behavior") == "Isolated" &&
        !opt(split, "invert", false, seq0 + ".invert") && byte_level(pt["pretokenizers"][1], false, seq1)) {
      if (pattern == kLlama3Pattern) ok = true, pre = PreTokenization::llama3;
      if (pattern == kGpt2Pattern) ok = true;
    }
  }
  if (!ok)
    bad_input(field("pre_tokenizer") + fmt::format(" is {}; loom implements GPT-2's byte-level pattern and Llama 3's "
                                                   "(a Split on its regex, then ByteLevel)",
                                                   pt.dump().substr(0, 300)));
  // The tokens by id: the vocabulary's (GPT-2's byte-to-character alphabet) and the added tokens
  // (their text as it is).
  if (!m.contains("vocab") || !m["vocab"].is_object()) bad_input(field("model.vocab") + " is missing");
  std::vector<std::string> tokens;
  // The ids are 0 .. n - 1 for the n tokens the file lists (checked below): one beyond is an error
  // before the table grows to it.
  const int64_t listed = int64_t(m["vocab"].size()) +
                         (j.contains("added_tokens") && j["added_tokens"].is_array() ? int64_t(j["added_tokens"].size()) : 0);
  auto place = [&](int64_t id, std::string bytes, const std::string& what) {
    if (id < 0 || id >= listed)
      bad_input(fmt::format("{}: id {} is outside 0 .. {} (the file lists {} tokens)", what, id, listed - 1, listed));
    if (size_t(id) >= tokens.size()) tokens.resize(size_t(id) + 1);
    std::string& slot = tokens[size_t(id)];
    if (!slot.empty() && slot != bytes)
      bad_input(fmt::format("{}: id {} is also token \"{}\"", what, id, printable(slot)));
    slot = std::move(bytes);
  };
  for (const auto& [key, v] : m["vocab"].items()) {
    const std::string what = field("model.vocab") + fmt::format(" token \"{}\"", printable(key));
    if (!v.is_number_integer()) bad_input(what + ": the id must be an integer");
    std::string bytes;
    uint32_t bad = 0;
    if (!chars_to_bytes(key, &bytes, &bad) || bytes.empty())
      bad_input(what + fmt::format(": {} is not in the byte-level alphabet", describe_char(bad)));
    place(v.get<int64_t>(), std::move(bytes), what);
  }
  std::vector<int32_t> special, added;
  if (j.contains("added_tokens")) {
    if (!j["added_tokens"].is_array()) bad_input(field("added_tokens") + " must be an array");
    for (const json& a : j["added_tokens"]) {
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() || !a.contains("content") ||
          !a["content"].is_string() || a["content"].get<std::string>().empty())
        bad_input(field("added_tokens") + fmt::format(": entry {} needs an integer id and a non-empty content",
                                                      a.dump().substr(0, 200)));
      const int64_t id = a["id"].get<int64_t>();
      place(id, a["content"].get<std::string>(), field("added_tokens") + fmt::format(" id {}", id));
      // Hugging Face lets these take the white space beside a token, or match only a whole word.
      for (const char* flag : {"lstrip", "rstrip", "single_word"})
        if (opt(a, flag, false, std::string("added_tokens.") + flag))
          bad_input(field("added_tokens") + fmt::format(" token \"{}\" (id {}): {} is true; loom matches an added "
                                                        "token exactly as written",
                                                        printable(a["content"].get<std::string>()), id, flag));
      (opt(a, "special", false, "added_tokens.special") ? special : added).push_back(int32_t(id));
    }
  }
  for (size_t id = 0; id < tokens.size(); ++id)
    if (tokens[id].empty())
      bad_input(field("model.vocab") + fmt::format(": no token has id {} (of 0..{})", id, tokens.size() - 1));
  // Merges in rank order: "left right" strings or [left, right] pairs.
  if (!m.contains("merges") || !m["merges"].is_array()) bad_input(field("model.merges") + " is missing");
  FlatStringMap<int32_t> ids(tokens.size());
  for (size_t id = 0; id < tokens.size(); ++id) ids.insert(tokens[id], int32_t(id));
  std::vector<std::pair<int32_t, int32_t>> merges;
  merges.reserve(m["merges"].size());
  for (const json& e : m["merges"]) {
    std::string l, r;
    if (e.is_string()) {
      const std::string s = e.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos) bad_input(field("model.merges") + fmt::format(": \"{}\" is not two tokens", printable(s)));
      l = s.substr(0, sp), r = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      l = e[0].get<std::string>(), r = e[1].get<std::string>();
    } else {
      bad_input(field("model.merges") + fmt::format(": {} is not a merge", e.dump().substr(0, 200)));
    }
    int32_t lr[2];
    for (int k = 0; k < 2; ++k) {
      std::string bytes;
      uint32_t bad = 0;
      const std::string& side = k == 0 ? l : r;
      const int32_t* id = chars_to_bytes(side, &bytes, &bad) ? ids.find(bytes, hash_bytes(bytes)) : nullptr;
      if (!id)
        bad_input(field("model.merges") + fmt::format(" {}: \"{}\" is not a token of the vocabulary", merges.size() + 1,
                                                      printable(side)));
      lr[k] = *id;
    }
    merges.emplace_back(lr[0], lr[1]);
  }
  // The post-processor: ByteLevel (offsets only), TemplateProcessing (the special tokens its
  // single template puts around $A), or a Sequence of them.
  std::vector<int32_t> prefix, suffix;
  bool templated = false;
  const json pp = j.value("post_processor", json());
  auto processor = [&](const json& p, const std::string& name) {
    const std::string type = opt(p, "type", std::string(), name + ".type");
    if (type == "ByteLevel") return;
    if (type != "TemplateProcessing" && type != "RobertaProcessing" && type != "BertProcessing")
      bad_input(field(name) + fmt::format(" is {}; loom implements ByteLevel, TemplateProcessing, RobertaProcessing "
                                          "and BertProcessing",
                                          p.dump().substr(0, 200)));
    if (templated) bad_input(field(name) + ": a second template");
    templated = true;
    if (type != "TemplateProcessing") {
      // cls $A sep: each field a [token, id] pair.
      for (const char* key : {"cls", "sep"}) {
        const json& v = p.contains(key) ? p[key] : json();
        if (!v.is_array() || v.size() != 2 || !v[0].is_string() || !v[1].is_number_integer() ||
            v[1].get<int64_t>() < 0 || v[1].get<int64_t>() >= int64_t(tokens.size()) ||
            tokens[size_t(v[1].get<int64_t>())] != v[0].get<std::string>())
          bad_input(field(name + "." + key) + fmt::format(" is {}: a [token, id] pair of the vocabulary",
                                                          v.dump().substr(0, 120)));
        (std::string(key) == "cls" ? prefix : suffix).push_back(int32_t(v[1].get<int64_t>()));
      }
      return;
    }
    if (!p.contains("single") || !p["single"].is_array()) bad_input(field(name + ".single") + " must be an array");
    const json none = json::object();
    const json& named = p.contains("special_tokens") && p["special_tokens"].is_object() ? p["special_tokens"] : none;
    int seen_a = 0;
    for (const json& item : p["single"]) {
      if (item.is_object() && item.contains("Sequence")) {
        if (opt(item["Sequence"], "id", std::string(), name + ".single.Sequence.id") != "A")
          bad_input(field(name + ".single") + fmt::format(": {} is not the sequence $A", item.dump().substr(0, 120)));
        ++seen_a;
        continue;
      }
      if (!item.is_object() || !item.contains("SpecialToken"))
        bad_input(field(name + ".single") + fmt::format(": {} is neither a SpecialToken nor $A", item.dump().substr(0, 120)));
      const std::string key = opt(item["SpecialToken"], "id", std::string(), name + ".single.SpecialToken.id");
      if (!named.contains(key) || !named[key].is_object() || !named[key].contains("ids") || !named[key]["ids"].is_array())
        bad_input(field(name + ".special_tokens") + fmt::format(" has no ids for \"{}\"", printable(key)));
      for (const json& id : named[key]["ids"]) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= int64_t(tokens.size()))
          bad_input(field(name + ".special_tokens") + fmt::format(" \"{}\": id {} is not a token of the vocabulary",
                                                                  printable(key), id.dump()));
        (seen_a ? suffix : prefix).push_back(int32_t(id.get<int64_t>()));
      }
    }
    if (seen_a != 1) bad_input(field(name + ".single") + fmt::format(" holds $A {} times (once expected)", seen_a));
  };
  if (pp.is_object() && opt(pp, "type", std::string(), "post_processor.type") == "Sequence") {
    if (!pp.contains("processors") || !pp["processors"].is_array())
      bad_input(field("post_processor.processors") + " must be an array");
    for (size_t k = 0; k < pp["processors"].size(); ++k)
      processor(pp["processors"][k], fmt::format("post_processor.processors[{}]", k));
  } else if (!pp.is_null()) {
    processor(pp, "post_processor");
  }
  Tokenizer t;
  try {
    t = from_parts(std::move(tokens), merges, {});
  } catch (const Error& e) {
    bad_input(fmt::format("{}: {}", path, e.what()));
  }
  t.pre_ = pre;
  t.ignore_merges_ = opt(m, "ignore_merges", false, "model.ignore_merges");
  t.set_special(special, added);
  t.template_prefix_ = std::move(prefix);
  t.template_suffix_ = std::move(suffix);
  if (!pp.is_null()) t.post_processor_ = pp.dump();
  return t;
}

void Tokenizer::save_tokenizer_json(const std::string& path) const {
  using json = nlohmann::json;
  json vocab = json::object(), added = json::array(), merges = json::array();
  for (int32_t id = 0; id < vocab_size(); ++id) {
    // (An added token that is not special stays in the model's vocabulary too, as Hugging Face
    // keeps one: its BPE refuses merges into a token missing from it.)
    const bool always = std::find(added_ids_.begin(), added_ids_.end(), id) != added_ids_.end();
    if (is_special(id) || always)
      added.push_back({{"id", id}, {"content", std::string(token(id))}, {"single_word", false}, {"lstrip", false},
                       {"rstrip", false}, {"normalized", !is_special(id)}, {"special", is_special(id)}});
    if (is_special(id)) continue;
    vocab[bytes_to_chars(token(id))] = id;
  }
  for (const auto& [l, r] : merge_pairs_) merges.push_back(bytes_to_chars(token(l)) + " " + bytes_to_chars(token(r)));
  json byte_level = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}};
  json pre = {{"type", "Sequence"},
              {"pretokenizers",
               {{{"type", "Split"},
                 {"pattern", {{"Regex", std::string(pre_ == PreTokenization::llama3 ? kLlama3Pattern : kGpt2Pattern)}}},
                 {"behavior", "Isolated"},
                 {"invert", false}},
                byte_level}}};
  if (pre_ == PreTokenization::gpt2_digits) {
    byte_level["use_regex"] = true;
    pre = {{"type", "Sequence"},
           {"pretokenizers", {{{"type", "Digits"}, {"individual_digits", true}}, byte_level}}};
  }
  const json j = {{"version", "1.0"},
                  {"truncation", nullptr},
                  {"padding", nullptr},
                  {"added_tokens", added},
                  {"normalizer", nullptr},
                  {"pre_tokenizer", pre},
                  {"post_processor", post_processor_.empty() ? json(nullptr) : json::parse(post_processor_)},
                  {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
                  {"model",
                   {{"type", "BPE"},
                    {"dropout", nullptr},
                    {"unk_token", nullptr},
                    {"continuing_subword_prefix", nullptr},
                    {"end_of_word_suffix", nullptr},
                    {"fuse_unk", false},
                    {"byte_fallback", false},
                    {"ignore_merges", ignore_merges_},
                    {"vocab", vocab},
                    {"merges", merges}}}};
  write_file_atomically(path, j.dump());
}

}  // namespace loom::data

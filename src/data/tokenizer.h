// Byte-level BPE tokenizer (GPT-2's scheme): text is split by a pre-tokenisation pattern (GPT-2's,
// or Llama 3's), each piece's bytes become byte tokens, and ranked merges join them. Reads and
// writes GPT-2's encoder.json + vocab.bpe (the same files as Hugging Face's vocab.json +
// merges.txt) and Hugging Face's tokenizer.json of a byte-level BPE model, and encodes exactly as
// GPT-2 / Llama 3 do. decode(encode(x)) == x for any bytes, invalid UTF-8 included.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "data/bpe_hash.h"
#include "data/bpe_merge.h"

namespace loom::data {

struct EncodeOptions {
  // Recognise special tokens (e.g. <|endoftext|>) in the text and emit their ids; otherwise they
  // are encoded as ordinary text.
  bool allow_special = false;
  // Encode chunks of the text on this many threads (the ids do not depend on it).
  int threads = 1;
};

// Scratch buffers and a cache of encoded words for one thread; reuse it across many small texts.
class EncodeCache {
 public:
  explicit EncodeCache(size_t max_words = size_t(1) << 16) : max_words_(max_words) {}

 private:
  friend class Tokenizer;
  struct Span {
    uint32_t off, len;
  };
  FlatStringMap<Span> words_{1024};
  std::vector<int32_t> ids_;  // i32 [cached tokens] the token ids of cached words, back to back
  std::vector<int32_t> work_;  // i32 [piece bytes] one word during merging
  BpeScratch scratch_;
  size_t max_words_;
};

// How text is cut into pieces before BPE (data/bpe_pretokenize.h): GPT-2's pattern; Llama 3's;
// GPT-2's within runs of text between ASCII digits, each digit a piece of its own (SmolLM's
// Digits(individual_digits) then ByteLevel).
enum class PreTokenization : uint8_t { gpt2, llama3, gpt2_digits };

class Tokenizer {
 public:
  // Hugging Face's tokenizer.json of a byte-level BPE model: model.vocab and model.merges (either
  // form), model.ignore_merges (a piece that is a token is that token), added_tokens (the special
  // ones matched whole where allowed, the others always, as Hugging Face splits them out of any
  // text), a pre_tokenizer of GPT-2's pattern (ByteLevel with use_regex), of Llama 3's (a Split on
  // its regex, then ByteLevel without), or SmolLM's (Digits with individual_digits, then
  // ByteLevel with use_regex), and a post_processor (ByteLevel; TemplateProcessing, whose single
  // template's special tokens around $A are template_prefix/suffix; a Sequence of them). Anything
  // else (byte_fallback, a normalizer, other patterns, an added token's lstrip, rstrip or
  // single_word) is refused naming the file and the field.
  static Tokenizer from_tokenizer_json(const std::string& path);
  // GPT-2's encoder.json + vocab.bpe, or Hugging Face's vocab.json + merges.txt (same formats).
  static Tokenizer from_files(const std::string& vocab_json, const std::string& merges_txt);
  // A folder holding encoder.json + vocab.bpe, tokenizer.json, or vocab.json + merges.txt (in
  // that order of preference).
  static Tokenizer from_dir(const std::string& dir);
  // Whether dir holds files from_dir reads.
  static bool dir_has_tokenizer(const std::string& dir);
  // The files from_dir reads in dir (full paths; empty when it holds none).
  static std::vector<std::string> files_in_dir(const std::string& dir);
  // tokens: the bytes of every id (all 256 single bytes among them); merges: (left, right) ids in
  // rank order, each joining into the token with the concatenated bytes; special: ids of tokens
  // that are matched whole in text (when allowed) and never produced by merges.
  static Tokenizer from_parts(std::vector<std::string> tokens,
                              const std::vector<std::pair<int32_t, int32_t>>& merges,
                              const std::vector<int32_t>& special);

  // Writes dir/encoder.json and dir/vocab.bpe in GPT-2's format, or dir/tokenizer.json where the
  // pre-tokenisation is not GPT-2's or merges are ignored (what GPT-2's files cannot say).
  void save(const std::string& dir) const;

  std::vector<int32_t> encode(std::string_view text, const EncodeOptions& opt = {}) const;
  // The special tokens Hugging Face's post-processor puts before and after one text
  // (tokenizer.json's TemplateProcessing: Llama 3's <|begin_of_text|> before): what its
  // tokenizer(text) adds to encode(text). Empty for GPT-2's files.
  const std::vector<int32_t>& template_prefix() const { return template_prefix_; }
  const std::vector<int32_t>& template_suffix() const { return template_suffix_; }
  // The token that ends a document: the first of <|endoftext|>, <|end_of_text|> and </s> that is
  // a special token, or -1.
  int32_t end_of_text() const;
  // Appends the ids of text to *out on this thread (opt.threads is ignored).
  void encode(std::string_view text, const EncodeOptions& opt, EncodeCache& cache,
              std::vector<int32_t>* out) const;
  // The bytes of the tokens; a loom::Error names the first id out of range.
  std::string decode(std::span<const int32_t> ids) const;

  int32_t vocab_size() const { return int32_t(offsets_.size() - 1); }
  // 16 hex digits identifying the vocabulary: a hash of every token's bytes in id order, the
  // merges in rank order and the special ids. Checkpoints record it, so that a run or `loom
  // generate` with another tokenizer of the same size is refused rather than silently misread.
  std::string fingerprint() const;
  size_t num_merges() const { return merge_pairs_.size(); }
  // (left, right) ids of the merge with this rank.
  std::pair<int32_t, int32_t> merge(size_t rank) const { return merge_pairs_.at(rank); }
  std::string_view token(int32_t id) const;
  // The id of the token with exactly these bytes, or -1.
  int32_t find(std::string_view bytes) const;
  int32_t byte_token(uint8_t b) const { return byte_id_[b]; }
  const MergeTable& merge_table() const { return merges_; }
  const std::vector<int32_t>& special_ids() const { return special_ids_; }
  // tokenizer.json's added tokens that are not special: matched whole in any text.
  const std::vector<int32_t>& added_ids() const { return added_ids_; }
  bool is_special(int32_t id) const;
  PreTokenization pre_tokenization() const { return pre_; }
  bool ignore_merges() const { return ignore_merges_; }
  // Makes text a special token: an existing non-merge token is marked, otherwise a new id is
  // appended. Returns its id.
  int32_t add_special(std::string_view text);

 private:
  Tokenizer() = default;
  void build(const std::vector<std::pair<int32_t, int32_t>>& merges,
             const std::string& vocab_where, const std::string& merges_where);
  void build_special_index();
  // Makes exactly `ids` the special tokens and `added` the added ones (tokenizer.json's added
  // tokens, special or not).
  void set_special(const std::vector<int32_t>& ids, const std::vector<int32_t>& added = {});
  void compute_whole();
  void save_tokenizer_json(const std::string& path) const;
  void encode_ordinary(std::string_view text, EncodeCache& cache, std::vector<int32_t>* out) const;
  void encode_piece(std::string_view piece, EncodeCache& cache, std::vector<int32_t>* out) const;
  // Position and id of the first special token at or after from (only the added tokens that are
  // not special unless allow_special), or {npos, -1}.
  std::pair<size_t, int32_t> find_special(std::string_view text, size_t from, bool allow_special) const;
  std::vector<std::pair<size_t, size_t>> split_for_threads(std::string_view text, int parts,
                                                           bool allow_special) const;

  std::string bytes_;                // all token bytes, back to back
  std::vector<uint32_t> offsets_;    // [vocab + 1] token id -> its bytes in bytes_
  FlatStringMap<int32_t> vocab_;     // bytes -> id
  std::vector<uint8_t> whole_;       // [vocab] 1 when BPE of the token's bytes gives the token
  MergeTable merges_;
  std::vector<std::pair<int32_t, int32_t>> merge_pairs_;  // [merges] by rank
  int32_t byte_id_[256] = {};
  std::vector<int32_t> special_ids_;
  std::vector<uint8_t> special_flag_;                      // [vocab]
  std::vector<int32_t> added_ids_;
  std::vector<int32_t> template_prefix_, template_suffix_;
  std::string post_processor_;  // tokenizer.json's, as read (written back as it was)
  // The special and added tokens, longest first (bool: always matched, an added token)
  struct Matched {
    std::string text;
    int32_t id;
    bool always;
  };
  std::vector<Matched> special_by_length_;
  uint8_t special_first_byte_[256] = {};  // 1: a special token starts with it, 2: an added one
  size_t special_max_len_ = 0;
  PreTokenization pre_ = PreTokenization::gpt2;
  bool ignore_merges_ = false;  // a piece that is a token encodes to it (Llama 3)
};

// GPT-2's reversible map from bytes to printable characters used in encoder.json / vocab.bpe.
uint32_t gpt2_byte_to_char(uint8_t b);
// The 256 bytes in the order GPT-2 gives them ids 0-255.
const std::vector<uint8_t>& gpt2_byte_order();

}  // namespace loom::data

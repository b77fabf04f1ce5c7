// GPT-2's pre-tokeniser as a hand-written state machine over decoded code points. It splits text
// exactly as the regular expression
//
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//
// does (leftmost alternative first, greedy), with \s = White_Space. Pieces are byte ranges of the
// input that cover it exactly, so invalid UTF-8 (each bad byte a code point of class "other")
// survives untouched.
//
// Where regex engines differ: JavaScript's \s also matches U+FEFF and not U+0085; Python's `regex`
// and tiktoken follow White_Space, as we do.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "data/unicode.h"

namespace loom::data {

// The walk over a text that both pre-tokenisers share: Derived::piece_end(q) gives the end of the
// piece starting at q.
template <class Derived>
class PieceSplitter {
 public:
  explicit PieceSplitter(std::string_view text)
      : p_(reinterpret_cast<const uint8_t*>(text.data())), begin_(p_), end_(p_ + text.size()) {}

  // Stores the next piece in *piece and returns true; false at the end of the text.
  bool next(std::string_view* piece) {
    if (p_ >= end_) return false;
    const uint8_t* start = p_;
    p_ = static_cast<const Derived*>(this)->piece_end(p_);
    *piece = std::string_view(reinterpret_cast<const char*>(start), size_t(p_ - start));
    return true;
  }

  // Byte offset of the next piece in the text.
  size_t offset() const { return size_t(p_ - begin_); }

 protected:
  // Class and length of the code point at q (q < end_).
  CharClass at(const uint8_t* q, size_t* len) const {
    if (*q < 0x80) {
      *len = 1;
      return static_cast<CharClass>(detail::kAsciiClass[*q]);
    }
    uint32_t cp;
    *len = decode_utf8(q, end_, &cp);
    return char_class(cp);
  }

  // End of the run of code points of class c starting at q. ASCII bytes take a tight loop; a
  // byte >= 0x80 starts a multi-byte (or invalid) sequence that is decoded.
  const uint8_t* run_end(const uint8_t* q, CharClass c) const {
    const uint8_t want = uint8_t(c);
    for (;;) {
      while (q < end_ && *q < 0x80 && detail::kAsciiClass[*q] == want) ++q;
      if (q >= end_ || *q < 0x80) return q;
      uint32_t cp;
      const size_t len = decode_utf8(q, end_, &cp);
      if (char_class(cp) != c) return q;
      q += len;
    }
  }

  const uint8_t* p_;
  const uint8_t* begin_;
  const uint8_t* end_;
};

class PreTokenizer : public PieceSplitter<PreTokenizer> {
 public:
  using PieceSplitter::PieceSplitter;

 private:
  friend class PieceSplitter<PreTokenizer>;

  const uint8_t* piece_end(const uint8_t* q) const {
    const uint8_t b = *q;
    // 's 't 're 've 'm 'll 'd
    if (b == '\'' && q + 1 < end_) {
      const uint8_t c1 = q[1];
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return q + 2;
      if (q + 2 < end_) {
        const uint8_t c2 = q[2];
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
          return q + 3;
        }
      }
    }
    size_t len;
    const CharClass c = at(q, &len);
    // " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+" with the optional leading U+0020.
    if (b == ' ' && q + 1 < end_) {
      size_t len1;
      const CharClass c1 = at(q + 1, &len1);
      if (c1 != CharClass::kSpace) return run_end(q + 1 + len1, c1);
    }
    if (c != CharClass::kSpace) return run_end(q + len, c);
    // "\s+(?!\S)|\s+": a run of white space that is followed by more text leaves its last code
    // point to the next piece (where a final ' ' can lead a word), unless the run is one long.
    const uint8_t* last = q;
    const uint8_t* r = q + len;
    while (r < end_) {
      size_t l;
      if (at(r, &l) != CharClass::kSpace) break;
      last = r;
      r += l;
    }
    if (r == end_ || last == q) return r;
    return last;
  }
};

// Llama 3's pre-tokeniser (tiktoken's cl100k pattern, as Llama 3's tokenizer.json gives it), the
// same kind of state machine: it splits text exactly as
//
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
//
// does (leftmost alternative first, greedy with backtracking), with \s = White_Space and the
// contractions' case folded in ASCII.
class Llama3PreTokenizer : public PieceSplitter<Llama3PreTokenizer> {
 public:
  using PieceSplitter::PieceSplitter;

 private:
  friend class PieceSplitter<Llama3PreTokenizer>;
  static bool newline(uint8_t b) { return b == '\r' || b == '\n'; }
  static uint8_t lower(uint8_t b) { return b >= 'A' && b <= 'Z' ? uint8_t(b + 32) : b; }

  const uint8_t* piece_end(const uint8_t* q) const {
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if (*q == '\'' && q + 1 < end_) {
      const uint8_t c1 = lower(q[1]);
      if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return q + 2;
      if (q + 2 < end_) {
        const uint8_t c2 = lower(q[2]);
        if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) return q + 3;
      }
    }
    size_t len;
    const CharClass c = at(q, &len);
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (c == CharClass::kLetter) return run_end(q + len, CharClass::kLetter);
    if (c != CharClass::kNumber && !newline(*q) && q + len < end_) {
      size_t l1;
      if (at(q + len, &l1) == CharClass::kLetter) return run_end(q + len + l1, CharClass::kLetter);
    }
    // \p{N}{1,3}
    if (c == CharClass::kNumber) {
      const uint8_t* r = q + len;
      for (int k = 1; k < 3 && r < end_; ++k) {
        size_t l;
        if (at(r, &l) != CharClass::kNumber) break;
        r += l;
      }
      return r;
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    const uint8_t* s = q;
    if (*q == ' ' && q + 1 < end_) {
      size_t l1;
      if (at(q + 1, &l1) == CharClass::kOther) s = q + 1;
    }
    size_t ls;
    if (at(s, &ls) == CharClass::kOther) {
      const uint8_t* r = run_end(s + ls, CharClass::kOther);
      while (r < end_ && newline(*r)) ++r;
      return r;
    }
    // q is white space. \s*[\r\n]+: up to the run's last CR or LF.
    const uint8_t* last_nl = nullptr;
    const uint8_t* last = q;
    const uint8_t* r = q;
    while (r < end_) {
      size_t l;
      if (at(r, &l) != CharClass::kSpace) break;
      if (newline(*r)) last_nl = r;
      last = r;
      r += l;
    }
    if (last_nl) return last_nl + 1;
    // \s+(?!\S): a run followed by more text leaves its last code point to the next piece, unless
    // it is one long (then \s+ takes it).
    if (r == end_ || last == q) return r;
    return last;
  }
};

}  // namespace loom::data

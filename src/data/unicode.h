// Unicode pieces the byte-level BPE tokenizer needs: a strict UTF-8 decoder that never fails
// (each byte of an invalid sequence becomes its own pseudo code point) and the character classes
// of GPT-2's pre-tokenisation pattern (\p{L}, \p{N}, \s).
//
// The classes come from a table generated once from the Unicode Character Database
// (unicode_gen.py -> unicode_tables.inc) rather than from ICU at run time: token ids are training
// data, so they must not change with the ICU version of the machine that encodes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace loom::data {

enum class CharClass : uint8_t {
  kOther = 0,   // everything else, including unassigned code points and invalid UTF-8 bytes
  kLetter = 1,  // general category L (Lu Ll Lt Lm Lo)
  kNumber = 2,  // general category N (Nd Nl No)
  kSpace = 3,   // White_Space property
};

// Code points at or above this value stand for one invalid UTF-8 byte: kInvalidByteBase + byte.
inline constexpr uint32_t kInvalidByteBase = 0x110000;

namespace detail {
// Two-stage table: block[cp >> 8] selects a 256-entry row of classes.
struct ClassTable {
  const uint16_t* block;  // [0x1100]
  const uint8_t* rows;    // [num_rows * 256]
};
const ClassTable& class_table();
extern const uint8_t kAsciiClass[128];
}  // namespace detail

// The class of a code point; pseudo code points of invalid bytes are kOther.
inline CharClass char_class(uint32_t cp) {
  if (cp < 128) return static_cast<CharClass>(detail::kAsciiClass[cp]);
  if (cp >= 0x110000) return CharClass::kOther;
  const auto& t = detail::class_table();
  return static_cast<CharClass>(t.rows[(size_t(t.block[cp >> 8]) << 8) | (cp & 0xFF)]);
}

// Decodes one code point at p (p < end) and returns the number of bytes it used (1-4). Overlong
// forms, surrogates, values above U+10FFFF and truncated sequences are invalid: then only the
// first byte is consumed and *cp = kInvalidByteBase + that byte.
inline size_t decode_utf8(const uint8_t* p, const uint8_t* end, uint32_t* cp) {
  const uint8_t b0 = p[0];
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  const size_t left = size_t(end - p);
  auto cont = [](uint8_t b) { return (b & 0xC0) == 0x80; };
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    if (left >= 2 && cont(p[1])) {
      *cp = (uint32_t(b0 & 0x1F) << 6) | (p[1] & 0x3F);
      return 2;
    }
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    if (left >= 3 && cont(p[1]) && cont(p[2])) {
      const uint32_t c = (uint32_t(b0 & 0x0F) << 12) | (uint32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
      if (c >= 0x800 && (c < 0xD800 || c > 0xDFFF)) {
        *cp = c;
        return 3;
      }
    }
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    if (left >= 4 && cont(p[1]) && cont(p[2]) && cont(p[3])) {
      const uint32_t c = (uint32_t(b0 & 0x07) << 18) | (uint32_t(p[1] & 0x3F) << 12) |
                         (uint32_t(p[2] & 0x3F) << 6) | (p[3] & 0x3F);
      if (c >= 0x10000 && c <= 0x10FFFF) {
        *cp = c;
        return 4;
      }
    }
  }
  *cp = kInvalidByteBase + b0;
  return 1;
}

// Appends the UTF-8 encoding of a valid code point (< 0x110000, not a surrogate) to out.
void append_utf8(uint32_t cp, std::string& out);

// True when s is entirely valid UTF-8.
bool is_valid_utf8(std::string_view s);

}  // namespace loom::data

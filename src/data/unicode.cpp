#include "data/unicode.h"

#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

namespace loom::data {
namespace {

struct Range {
  uint32_t first, last;
  CharClass cls;
};

constexpr CharClass kLetter = CharClass::kLetter;
constexpr CharClass kNumber = CharClass::kNumber;
constexpr CharClass kSpace = CharClass::kSpace;

constexpr Range kRanges[] = {
#include "data/unicode_tables.inc"
};

struct Built {
  std::vector<uint16_t> block;  // [0x1100] row index per 256-code-point block
  std::vector<uint8_t> rows;    // [rows * 256] class per code point
  detail::ClassTable table;

  Built() {
    std::vector<uint8_t> flat(0x110000, uint8_t(CharClass::kOther));
    for (const Range& r : kRanges) {
      std::fill(flat.begin() + r.first, flat.begin() + r.last + 1, uint8_t(r.cls));
    }
    block.resize(0x1100);
    std::unordered_map<std::string_view, uint16_t> seen;  // row contents -> row index
    std::vector<std::string_view> keys;
    for (size_t b = 0; b < 0x1100; ++b) {
      const std::string_view row(reinterpret_cast<const char*>(flat.data() + (b << 8)), 256);
      auto [it, fresh] = seen.emplace(row, uint16_t(seen.size()));
      if (fresh) rows.insert(rows.end(), row.begin(), row.end());
      block[b] = it->second;
    }
    table = {block.data(), rows.data()};
  }
};

}  // namespace

namespace detail {

const ClassTable& class_table() {
  static const Built built;
  return built.table;
}

// \t \n \v \f \r and ' ' are White_Space; letters and digits; everything else is other.
const uint8_t kAsciiClass[128] = {
    0, 0, 0, 0, 0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 0, 0,  // 0x00
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  // 0x10
    3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,  // 0x20
    2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0,  // 0x30
    0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,  // 0x40
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0,  // 0x50
    0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,  // 0x60
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0,  // 0x70
};

}  // namespace detail

void append_utf8(uint32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(char(cp));
  } else if (cp < 0x800) {
    out.push_back(char(0xC0 | (cp >> 6)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(char(0xE0 | (cp >> 12)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (cp >> 18)));
    out.push_back(char(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(char(0x80 | (cp & 0x3F)));
  }
}

bool is_valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const auto* end = p + s.size();
  while (p < end) {
    uint32_t cp;
    p += decode_utf8(p, end, &cp);
    if (cp >= kInvalidByteBase) return false;
  }
  return true;
}

}  // namespace loom::data

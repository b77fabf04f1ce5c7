// Element types. bf16 is a storage format on the CPU: converted to f32 with shifts and back with
// round-to-nearest-even.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace loom {

enum class DType : uint8_t { f32, bf16, f16, i32, u16, u32 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::i32: return 4;
    case DType::u16: return 2;
    case DType::u32: return 4;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
    case DType::u16: return "u16";
    case DType::u32: return "u32";
  }
  return "?";
}

struct bf16 {
  uint16_t bits;
};

inline float bf16_to_f32(bf16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return bf16{uint16_t((u >> 16) | 0x40)};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16{uint16_t(u >> 16)};
}

// "" when this CPU computes bf16 dot products in hardware (AVX512-BF16, or AMX-BF16); otherwise
// what it lacks, for messages ("AVX512-BF16 or AMX-BF16 (this CPU has AVX-512 without them)").
std::string cpu_bf16_missing();

void bf16_to_f32(float* out, const bf16* in, int64_t n);
// dst[i] += src[i] over host arrays (the OpenMP team's threads for large n).
void add_f32(float* dst, const float* src, int64_t n);
void f32_to_bf16(bf16* out, const float* in, int64_t n);
// out [rows, cols] (contiguous) = in's rows of cols values, ld apart, rounded as above.
void f32_to_bf16_rows(bf16* out, const float* in, int64_t rows, int64_t cols, int64_t ld);

}  // namespace loom

#include "core/dtype.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace loom {

void bf16_to_f32(float* out, const bf16* in, int64_t n) {
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(in[i]);
}

std::string cpu_bf16_missing() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  const bool amx_bf16 = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 22 & 1u);  // CPUID.7.0:EDX[22]
  if (__builtin_cpu_supports("avx512bf16") || amx_bf16) return "";
  return __builtin_cpu_supports("avx512f") ? "AVX512-BF16 or AMX-BF16 (this CPU has AVX-512 without them)"
                                           : "AVX512-BF16 or AMX-BF16 (this CPU has no AVX-512)";
#else
  return "AVX512-BF16 or AMX-BF16 (x86-64 instructions; this is another architecture)";
#endif
}

namespace {
// The scalar f32_to_bf16 without branches (a select for NaN), so the loops below run on vectors:
// the bf16 matmuls round every operand on its way in.
inline uint16_t bf16_bits(const float* x) {
  uint32_t u;
  std::memcpy(&u, x, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet = (u >> 16) | 0x40u;
  return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}
}  // namespace

void add_f32(float* dst, const float* src, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

void f32_to_bf16(bf16* out, const float* in, int64_t n) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) o[i] = bf16_bits(in + i);
}

void f32_to_bf16_rows(bf16* out, const float* in, int64_t rows, int64_t cols, int64_t ld) {
  uint16_t* o = reinterpret_cast<uint16_t*>(out);
#pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = in + r * ld;
    uint16_t* y = o + r * cols;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) y[c] = bf16_bits(x + c);
  }
}

}  // namespace loom

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

void f32_to_bf16(bf16* out, const float* in, int64_t n) {
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(in[i]);
}

}  // namespace loom

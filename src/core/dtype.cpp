#include "core/dtype.h"

namespace loom {

void bf16_to_f32(float* out, const bf16* in, int64_t n) {
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_f32(in[i]);
}

void f32_to_bf16(bf16* out, const float* in, int64_t n) {
#pragma omp parallel for schedule(static) if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(in[i]);
}

}  // namespace loom

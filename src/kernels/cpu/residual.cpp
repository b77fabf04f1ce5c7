// Element-wise residual add and gradient accumulation: memory-bound, one pass, vectorised.
#include "kernels/cpu/residual.h"

#include "core/error.h"

namespace loom::cpu {

void residual_forward(float* out, const float* a, const float* b, int64_t n) {
  LOOM_CHECK(n >= 0, "residual_forward: negative size {}", n);
#pragma omp parallel for simd schedule(static) if (n >= (1 << 15))
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

}  // namespace loom::cpu

// Token + position embedding. Forward: one (b, t) row per iteration. Backward: the token-table
// gradient is split among threads by channel blocks; each block walks the tokens in (b, t) order,
// so rows hit by repeated tokens are summed in a fixed order with no atomics, and the result is
// the same for any thread count. The position gradient is split by position and sums the batch
// in order.
#include "kernels/cpu/embedding.h"

#include <omp.h>

#include <algorithm>

#include "core/error.h"

namespace loom::cpu {

namespace {

void check_tokens(const char* op, const int32_t* tokens, int64_t n, int64_t V) {
  for (int64_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || tokens[i] >= V) [[unlikely]]
      LOOM_FAIL("{}: token id {} at index {} is outside the vocabulary [0, {})", op, tokens[i], i, V);
}

}  // namespace

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B,
                       int64_t T, int64_t C, int64_t V, int64_t pos0) {
  LOOM_CHECK(B >= 0 && T >= 0 && C > 0 && V > 0 && pos0 >= 0,
             "embedding_forward: bad size B={} T={} C={} V={} pos0={}", B, T, C, V, pos0);
  check_tokens("embedding_forward", tokens, B * T, V);
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const float* te = wte + int64_t(tokens[bt]) * C;  // f32 [C]
    float* o = out + bt * C;                           // f32 [C]
    if (wpe) {
      const float* pe = wpe + (pos0 + bt % T) * C;  // f32 [C]
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] = te[c] + pe[c];
    } else {
      std::copy(te, te + C, o);
    }
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B,
                        int64_t T, int64_t C, int64_t V, int64_t pos0) {
  LOOM_CHECK(B >= 0 && T >= 0 && C > 0 && V > 0 && pos0 >= 0,
             "embedding_backward: bad size B={} T={} C={} V={} pos0={}", B, T, C, V, pos0);
  if (dwte) {
    check_tokens("embedding_backward", tokens, B * T, V);
    // Channel blocks of whole cache lines (16 floats); the block count only changes who does
    // which columns, never the order of any sum.
    const int64_t threads = std::max(1, omp_get_max_threads());
    const int64_t block = std::max<int64_t>(16, (C / threads + 15) / 16 * 16);
    const int64_t nblocks = (C + block - 1) / block;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t c0 = b * block, c1 = std::min(C, c0 + block);
      for (int64_t bt = 0; bt < B * T; ++bt) {
        float* g = dwte + int64_t(tokens[bt]) * C;
        const float* d = dout + bt * C;
#pragma omp simd
        for (int64_t c = c0; c < c1; ++c) g[c] += d[c];
      }
    }
  }
  if (dwpe) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float* g = dwpe + (pos0 + t) * C;
      for (int64_t b = 0; b < B; ++b) {
        const float* d = dout + (b * T + t) * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) g[c] += d[c];
      }
    }
  }
}

}  // namespace loom::cpu

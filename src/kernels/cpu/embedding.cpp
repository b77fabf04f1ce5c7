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
  embedding_forward(out, tokens, wte, wpe, B, T, C, V, EmbeddingRows{.pos0 = pos0});
}

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B,
                       int64_t T, int64_t C, int64_t V, const EmbeddingRows& r) {
  LOOM_CHECK(B >= 0 && T >= 0 && C > 0 && V > 0 && r.pos0 >= 0 && r.v0 >= 0 && r.Vs >= 0,
             "embedding_forward: bad size B={} T={} C={} V={} pos0={} rows [{}, +{})", B, T, C, V, r.pos0, r.v0, r.Vs);
  check_tokens("embedding_forward", tokens, B * T, V);
  const bool split = r.Vs > 0;
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t v = int64_t(tokens[bt]) - r.v0;
    const float* te = !split || (v >= 0 && v < r.Vs) ? wte + v * C : nullptr;  // f32 [C], null: a zero row
    float* o = out + bt * C;                                                     // f32 [C]
    if (wpe) {
      const int64_t t = bt % T;
      const float* pe = wpe + (r.positions ? int64_t(r.positions[t]) : r.pos0 + t) * C;  // f32 [C]
      if (te) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) o[c] = te[c] + pe[c];
      } else {
        std::copy(pe, pe + C, o);
      }
    } else if (te) {
      std::copy(te, te + C, o);
    } else {
      std::fill(o, o + C, 0.0f);
    }
  }
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B,
                        int64_t T, int64_t C, int64_t V, int64_t pos0) {
  embedding_backward(dwte, dwpe, dout, tokens, B, T, C, V, EmbeddingRows{.pos0 = pos0});
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B,
                        int64_t T, int64_t C, int64_t V, const EmbeddingRows& r) {
  LOOM_CHECK(B >= 0 && T >= 0 && C > 0 && V > 0 && r.pos0 >= 0 && r.v0 >= 0 && r.Vs >= 0,
             "embedding_backward: bad size B={} T={} C={} V={} pos0={} rows [{}, +{})", B, T, C, V, r.pos0, r.v0, r.Vs);
  const bool split = r.Vs > 0;
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
        const int64_t v = int64_t(tokens[bt]) - r.v0;
        if (split && (v < 0 || v >= r.Vs)) continue;
        float* g = dwte + v * C;
        const float* d = dout + bt * C;
#pragma omp simd
        for (int64_t c = c0; c < c1; ++c) g[c] += d[c];
      }
    }
  }
  if (dwpe) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; ++t) {
      float* g = dwpe + (r.positions ? int64_t(r.positions[t]) : r.pos0 + t) * C;
      for (int64_t b = 0; b < B; ++b) {
        const float* d = dout + (b * T + t) * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) g[c] += d[c];
      }
    }
  }
}

}  // namespace loom::cpu

#include "parallel/tensor/vocab_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "kernels/cpu/crossentropy.h"

namespace loom::parallel::tp {

int64_t vocab_shard_rows(int64_t Vp, int tp) { return (Vp + tp - 1) / tp; }

void vocab_embedding_forward(float* out, const int32_t* tokens, const float* wte_shard, int64_t N, int64_t C,
                             int64_t v0, int64_t Vs, int64_t V) {
  for (int64_t n = 0; n < N; ++n)
    if (tokens[n] < 0 || tokens[n] >= V)
      throw Error(fmt::format("vocab-parallel embedding: token {} at position {} is outside the vocabulary [0, {})",
                              tokens[n], n, V));
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int64_t v = tokens[n] - v0;
    float* o = out + n * C;
    if (v >= 0 && v < Vs)
      std::memcpy(o, wte_shard + v * C, size_t(C) * sizeof(float));
    else
      std::memset(o, 0, size_t(C) * sizeof(float));
  }
}

void vocab_embedding_backward(float* dwte_shard, const float* dout, const int32_t* tokens, int64_t N, int64_t C,
                              int64_t v0, int64_t Vs) {
  // Columns are independent: split them over threads, rows stay in order (deterministic).
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t c0 = 0; c0 < C; c0 += 16) {
      const int64_t c1 = std::min(C, c0 + 16);
      for (int64_t n = 0; n < N; ++n) {
        const int64_t v = tokens[n] - v0;
        if (v < 0 || v >= Vs) continue;
        float* d = dwte_shard + v * C;
        const float* g = dout + n * C;
        for (int64_t c = c0; c < c1; ++c) d[c] += g[c];
      }
    }
  }
}

void vocab_cross_entropy(comm::Comm* g, float* losses, float* dlogits, const float* logits, const int32_t* targets,
                         float* scratch, const VocabCEArgs& a) {
  const int64_t N = a.N, Vs = a.Vs;
  const int64_t nv = std::clamp<int64_t>(a.V - a.v0, 0, Vs);  // real columns of this shard
  const bool multi = g && g->size() > 1;
  for (int64_t n = 0; n < N; ++n)
    if (targets[n] < -1 || targets[n] >= a.V)
      throw Error(fmt::format("vocab-parallel cross-entropy: target {} at position {} is outside [-1, {})",
                              targets[n], n, a.V));
  float* mx = scratch;           // [N] row max over the whole vocabulary
  float* sums = scratch + N;     // [2N]: sum of exp(l - max), target logit
  // The single device's fused kernel's arithmetic (kernels/cpu/crossentropy.h), on each shard.
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) mx[n] = cpu::row_max(logits + n * Vs, nv);
  if (multi) g->all_reduce(mx, N, DType::f32, comm::ReduceOp::max);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* l = logits + n * Vs;
    sums[n] = float(cpu::row_sum_exp(l, nv, mx[n]));
    const int64_t t = int64_t(targets[n]) - a.v0;
    sums[N + n] = (targets[n] >= 0 && t >= 0 && t < nv) ? l[t] : 0.0f;
  }
  if (multi) g->all_reduce(sums, 2 * N, DType::f32);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const bool counted = targets[n] >= 0;
    const double lse = double(mx[n]) + std::log(double(sums[n]));
    losses[n] = counted ? float(lse - double(sums[N + n])) : 0.0f;
    if (!dlogits) continue;
    const float* l = logits + n * Vs;
    float* d = dlogits + n * Vs;
    if (!counted) {
      std::memset(d, 0, size_t(Vs) * sizeof(float));
      continue;
    }
    // d = dloss exp(l - max) / sum, the target column dloss (p_t - 1) from the loss as on one device.
    const int64_t t = int64_t(targets[n]) - a.v0;
    cpu::scaled_exp(d, l, nv, mx[n], float(double(a.dloss) / double(sums[n])));
    if (t >= 0 && t < nv) d[t] = float(double(a.dloss) * std::expm1(-double(losses[n])));
    for (int64_t v = nv; v < Vs; ++v) d[v] = 0.0f;
  }
}

}  // namespace loom::parallel::tp

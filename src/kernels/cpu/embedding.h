#pragma once
#include <cstdint>

namespace loom::cpu {

// out f32 [B, T, C] = wte[tokens[b, t]] + wpe[pos0 + t]; tokens i32 [B, T], wte f32 [V, C],
// wpe f32 [maxT, C] with pos0 + T <= maxT, or null for no position table. Token ids outside
// [0, V) throw loom::Error naming the index.
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B,
                       int64_t T, int64_t C, int64_t V, int64_t pos0 = 0);

// The general form: row t's position is positions[t] (i32 [T]; null: pos0 + t), and wte holds
// rows [v0, v0 + Vs) of the table (Vs = 0: all V rows): tokens outside them give a zero row before
// the position's (a vocabulary split under tensor parallelism).
struct EmbeddingRows {
  int64_t pos0 = 0;
  const int32_t* positions = nullptr;
  int64_t v0 = 0, Vs = 0;
};
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B,
                       int64_t T, int64_t C, int64_t V, const EmbeddingRows& r);

// dwte [V, C] += scatter of dout by token; dwpe [maxT, C] += sum over batch. Deterministic
// (independent of the thread count). Either gradient may be null.
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B,
                        int64_t T, int64_t C, int64_t V, int64_t pos0 = 0);
// The general form (dwte [Vs, C] for a split); positions must be distinct.
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B,
                        int64_t T, int64_t C, int64_t V, const EmbeddingRows& r);

}  // namespace loom::cpu

#pragma once
#include <cstdint>

namespace loom::cpu {

// out f32 [B, T, C] = wte[tokens[b, t]] + wpe[pos0 + t]; tokens i32 [B, T], wte f32 [V, C],
// wpe f32 [maxT, C] with pos0 + T <= maxT, or null for no position table. Token ids outside
// [0, V) throw loom::Error naming the index.
void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B,
                       int64_t T, int64_t C, int64_t V, int64_t pos0 = 0);

// dwte [V, C] += scatter of dout by token; dwpe [maxT, C] += sum over batch. Deterministic
// (independent of the thread count). Either gradient may be null.
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B,
                        int64_t T, int64_t C, int64_t V, int64_t pos0 = 0);

}  // namespace loom::cpu

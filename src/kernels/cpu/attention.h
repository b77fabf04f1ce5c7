// Causal multi-head self-attention computed in tiles with an online softmax: no T x T matrix is
// kept; only the per-row log-sum-exp is saved for backward, which recomputes scores per tile.
//
// Both calls use the calling thread's OpenMP team and give bitwise the same results for any team
// size. Each thread keeps a workspace between calls (grown to the largest call it has seen: about
// 2 Tkv HS floats in forward and 3 Tq HS in backward); backward with fewer than 32 (b, h) pairs also
// keeps partial dq sums, fewer than 64 Tq HS floats, on the calling thread.
#pragma once
#include <cstdint>

namespace loom::cpu {

// Row-strided views of Q, K, V and O: element (b, t, h, d) of X is at
// X[(b * T + t) * stride + h * HS + d] with T the sequence length of that tensor. Packed GPT-2
// qkv [B, T, 3C] is q = qkv, k = qkv + C, v = qkv + 2C with stride 3C.
struct AttnArgs {
  int64_t B = 0, NH = 0, HS = 0;
  int64_t Tq = 0, Tkv = 0;         // query and key/value lengths
  int64_t q_stride = 0, kv_stride = 0, o_stride = 0;
  int64_t q_pos0 = 0, kv_pos0 = 0;  // global positions of the first query / key (causal mask:
                                    // key position > query position is masked)
  bool causal = true;
  float scale = 0;                  // 0 means 1 / sqrt(HS)
};

// out (o_stride) = softmax(q k^T * scale, causal) v; lse f32 [B, NH, Tq] (natural log of the
// row's sum of exp of scaled scores; -inf for a row with no visible key).
void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const AttnArgs& a);

// Gradients dq (q_stride), dk, dv (kv_stride) from dout (o_stride), out and lse of the forward.
// dq, dk and dv are written (=) unless accumulate is set (+=, for ring attention and packed
// buffers that collect several contributions).
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                        const float* v, const float* out, const float* lse, const AttnArgs& a,
                        bool accumulate = false);

}  // namespace loom::cpu

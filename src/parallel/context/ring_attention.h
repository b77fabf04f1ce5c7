// Context parallelism: the sequence split over the cp ranks with causal load balancing, and ring
// attention over it (exact: partial results are merged with their log-sum-exp, forward and
// backward).
//
// Layout: a sequence of T positions is cut into 2 cp chunks of Tc = T / (2 cp); rank r holds
// chunks r and 2 cp - 1 - r (one early, one late), so under the causal mask every rank does the
// same attention work. A rank's local sequence is [chunk r ; chunk 2cp-1-r], Tl = T / cp rows per
// batch row.
//
// Ring: step j computes the local queries against the K/V of rank (r - j) mod cp, then passes
// that K/V block to rank r + 1. Chunk pairs entirely above the diagonal are skipped. Backward
// sends, beside each K/V block, the dK/dV accumulated for it so far; after cp steps it is back at
// its owner.
#pragma once
#include <cstdint>
#include <memory>

#include "comm/comm.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "kernels/cpu/attention.h"

namespace loom::parallel::cp {

// Global position of local row t (0 <= t < T / cp) on `rank` of a cp group of `size`.
int64_t global_position(int64_t t, int64_t T, int size, int rank);
// Checks that T splits into 2 * size equal chunks (size > 1), throwing loom::Error naming `where`.
void check_sequence(int64_t T, int size, const char* where);
// local i32 [B, T / size] = the rank's positions of full i32 [B, T].
void slice_sequence(const int32_t* full, int32_t* local, int64_t B, int64_t T, int size, int rank);

struct RingShape {
  int64_t B = 0;   // batch rows
  int64_t T = 0;   // global sequence length (divisible by 2 cp)
  int64_t NH = 0;  // heads held by this rank
  int64_t HS = 0;  // head size
  int64_t NKV = 0; // key/value heads held by this rank (grouped-query attention); 0: NH
  int64_t kv_heads() const { return NKV > 0 ? NKV : NH; }
  int64_t row() const { return (NH + 2 * kv_heads()) * HS; }  // a qkv row: q | k | v
};

class RingAttention {
 public:
  // Buffers (K/V blocks in flight, tag comm; partial outputs, tag workspace) come from pool. The
  // attention kernel's scratch is `attn` (kept by the caller, e.g. shared by a model's layers and
  // replicas) or, when null, this object's own (tag workspace, from pool); each pass reserves it
  // for its chunk-pair calls (workspace_bytes) before the first one.
  explicit RingAttention(MemoryPool& pool, cpu::AttnWorkspace* attn = nullptr);

  // qkv f32 [B, Tl, (NH + 2 NKV) HS] (q | k | v per row, this rank's heads); out f32 [B, Tl, NH HS];
  // lse f32 [B, 2, NH, Tc] (per local chunk). Collective over g.
  void forward(comm::Comm& g, float* out, float* lse, const float* qkv, const RingShape& s);
  // dqkv f32 [B, Tl, (NH + 2 NKV) HS] is written; dout, out, lse as the forward's.
  void backward(comm::Comm& g, float* dqkv, const float* dout, const float* qkv, const float* out,
                const float* lse, const RingShape& s);

  // Bytes of the buffers this object holds between calls (its own attention scratch included).
  int64_t buffer_bytes() const;
  // Frees the buffers and its own attention scratch (not a caller's).
  void release();

  // The attention scratch one pass needs over a cp group of P ranks on `threads` OpenMP threads:
  // the larger of a chunk pair's forward and backward call, so one reservation serves both passes.
  static int64_t workspace_bytes(const RingShape& s, int P, int threads);

 private:
  void ensure(const RingShape& s, int P, bool backward);
  MemoryPool& pool_;
  std::unique_ptr<cpu::AttnWorkspace> own_attn_;  // when no caller's workspace is given
  cpu::AttnWorkspace* attn_;
  Tensor kv_[2];      // f32 [B, Tl, 2 NKV HS]: the K/V block in hand and the one arriving (tag comm)
  Tensor dkv_[2];     // f32 [B, Tl, 2 NKV HS]: its accumulated gradient, in hand and arriving (tag comm)
  // One chunk pair's output over every batch row (one kernel call per pair: small chunks of many
  // rows would cost a call each), merged into out after the call (tag workspace).
  Tensor o_part_;     // f32 [B, Tc, NH HS]
  Tensor lse_part_;   // f32 [B, NH, Tc]
};

}  // namespace loom::parallel::cp

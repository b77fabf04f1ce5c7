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
//
// Written over core/backend.h, so the CPU and a GPU run the same ring: each chunk pair is one
// attention call of the backend's (a chunk of every batch row packed into a [B, Tc, .] block by a
// strided copy), merged into an f32 running output by the backend's attention_merge. Keys and
// values travel in the compute dtype and their gradients in f32, so a long ring adds its
// contributions without 16-bit rounding. The attention kernel must keep no probabilities (CPU:
// tiled; CUDA: flash or cuDNN, head sizes 64 and 128): the chunk pairs' would all have to be saved.
#pragma once
#include <cstdint>

#include "comm/comm.h"
#include "core/backend.h"
#include "core/tensor.h"

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
  // Runs on `be` (its compute dtype, its attention kernels and their scratch); its buffers (the
  // key/value blocks in flight, tag comm; packed chunks and partial results, tag workspace) come
  // from be's pool and are kept between calls.
  explicit RingAttention(Backend& be);

  // qkv [B, Tl, (NH + 2 NKV) HS] (q | k | v per row, this rank's heads) and out [B, Tl, NH HS] in
  // the compute dtype; lse f32 [2, B, NH, Tc] (per local chunk). Collective over g, a communicator
  // whose buffers are be's memory (Comm::device_buffers on a device).
  void forward(comm::Comm& g, void* out, float* lse, const void* qkv, const RingShape& s);
  // dqkv [B, Tl, (NH + 2 NKV) HS] is written; dout, out, lse as the forward's.
  void backward(comm::Comm& g, void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                const RingShape& s);

  // The attention call of one chunk pair: every batch row's Tc queries against Tc keys, causal
  // for a pair on the diagonal, else every key visible.
  static AttnShape chunk_shape(const RingShape& s, int P, bool causal);
  // Bytes of the buffers this object holds once it has run a forward and a backward over a cp
  // group of P ranks in `dtype` (the backend's attention scratch is the backend's), by tag: the
  // key/value blocks and their gradients (comm), the packed chunks and partial results (workspace).
  struct Buffers {
    int64_t comm = 0, workspace = 0;
    int64_t total() const { return comm + workspace; }
  };
  static Buffers buffer_bytes(const RingShape& s, int P, DType dtype);
  // Bytes held now.
  int64_t held_bytes() const;
  void release();

 private:
  void ensure(const RingShape& s, int P, bool backward);
  void pack_kv(const void* qkv, const RingShape& s, int P);
  Backend& be_;
  DType dt_;
  Tensor kv_[2];    // [2, B, Tc, 2 NKV HS] chunk-major, dtype: the key/value block in hand and the one arriving (tag comm)
  Tensor dkv_[2];   // f32 [2, B, Tc, 2 NKV HS]: its accumulated gradient, in hand and arriving (tag comm)
  Tensor q_;        // [B, Tc, NH HS] dtype: the query chunk
  Tensor a_, b_;    // [B, Tc, NH HS] dtype: forward: a_ the partial output; backward: dout and out chunks
  Tensor dq_;       // [B, Tc, NH HS] dtype: a pair's dq
  Tensor dkvp_;     // [B, Tc, 2 NKV HS] dtype: a pair's dk | dv
  Tensor lse_;      // f32 [B, NH, Tc]: forward: the partial output's log-sum-exps; backward: the chunk's
  Tensor acc_;      // f32 [B, Tl, NH HS]: the running output, or dq's sum (16-bit compute dtypes only)
};

}  // namespace loom::parallel::cp

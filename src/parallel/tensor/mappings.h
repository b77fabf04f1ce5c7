// Tensor- and sequence-parallel mappings (Megatron style): each collective used inside a layer is
// written as a pair, its forward and the gradient of that forward, so a layer's backward is the
// mirror image of its forward.
//
//   copy          forward: identity            backward: all-reduce       (into a column-parallel GEMM)
//   reduce        forward: all-reduce          backward: identity         (out of a row-parallel GEMM)
//   gather_rows   forward: all-gather rows     backward: reduce-scatter   (sequence parallel -> GEMM)
//   scatter_rows  forward: reduce-scatter rows backward: all-gather       (GEMM -> sequence parallel)
//
// Activations are row-major [N, C] f32 with N = B * T_local token rows. Under sequence
// parallelism rank r of the tp group holds rows sp_rows(N, tp, r) (comm::chunk_range: contiguous,
// the first N % tp ranks hold one row more), so no N is refused. Every rank of the group calls
// the same function with the same N and C. A null communicator or a group of one is the identity.
#pragma once
#include <cstdint>
#include <vector>

#include "comm/comm.h"

namespace loom::parallel::tp {

// Rows [begin, end) of the N token rows held by `rank` of a sequence-parallel group of `size`.
comm::Range sp_rows(int64_t N, int size, int rank);
// Element counts of every rank's rows (rows * C), for the *_v collectives.
std::vector<int64_t> sp_counts(int64_t N, int64_t C, int size);

inline int group_size(const comm::Comm* c) { return c ? c->size() : 1; }
inline int group_rank(const comm::Comm* c) { return c ? c->rank() : 0; }

// copy: forward is the identity (nothing to call); backward sums the input gradient
// x f32 [n] over the group, in place.
void copy_backward(comm::Comm* g, float* dx, int64_t n);

// reduce: forward sums partial results f32 [n] over the group in place; backward is the
// identity (every rank already holds the full output gradient).
void reduce_forward(comm::Comm* g, float* x, int64_t n);

// gather_rows: local f32 [rows(rank), C] -> full f32 [N, C]. local may alias full's own rows.
void gather_rows_forward(comm::Comm* g, const float* local, float* full, int64_t N, int64_t C);
// Its gradient: dfull f32 [N, C] (partial per rank) -> dlocal f32 [rows(rank), C], the sum over the
// group of the rank's own rows.
void gather_rows_backward(comm::Comm* g, const float* dfull, float* dlocal, int64_t N, int64_t C);

// scatter_rows: partial f32 [N, C] -> local f32 [rows(rank), C] = the sum over the group of the
// rank's own rows (a reduce-scatter).
void scatter_rows_forward(comm::Comm* g, const float* partial, float* local, int64_t N, int64_t C);
// Its gradient: dlocal f32 [rows(rank), C] -> dfull f32 [N, C] (an all-gather).
void scatter_rows_backward(comm::Comm* g, const float* dlocal, float* dfull, int64_t N, int64_t C);

}  // namespace loom::parallel::tp

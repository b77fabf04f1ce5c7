// Tensor- and sequence-parallel mappings (Megatron style): each collective used inside a layer is
// written as a pair, its forward and the gradient of that forward, so a layer's backward is the
// mirror image of its forward.
//
//   copy          forward: identity            backward: all-reduce       (into a column-parallel GEMM)
//   reduce        forward: all-reduce          backward: identity         (out of a row-parallel GEMM)
//   gather_rows   forward: all-gather rows     backward: reduce-scatter   (sequence parallel -> GEMM)
//   scatter_rows  forward: reduce-scatter rows backward: all-gather       (GEMM -> sequence parallel)
//
// Activations are row-major [N, C] of `dt` (f32 or bf16: what the group's reductions take) with
// N = B * T_local token rows, in memory the group's communicator takes (host memory, or a GPU's for
// a device communicator, comm::Comm::device_buffers). Under sequence
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
// dx [n] over the group, in place.
void copy_backward(comm::Comm* g, void* dx, int64_t n, DType dt);

// reduce: forward sums partial results [n] over the group in place; backward is the identity
// (every rank already holds the full output gradient).
void reduce_forward(comm::Comm* g, void* x, int64_t n, DType dt);

// gather_rows: local [rows(rank), C] -> full [N, C]. With a group of one, local must be full.
void gather_rows_forward(comm::Comm* g, const void* local, void* full, int64_t N, int64_t C, DType dt);
// Its gradient: dfull [N, C] (partial per rank) -> dlocal [rows(rank), C], the sum over the group
// of the rank's own rows. With a group of one, dlocal must be dfull.
void gather_rows_backward(comm::Comm* g, const void* dfull, void* dlocal, int64_t N, int64_t C, DType dt);

// scatter_rows: partial [N, C] -> local [rows(rank), C] = the sum over the group of the rank's own
// rows (a reduce-scatter).
void scatter_rows_forward(comm::Comm* g, const void* partial, void* local, int64_t N, int64_t C, DType dt);
// Its gradient: dlocal [rows(rank), C] -> dfull [N, C] (an all-gather).
void scatter_rows_backward(comm::Comm* g, const void* dlocal, void* dfull, int64_t N, int64_t C, DType dt);

}  // namespace loom::parallel::tp

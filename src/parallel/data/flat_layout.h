// The flat f32 layout of a list of parameters that data parallelism and ZeRO shard over a dp
// communicator of `world` ranks.
//
// The parameters, in the given order, are laid end to end, each at its padded allocation size
// (alloc_numel, vocabulary padding rows included) rounded up to kFlatAlign elements; the flat
// length N_pad is then rounded up to a multiple of kFlatAlign * world. Rank r owns the shard
// [r S, (r + 1) S), S = N_pad / world. The logical elements of parameter i are
// [offset, offset + numel); its padding rows and the alignment gaps are never touched by the
// optimizer (optim::FlatSegment covers the logical elements only).
#pragma once
#include <cstdint>
#include <vector>

#include "comm/comm.h"
#include "core/backend.h"
#include "core/tensor.h"
#include "model/param.h"
#include "optim/sharded_adamw.h"

namespace loom::parallel {

constexpr int64_t kFlatAlign = 16;  // elements (64 bytes)

struct FlatParam {
  model::Parameter* param = nullptr;
  int64_t offset = 0;  // flat element index of the parameter's first element
  int64_t alloc = 0;   // elements including padding rows
  int64_t numel = 0;   // logical elements (the first `numel` of the allocation)
  int chain = 0;       // owning chain block (0 where the caller has no chain)
};

struct FlatLayout {
  std::vector<FlatParam> params;
  int64_t n_pad = 0;  // N_pad
  int64_t shard = 0;  // S = N_pad / world
  int world = 1;

  // Lays out `params` in order; chains[i] (when given, one per parameter) is recorded as the
  // owning chain block. Throws on a null parameter or one whose storage does not match its spec,
  // naming it (a parameter without storage is laid out by its spec).
  static FlatLayout build(const std::vector<model::Parameter*>& params, int world,
                          const std::vector<int>& chains = {});
  // Elements of the flat range [begin, end) in each rank's shard (world entries).
  std::vector<int64_t> shard_counts(int64_t begin, int64_t end) const;
  // The logical elements of every parameter (weight decay by its spec), in flat order;
  // in_norm[i] (when given) marks whether parameter i counts in the gradient norm.
  std::vector<optim::FlatSegment> segments(const std::vector<bool>& in_norm = {}) const;
};

// Points a parameter's value (grad = false) or gradient tensors at `alloc` elements of the flat
// f32 buffer `buf` from element `offset`: value_full / grad_full see the allocation (padding
// rows included), value / grad its logical rows.
void point_at_flat(model::Parameter& p, const Tensor& buf, int64_t offset, int64_t alloc, bool grad);
// The same for the parameter's compute copy (compute_full / compute), in a flat buffer of the
// compute dtype.
void point_compute_at_flat(model::Parameter& p, const Tensor& buf, int64_t offset, int64_t alloc);
// A flat f32 buffer [n_pad] (tag `tag`, in be's memory) holding the parameters' current values
// (grad = false) or gradients, which then become views of it (point_at_flat); padding and gaps are
// zero.
Tensor flatten_parameters(const FlatLayout& lay, bool grad, MemTag tag, Backend& be);
// Drops a parameter's value or gradient tensors (where a shard or bucket holds them instead).
void detach_from_flat(model::Parameter& p, bool grad);

// Sum of one double per rank of `c`, added in rank order: the same bits on every rank (for
// combining gradient sums of squares over dp and then over model-parallel groups).
double sum_over_ranks(comm::Comm& c, double x);
// The least of one int per rank of `c` (below 2^24), on every rank.
int min_over_ranks(comm::Comm& c, int x);

}  // namespace loom::parallel

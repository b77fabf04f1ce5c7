// A small set of parameters for optimizer tests over data-parallel groups: five parameters (one
// with vocabulary-style padding rows, element counts not divisible by 2 or 3, parameters
// straddling shard boundaries, one left out of the norm as a replicated copy counted on another
// rank), per-rank gradients, an AdamW config that clips every step, and a relative distance.
#pragma once
#include "comm/comm.h"
#include "parallel/data/zero1.h"
#include <cstdint>
#include <memory>
#include <vector>

#include "core/memory.h"
#include "model/param.h"
#include "optim/adamw.h"

namespace loom::test {

struct ParamSpec {
  const char* name;
  Shape shape;
  int64_t alloc_rows;
  bool in_norm;
};

// 9 x 10 with 3 padding rows, a bias, a 10 x 23 weight, and two odd vectors; 370 logical
// elements. "extra" is left out of the norm.
const std::vector<ParamSpec>& param_set();
// lr 1e-2, weight decay 0.1, max_norm 0.5: the gradients' norm is about 5, so every step clips.
optim::AdamWConfig clipping_adamw();
// The set, allocated from pool and initialised N(0, 0.5) with seed 42.
std::vector<std::unique_ptr<model::Parameter>> make_param_set(MemoryPool& pool);
std::vector<model::Parameter*> raw(const std::vector<std::unique_ptr<model::Parameter>>& ps);
// Rank r's gradient of element j of parameter k at step s, uniform in [-1, 1) (seed picks the run).
float grad_at(uint64_t seed, int s, int r, size_t k, int64_t j);
// ||a - b|| / ||b|| over all elements of per-parameter lists.
double rel_dist(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b);

// The full moments (f32 [numel] each) of a parameter whose parts (MomentPart, one per rank of dp,
// in rank order) its ranks hold; collective over dp. A part that is the whole parameter on every
// rank (no sharding) is copied.
void gather_moments(const parallel::MomentPart& part, comm::Comm& dp, int64_t numel, float* exp_avg, float* exp_avg_sq);
// The inverse: this rank's part from the full moments (no communication).
void load_moments(const parallel::MomentPart& part, const float* exp_avg, const float* exp_avg_sq);

}  // namespace loom::test

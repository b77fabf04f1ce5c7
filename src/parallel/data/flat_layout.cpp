#include "parallel/data/flat_layout.h"

#include <algorithm>
#include <cstring>
#include <tuple>
#include <utility>

#include "core/error.h"

namespace loom::parallel {

namespace {
int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
}  // namespace

FlatLayout FlatLayout::build(const std::vector<model::Parameter*>& params, int world, const std::vector<int>& chains) {
  LOOM_CHECK(world >= 1, "flat layout: world size must be positive, got {}", world);
  LOOM_CHECK(chains.empty() || chains.size() == params.size(),
             "flat layout: {} chain indices for {} parameters", chains.size(), params.size());
  FlatLayout l;
  l.world = world;
  int64_t off = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    model::Parameter* p = params[i];
    LOOM_CHECK(p != nullptr, "flat layout: parameter {} is null", i);
    FlatParam f;
    f.param = p;
    f.offset = off;
    f.alloc = p->spec.alloc_numel();
    f.numel = p->spec.numel();
    f.chain = chains.empty() ? 0 : chains[i];
    // (A deferred parameter, model::ModelLayout::defer_parameters, has no storage yet.)
    LOOM_CHECK(!p->value_full.defined() || p->value_full.numel() == f.alloc,
               "flat layout: parameter '{}' holds {} elements, its spec {}", p->spec.name, p->value_full.numel(), f.alloc);
    l.params.push_back(f);
    off += round_up(f.alloc, kFlatAlign);
  }
  l.n_pad = round_up(std::max<int64_t>(off, 1), kFlatAlign * world);
  l.shard = l.n_pad / world;
  return l;
}

std::vector<int64_t> FlatLayout::shard_counts(int64_t begin, int64_t end) const {
  std::vector<int64_t> counts(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r)
    counts[size_t(r)] = std::max<int64_t>(0, std::min(end, (r + 1) * shard) - std::max(begin, r * shard));
  return counts;
}

std::vector<optim::FlatSegment> FlatLayout::segments(const std::vector<bool>& in_norm) const {
  LOOM_CHECK(in_norm.empty() || in_norm.size() == params.size(), "flat layout: {} norm flags for {} parameters",
             in_norm.size(), params.size());
  std::vector<optim::FlatSegment> segs;
  for (size_t i = 0; i < params.size(); ++i) {
    const FlatParam& f = params[i];
    const bool counted = in_norm.empty() || in_norm[i];
    if (!counted || !f.param->has_shared()) {
      segs.push_back({f.offset, f.offset + f.numel, f.param->spec.decay(), f.param->spec.name, counted,
                      f.param->spec.shape, f.param->spec.row_blocks});
      continue;
    }
    // Replicas of shared segments (replicated key/value heads) count on their owner only.
    int64_t at = 0;
    for (const auto& [b, e] : f.param->norm_ranges()) {
      if (b > at) segs.push_back({f.offset + at, f.offset + b, f.param->spec.decay(), f.param->spec.name, false, {}});
      segs.push_back({f.offset + b, f.offset + e, f.param->spec.decay(), f.param->spec.name, true, {}});
      at = e;
    }
    if (f.numel > at)
      segs.push_back({f.offset + at, f.offset + f.numel, f.param->spec.decay(), f.param->spec.name, false, {}});
  }
  return segs;
}

namespace {
// The allocation (padding rows included) and the logical rows of `alloc` elements of a flat
// buffer from `offset`, in p's shape.
std::pair<Tensor, Tensor> flat_views(const model::Parameter& p, const Tensor& buf, int64_t offset, int64_t alloc) {
  Shape full = p.spec.shape;
  if (!full.empty()) full[0] = std::max(p.spec.alloc_rows, full[0]);
  Tensor t = buf.slice0(offset, alloc).view(full);
  Tensor logical = full.empty() ? t : t.slice0(0, p.spec.shape[0]);
  return {t, logical};
}
}  // namespace

void point_at_flat(model::Parameter& p, const Tensor& buf, int64_t offset, int64_t alloc, bool grad) {
  auto [t, logical] = flat_views(p, buf, offset, alloc);
  if (grad) {
    p.grad_full = t;
    p.grad = logical;
  } else {
    p.value_full = t;
    p.value = logical;
  }
}

void point_compute_at_flat(model::Parameter& p, const Tensor& buf, int64_t offset, int64_t alloc) {
  std::tie(p.compute_full, p.compute) = flat_views(p, buf, offset, alloc);
}

Tensor flatten_parameters(const FlatLayout& lay, bool grad, MemTag tag, Backend& be) {
  Tensor buf = be.empty({lay.n_pad}, DType::f32, tag);
  be.fill_zero(buf.raw(), int64_t(buf.nbytes()));
  for (const FlatParam& f : lay.params) {
    const Tensor& src = grad ? f.param->grad_full : f.param->value_full;
    if (src.defined()) be.copy({.dst = buf.f32() + f.offset, .src = src.f32(), .n = f.alloc});
    point_at_flat(*f.param, buf, f.offset, f.alloc, grad);
  }
  return buf;
}

void detach_from_flat(model::Parameter& p, bool grad) {
  if (grad) p.grad_full = p.grad = Tensor();
  else p.value_full = p.value = Tensor();
}

int min_over_ranks(comm::Comm& c, int x) {
  LOOM_CHECK(x >= 0 && x < (1 << 24), "min_over_ranks: {} is not exact in f32", x);
  float neg = -float(x);  // the comm reduces floating point: as the maximum of its negation
  c.all_reduce(&neg, 1, DType::f32, comm::ReduceOp::max);
  return int(-neg);
}

double sum_over_ranks(comm::Comm& c, double x) {
  if (c.size() == 1) return x;
  std::vector<double> all(static_cast<size_t>(c.size()));
  c.all_gather(&x, all.data(), 2 * int64_t(c.size()), DType::u32);  // doubles as pairs of 32-bit words
  double s = 0;
  for (double v : all) s += v;
  return s;
}

}  // namespace loom::parallel

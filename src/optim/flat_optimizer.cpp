#include "optim/flat_optimizer.h"

#include <algorithm>

namespace loom::optim {

FlatOptimizer::FlatOptimizer(const std::vector<FlatSegment>& segments, int64_t begin, int64_t end,
                             const AdamWConfig& cfg, const char* who)
    : cfg_(cfg), begin_(begin), end_(end) {
  cfg_.validate();
  LOOM_CHECK(0 <= begin && begin <= end, "{}: bad range [{}, {})", who, begin, end);
  int64_t prev = 0;
  for (const FlatSegment& s : segments) {
    LOOM_CHECK(s.begin >= prev && s.end >= s.begin, "{}: segment '{}' [{}, {}) is out of order", who, s.name, s.begin,
               s.end);
    prev = s.end;
    const int64_t b = std::max(s.begin, begin), e = std::min(s.end, end);
    if (b < e) segments_.push_back({b - begin, e - begin, s.decay, s.name, s.in_norm, s.shape});
  }
}

double FlatOptimizer::grad_sum_squares(const float* grad_shard, Backend* be, double* others) const {
  std::vector<Backend::Range> ranges, rest;
  for (const FlatSegment& seg : segments_)
    (seg.in_norm ? ranges : rest).push_back({grad_shard + seg.begin, seg.end - seg.begin});
  const auto sum = [&](const std::vector<Backend::Range>& rs) {
    if (be) return be->sum_squares(rs);
    double s = 0;
    for (const Backend::Range& r : rs) s += cpu::sum_squares(r.x, r.n);
    return s;
  };
  if (others) *others = rest.empty() ? 0.0 : sum(rest);
  return sum(ranges);
}

}  // namespace loom::optim

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
    if (b < e) segments_.push_back({b - begin, e - begin, s.decay, s.name, s.in_norm, s.shape, s.row_blocks});
  }
}

double FlatOptimizer::grad_sum_squares(const float* grad_shard, Backend* be, double* others) const {
  // Every segment in one pass (one wait on a GPU); each group's sums added in flat order.
  std::vector<Backend::Range> ranges;
  for (const FlatSegment& seg : segments_)
    if (seg.in_norm || others) ranges.push_back({grad_shard + seg.begin, seg.end - seg.begin});
  std::vector<double> sums(ranges.size());
  if (be) be->sum_squares(ranges, sums.data());
  else
    for (size_t i = 0; i < ranges.size(); ++i) sums[i] = cpu::sum_squares(ranges[i].x, ranges[i].n);
  double in = 0, out = 0;
  size_t i = 0;
  for (const FlatSegment& seg : segments_) {
    if (seg.in_norm) in += sums[i++];
    else if (others) out += sums[i++];
  }
  if (others) *others = out;
  return in;
}

}  // namespace loom::optim

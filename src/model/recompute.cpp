#include "model/recompute.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/memory.h"

namespace loom::model {

std::string_view recompute_name(Recompute r) {
  switch (r) {
    case Recompute::none: return "none";
    case Recompute::full: return "full";
    case Recompute::every_k: return "every-k";
    case Recompute::sqrt: return "sqrt";
    case Recompute::optimal: return "optimal";
    case Recompute::selective: return "selective";
  }
  return "?";
}

std::optional<Recompute> recompute_parse(std::string_view name) {
  for (Recompute r : {Recompute::none, Recompute::full, Recompute::every_k, Recompute::sqrt, Recompute::optimal,
                      Recompute::selective})
    if (recompute_name(r) == name) return r;
  return std::nullopt;
}

Recompute recompute_from_name(std::string_view name, const std::string& field) {
  if (auto r = recompute_parse(name)) return *r;
  throw Error(
      fmt::format("{}: '{}' is not a recompute policy (none, full, every-k, sqrt, optimal or selective)", field, name));
}

int RecomputePlan::segment_of(int64_t l) const {
  for (size_t s = 0; s < segments.size(); ++s)
    if (l >= segments[s].first && l <= segments[s].second) return int(s);
  return -1;
}

bool RecomputePlan::recomputed(int64_t l) const { return segment_of(l) >= 0; }

int64_t RecomputePlan::recomputed_blocks() const {
  int64_t n = 0;
  for (const auto& [a, b] : segments) n += b - a + 1;
  return n;
}

std::string RecomputePlan::describe() const {
  if (selective) return "every block's attention output";
  if (segments.empty()) return "none";
  // Segments of one length, end to end: "h.0-h.11 in segments of 1 block".
  const int64_t k = segments[0].second - segments[0].first + 1;
  bool uniform = segments.size() > 1;
  for (size_t s = 1; s < segments.size() && uniform; ++s)
    uniform = segments[s].first == segments[s - 1].second + 1 && segments[s].second - segments[s].first + 1 == k;
  if (uniform)
    return fmt::format("h.{}-h.{} in segments of {} block{}", segments.front().first, segments.back().second, k,
                       k > 1 ? "s" : "");
  std::string out;
  for (const auto& [a, b] : segments)
    out += fmt::format("{}{}", out.empty() ? "" : ", ", a == b ? fmt::format("h.{}", a) : fmt::format("h.{}-h.{}", a, b));
  return out;
}

double plan_peak(const RecomputePlan& p, const ChainMemory& c) {
  double kept = c.fixed, worst = 0, before = 0;
  for (size_t l = 0; l < c.full.size(); ++l)
    if (!p.recomputed(int64_t(l))) kept += c.full[l];
  for (const auto& [a, b] : p.segments) {
    double seg = 0;
    for (int64_t l = a; l <= b; ++l) seg += c.full[size_t(l)];
    worst = std::max(worst, before + seg);
    before += c.out[size_t(b)];
  }
  return kept + worst;
}

double plan_cost(const RecomputePlan& p, const ChainMemory& c) {
  double cost = 0;
  for (const auto& [a, b] : p.segments)
    for (int64_t l = a; l <= b; ++l) cost += c.forward[size_t(l)];
  return cost;
}

namespace {

RecomputePlan segments_of(int64_t L, int64_t k) {
  RecomputePlan p;
  p.blocks = L;
  for (int64_t a = 0; a < L; a += k) p.segments.push_back({a, std::min(L, a + k) - 1});
  return p;
}

// optimal over L identical blocks (full F, output o bytes each) and K bytes for them: the fewest
// recomputed blocks R, then the segmentation of those R blocks of least peak. The recomputed
// segments take the first R blocks, in chain order.
RecomputePlan optimal_identical(int64_t L, double F, double o, double K, double fixed, double budget) {
  RecomputePlan p;
  p.blocks = L;
  if (double(L) * F <= K) return p;  // nothing to recompute
  const double inf = std::numeric_limits<double>::infinity();
  double least = inf;  // the least peak of the blocks over all plans
  // h[s][r]: the least max over segments s, s+1, ... of (s' o + their F) covering r blocks, the
  // segment s' preceded by s' others (each keeping its output); choice[s][r]: its first length.
  // It does not depend on how many blocks are recomputed in all, so one table serves every R.
  std::vector<std::vector<double>> h(size_t(L + 1), std::vector<double>(size_t(L + 1), inf));
  std::vector<std::vector<int64_t>> choice(size_t(L + 1), std::vector<int64_t>(size_t(L + 1), 0));
  for (int64_t s = L; s >= 0; --s) {
    h[size_t(s)][0] = 0;
    for (int64_t r = 1; r <= L - s; ++r)
      for (int64_t k = 1; k <= r; ++k) {
        const double v = std::max(double(s) * o + double(k) * F, h[size_t(s + 1)][size_t(r - k)]);
        if (v < h[size_t(s)][size_t(r)]) h[size_t(s)][size_t(r)] = v, choice[size_t(s)][size_t(r)] = k;
      }
  }
  for (int64_t R = 1; R <= L; ++R) {
    least = std::min(least, double(L - R) * F + h[0][size_t(R)]);
    if (double(L - R) * F + h[0][size_t(R)] > K) continue;
    int64_t at = 0;
    for (int64_t s = 0, r = R; r > 0; ++s) {
      const int64_t k = choice[size_t(s)][size_t(r)];
      p.segments.push_back({at, at + k - 1});
      at += k;
      r -= k;
    }
    return p;
  }
  throw Error(fmt::format("memory.activation_budget: {} per rank is less than any recompute plan needs: the "
                          "embedding and head take {}, and with the blocks at least {} in all",
                          format_bytes(int64_t(budget)), format_bytes(int64_t(fixed)),
                          format_bytes(int64_t(fixed + least))));
}

}  // namespace

RecomputePlan plan_recompute(Recompute policy, const ChainMemory& c, int64_t every, double budget) {
  const int64_t L = int64_t(c.full.size());
  LOOM_CHECK(c.out.size() == c.full.size() && c.forward.size() == c.full.size(),
             "recompute: the chain's sizes and costs disagree ({}, {}, {} blocks)", c.full.size(), c.out.size(),
             c.forward.size());
  switch (policy) {
    case Recompute::none:
    case Recompute::selective: {
      RecomputePlan p;
      p.blocks = L;
      p.selective = policy == Recompute::selective;
      return p;
    }
    case Recompute::full: return segments_of(L, 1);
    case Recompute::every_k:
      LOOM_CHECK(every >= 1, "memory.recompute_every: must be at least 1, got {}", every);
      return segments_of(L, every);
    case Recompute::sqrt: return segments_of(L, std::max<int64_t>(1, int64_t(std::ceil(std::sqrt(double(L))))));
    case Recompute::optimal: break;
  }
  LOOM_CHECK(budget > 0, "memory.activation_budget: the optimal recompute policy needs a budget (bytes per rank)");
  for (int64_t l = 1; l < L; ++l)
    LOOM_CHECK(c.full[size_t(l)] == c.full[0] && c.out[size_t(l)] == c.out[0] && c.forward[size_t(l)] == c.forward[0],
               "recompute: the optimal policy solves chains of identical transformer blocks (block {} differs)", l);
  if (L == 0) return plan_recompute(Recompute::none, c);
  return optimal_identical(L, c.full[0], c.out[0], budget - c.fixed, c.fixed, budget);
}

}  // namespace loom::model

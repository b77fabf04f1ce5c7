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
  double recomputed = 0;
  for (const auto& [a, b] : p.segments) {
    double seg = 0;
    for (int64_t l = a; l <= b; ++l) seg += c.full[size_t(l)];
    worst = std::max(worst, before + seg);
    before += c.out[size_t(b)];
    recomputed += seg;
  }
  if (c.split_backward) worst = recomputed;
  // (before: every segment's last output, which each other micro-batch in flight keeps.)
  return c.in_flight * kept + (c.in_flight - 1) * before + worst;
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

// The least max over segments j = 0..S-1 of (j o + k_j F), the k_j >= 1 blocks of segment j
// adding up to R (segment j is preceded by j others, each keeping its output), and the lengths.
double least_segment_peak(int64_t S, int64_t R, double F, double o, std::vector<int64_t>* lengths) {
  const double inf = std::numeric_limits<double>::infinity();
  // f[j][r]: the least max over segments j..S-1 covering r blocks; k[j][r]: segment j's length.
  std::vector<std::vector<double>> f(size_t(S + 1), std::vector<double>(size_t(R + 1), inf));
  std::vector<std::vector<int64_t>> k(size_t(S + 1), std::vector<int64_t>(size_t(R + 1), 0));
  f[size_t(S)][0] = 0;
  for (int64_t j = S - 1; j >= 0; --j)
    for (int64_t r = S - j; r <= R - j; ++r)  // room for the j segments before, each at least 1
      for (int64_t len = 1; len <= r - (S - 1 - j); ++len) {
        const double v = std::max(double(j) * o + double(len) * F, f[size_t(j + 1)][size_t(r - len)]);
        if (v < f[size_t(j)][size_t(r)]) f[size_t(j)][size_t(r)] = v, k[size_t(j)][size_t(r)] = len;
      }
  if (lengths) {
    lengths->clear();
    for (int64_t j = 0, r = R; j < S; r -= lengths->back(), ++j) lengths->push_back(k[size_t(j)][size_t(r)]);
  }
  return f[0][size_t(R)];
}

// optimal over L identical blocks (full F, output o bytes each), A = fixed bytes and n micro-batches
// in flight: the fewest recomputed blocks R, then the least peak over the number of segments S and
// their lengths, the peak being (plan_peak) n (A + (L - R) F) + (n - 1) S o + the least max over the
// segments (least_segment_peak; R F under a split backward). Where the blocks sit does not matter (they are identical): the
// recomputed segments take the first R blocks, in chain order.
RecomputePlan optimal_identical(int64_t L, double F, double o, double fixed, double n, bool split, double budget) {
  RecomputePlan p;
  p.blocks = L;
  if (n * (fixed + double(L) * F) <= budget) return p;  // nothing to recompute
  double least = std::numeric_limits<double>::infinity();  // the least peak of any plan
  for (int64_t R = 1; R <= L; ++R) {
    double best = std::numeric_limits<double>::infinity();
    int64_t best_s = 0;
    for (int64_t S = 1; S <= R; ++S) {
      const double peak = n * (fixed + double(L - R) * F) + (n - 1) * double(S) * o +
                          (split ? double(R) * F : least_segment_peak(S, R, F, o, nullptr));
      if (peak < best) best = peak, best_s = S;
    }
    least = std::min(least, best);
    if (best > budget) continue;
    std::vector<int64_t> lengths;
    least_segment_peak(best_s, R, F, o, &lengths);
    int64_t at = 0;
    for (int64_t len : lengths) p.segments.push_back({at, at + len - 1}), at += len;
    return p;
  }
  throw Error(fmt::format("memory.activation_budget: {} per rank is less than any recompute plan needs: the "
                          "embedding and head take {}{}, and with the blocks at least {} in all",
                          format_bytes(int64_t(budget)), format_bytes(int64_t(n * fixed)),
                          n > 1 ? fmt::format(" for the {:.0f} micro-batches in flight", n) : "",
                          format_bytes(int64_t(least))));
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
  LOOM_CHECK(c.in_flight >= 1, "recompute: {} micro-batches in flight", c.in_flight);
  return optimal_identical(L, c.full[0], c.out[0], c.fixed, c.in_flight, c.split_backward, budget);
}

}  // namespace loom::model

#include "model/recompute.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

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

namespace {

// A plan's terms: A + the kept blocks' F_l; every segment's last output; the backward's largest
// need beyond the kept blocks (a segment with the outputs before it, or under a split backward
// every recomputed block).
struct PlanTerms {
  double kept = 0, outs = 0, worst = 0;
};

PlanTerms plan_terms(const RecomputePlan& p, const ChainMemory& c) {
  PlanTerms t;
  t.kept = c.fixed;
  for (size_t l = 0; l < c.full.size(); ++l)
    if (!p.recomputed(int64_t(l))) t.kept += c.full[l];
  double recomputed = 0;
  for (const auto& [a, b] : p.segments) {
    double seg = 0;
    for (int64_t l = a; l <= b; ++l) seg += c.full[size_t(l)];
    t.worst = std::max(t.worst, t.outs + seg);
    t.outs += c.out[size_t(b)];
    recomputed += seg;
  }
  if (c.split_backward) t.worst = recomputed;
  return t;
}

}  // namespace

std::vector<std::pair<double, double>> split_peaks(const ChainMemory& c) {
  if (!c.split_peaks.empty()) return c.split_peaks;
  return {{c.in_flight, 1.0}};
}

double plan_peak(const RecomputePlan& p, const ChainMemory& c) {
  const PlanTerms t = plan_terms(p, c);
  if (!c.split_backward) return c.in_flight * t.kept + (c.in_flight - 1) * t.outs + t.worst;
  double peak = 0;
  for (const auto& [n, q] : split_peaks(c)) peak = std::max(peak, n * t.kept + (n - q) * t.outs + q * t.worst);
  return peak;
}

double plan_kept(const RecomputePlan& p, const ChainMemory& c) {
  const PlanTerms t = plan_terms(p, c);
  return t.kept + t.outs;
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

// Segmentations of r identical blocks (F bytes each, output o) into recomputed segments j, j + 1,
// ... (segment j is preceded by j others, each keeping its output): f[j][r] is the least max over
// them of (j o + k_j F), k_j >= 1 the blocks of segment j, with exactly S segments in all, or any
// number (S < 0); k[j][r] is segment j's length in it. S segments: O(S L^2); any: O(L^3).
struct Segmentations {
  std::vector<std::vector<double>> f;
  std::vector<std::vector<int64_t>> k;
  Segmentations(int64_t S, int64_t L, double F, double o) {
    const double inf = std::numeric_limits<double>::infinity();
    const int64_t J = S >= 0 ? S : L;  // rows 0..J
    f.assign(size_t(J + 1), std::vector<double>(size_t(L + 1), inf));
    k.assign(size_t(J + 1), std::vector<int64_t>(size_t(L + 1), 0));
    for (int64_t j = 0; j <= J; ++j)
      if (S < 0 || j == S) f[size_t(j)][0] = 0;
    for (int64_t j = J - 1; j >= 0; --j)
      for (int64_t r = 1; r <= L; ++r)
        for (int64_t len = 1; len <= r; ++len) {
          const double v = std::max(double(j) * o + double(len) * F, f[size_t(j + 1)][size_t(r - len)]);
          if (v < f[size_t(j)][size_t(r)]) f[size_t(j)][size_t(r)] = v, k[size_t(j)][size_t(r)] = len;
        }
  }
  double least(int64_t R) const { return f[0][size_t(R)]; }
  std::vector<int64_t> lengths(int64_t R) const {
    std::vector<int64_t> out;
    for (int64_t j = 0, r = R; r > 0; ++j) out.push_back(k[size_t(j)][size_t(r)]), r -= out.back();
    return out;
  }
};

// optimal over L identical blocks (full F, output o bytes each), A = fixed bytes and n micro-batches
// in flight: the fewest recomputed blocks R, then the least peak over the number of segments S and
// their lengths, the peak being (plan_peak) n (A + (L - R) F) + (n - 1) S o + the least max over
// the segments (Segmentations), or under a split backward (where one segment is best) the largest
// over its (n, q) pairs of n (A + (L - R) F) + (n - q) o + q R F. One
// micro-batch: the number of segments is free (O(L^3)); more: each S in turn (O(L^4), L a stage's
// blocks). Where the blocks sit does not matter (they are identical): the recomputed segments take
// the first R blocks, in chain order.
RecomputePlan optimal_identical(int64_t L, double F, double o, double fixed, double n, bool split,
                                const std::vector<std::pair<double, double>>& peaks, double budget) {
  RecomputePlan p;
  p.blocks = L;
  if (n * (fixed + double(L) * F) <= budget) return p;  // nothing to recompute
  const double inf = std::numeric_limits<double>::infinity();
  std::unique_ptr<Segmentations> any;  // one micro-batch: any number of segments
  std::vector<Segmentations> by_s;      // [S - 1]: more micro-batches (not under a split backward)
  if (!split && n == 1) any = std::make_unique<Segmentations>(-1, L, F, o);
  if (!split && n > 1)
    for (int64_t S = 1; S <= L; ++S) by_s.emplace_back(S, L, F, o);
  double least = inf;  // the least peak of any plan
  for (int64_t R = 1; R <= L; ++R) {
    const double kept = n * (fixed + double(L - R) * F);
    double best = inf;
    std::vector<int64_t> lengths;
    if (split) {
      best = 0, lengths = {R};
      for (const auto& [nk, q] : peaks)
        best = std::max(best, nk * (fixed + double(L - R) * F) + (nk - q) * o + q * double(R) * F);
    } else if (any) {
      best = kept + any->least(R), lengths = any->lengths(R);
    } else {
      int64_t best_s = 0;
      for (int64_t S = 1; S <= R; ++S) {
        const double peak = kept + (n - 1) * double(S) * o + by_s[size_t(S - 1)].least(R);
        if (peak < best) best = peak, best_s = S;
      }
      lengths = by_s[size_t(best_s - 1)].lengths(R);
    }
    least = std::min(least, best);
    if (best > budget) continue;
    int64_t at = 0;
    for (int64_t len : lengths) p.segments.push_back({at, at + len - 1}), at += len;
    return p;
  }
  throw Error(fmt::format("memory.activation_budget: {} per rank is less than any recompute plan needs: what stays "
                          "outside the transformer blocks (embedding, head, a stage's received input) takes {}{}, and "
                          "with the blocks at least {} in all",
                          format_bytes(int64_t(budget)), format_bytes(int64_t(n * fixed)),
                          n > 1 ? fmt::format(" for the {:.0f} micro-batches in flight", n) : "",
                          format_bytes(int64_t(least))));
}

}  // namespace

std::vector<RecomputePlan> recompute_candidates(const ChainMemory& c) {
  const int64_t L = int64_t(c.full.size());
  for (int64_t l = 1; l < L; ++l)
    LOOM_CHECK(c.full[size_t(l)] == c.full[0] && c.out[size_t(l)] == c.out[0] && c.forward[size_t(l)] == c.forward[0],
               "recompute: the candidates are those of chains of identical transformer blocks (block {} differs)", l);
  std::vector<RecomputePlan> out(1);
  out[0].blocks = L;
  for (int64_t S = 1; S <= L; ++S) {
    const Segmentations seg(S, L, c.full.empty() ? 0.0 : c.full[0], c.out.empty() ? 0.0 : c.out[0]);
    for (int64_t R = S; R <= L; ++R) {
      RecomputePlan p;
      p.blocks = L;
      int64_t at = 0;
      for (int64_t len : seg.lengths(R)) p.segments.push_back({at, at + len - 1}), at += len;
      out.push_back(std::move(p));
    }
  }
  std::stable_sort(out.begin() + 1, out.end(), [](const RecomputePlan& a, const RecomputePlan& b) {
    return std::pair(a.recomputed_blocks(), a.segments.size()) < std::pair(b.recomputed_blocks(), b.segments.size());
  });
  return out;
}

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
  return optimal_identical(L, c.full[0], c.out[0], c.fixed, c.in_flight, c.split_backward, split_peaks(c), budget);
}

}  // namespace loom::model

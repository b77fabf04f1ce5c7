#include "parallel/pipeline/joint_plan.h"

#include "core/error.h"

namespace loom::parallel::pipeline {
namespace {

// Whether a (cost, peak) is a better choice than b under `budget` (the order in joint_plan.h).
bool better(double a_cost, double a_peak, double b_cost, double b_peak, double budget) {
  const bool a_fits = a_peak <= budget, b_fits = b_peak <= budget;
  if (a_fits != b_fits) return a_fits;
  if (a_fits) return a_cost < b_cost || (a_cost == b_cost && a_peak < b_peak);
  return a_peak < b_peak || (a_peak == b_peak && a_cost < b_cost);
}

}  // namespace

JointChoice choose_joint(const std::vector<std::vector<double>>& costs,
                         const std::function<double(const std::vector<size_t>&)>& peak, double budget,
                         double exhaustive_limit) {
  LOOM_CHECK(!costs.empty(), "choose_joint: no chunks");
  double combos = 1;
  for (const auto& c : costs) {
    LOOM_CHECK(!c.empty(), "choose_joint: a chunk without options");
    combos *= double(c.size());
  }
  const auto cost_of = [&](const std::vector<size_t>& pick) {
    double s = 0;
    for (size_t k = 0; k < costs.size(); ++k) s += costs[k][pick[k]];
    return s;
  };
  JointChoice best{std::vector<size_t>(costs.size(), 0), 0, 0, true};
  best.cost = cost_of(best.pick);
  best.peak = peak(best.pick);
  if (combos <= exhaustive_limit) {
    std::vector<size_t> pick = best.pick;
    while (true) {
      size_t k = 0;
      while (k < pick.size() && ++pick[k] == costs[k].size()) pick[k++] = 0;
      if (k == pick.size()) break;
      const double c = cost_of(pick), p = peak(pick);
      if (better(c, p, best.cost, best.peak, budget)) best = {pick, c, p};
    }
    return best;
  }
  // Changes of one chunk's option, then of two chunks' at once (one recomputing more so that the
  // other may recompute less), until neither makes the choice better; from each chunk's first
  // option and again from its last (where a peak that is the largest of the chunks' has a plateau
  // around the first options, no single or paired change lowers it), keeping the better end.
  const size_t n = costs.size();
  const auto descend = [&](JointChoice at) {
    const auto consider = [&](const std::vector<size_t>& pick) {
      const double c = cost_of(pick), p = peak(pick);
      if (!better(c, p, at.cost, at.peak, budget)) return false;
      at = {pick, c, p, false};
      return true;
    };
    for (bool moved = true; moved;) {
      moved = false;
      for (size_t k = 0; k < n; ++k)
        for (size_t i = 0; i < costs[k].size(); ++i) {
          if (i == at.pick[k]) continue;
          std::vector<size_t> pick = at.pick;
          pick[k] = i;
          moved |= consider(pick);
        }
      if (moved) continue;
      for (size_t k = 0; k < n && !moved; ++k)
        for (size_t l = k + 1; l < n && !moved; ++l)
          for (size_t i = 0; i < costs[k].size() && !moved; ++i)
            for (size_t j = 0; j < costs[l].size() && !moved; ++j) {
              if (i == at.pick[k] || j == at.pick[l]) continue;
              std::vector<size_t> pick = at.pick;
              pick[k] = i;
              pick[l] = j;
              moved = consider(pick);
            }
    }
    return at;
  };
  best.exhaustive = false;
  JointChoice from_last{std::vector<size_t>(n), 0, 0, false};
  for (size_t k = 0; k < n; ++k) from_last.pick[k] = costs[k].size() - 1;
  from_last.cost = cost_of(from_last.pick);
  from_last.peak = peak(from_last.pick);
  const JointChoice a = descend(best), b = descend(from_last);
  best = better(b.cost, b.peak, a.cost, a.peak, budget) ? b : a;
  return best;
}

}  // namespace loom::parallel::pipeline

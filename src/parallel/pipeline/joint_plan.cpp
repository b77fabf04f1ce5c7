#include "parallel/pipeline/joint_plan.h"

#include <fmt/format.h>

#include "core/error.h"
#include "core/memory.h"

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

JointRecompute plan_joint_recompute(const std::vector<model::ChainMemory>& mems,
                                    const std::vector<std::optional<model::RecomputePlan>>& own,
                                    const std::vector<Instr>& list, double budget, int rank, const std::string& why) {
  LOOM_CHECK(!mems.empty() && own.size() == mems.size(), "plan_joint_recompute: {} chunks, {} plans", mems.size(),
             own.size());
  struct Option {
    model::RecomputePlan plan;
    double kept = 0, transient = 0, cost = 0;
  };
  const size_t chunks = mems.size();
  std::vector<std::vector<Option>> options(chunks);
  for (size_t k = 0; k < chunks; ++k) {
    model::ChainMemory one = mems[k];
    one.in_flight = 1;
    const auto add = [&](const model::RecomputePlan& plan) {
      for (const Option& o : options[k])
        if (o.plan.segments == plan.segments) return;
      options[k].push_back({plan, model::plan_kept(plan, mems[k]), model::plan_peak(plan, one),
                            model::plan_cost(plan, mems[k])});
    };
    if (own[k]) add(*own[k]);
    if (chunks > 1 && !mems[k].split_backward) {
      for (const model::RecomputePlan& plan : model::recompute_candidates(mems[k]))
        if (model::plan_peak(plan, one) <= budget) add(plan);
      std::vector<Option> kept;  // (without the dominated)
      for (const Option& o : options[k]) {
        bool beaten = false;
        for (const Option& b : options[k])
          beaten |= &b != &o && b.kept <= o.kept && b.transient <= o.transient && b.cost <= o.cost &&
                    (b.kept < o.kept || b.transient < o.transient || b.cost < o.cost);
        if (!beaten) kept.push_back(o);
      }
      options[k] = std::move(kept);
    }
    LOOM_CHECK(!options[k].empty(),
               "memory.activation_budget: {} per rank, but pipeline rank {}'s chunk {} has no plan for it even with "
               "one micro-batch in flight ({})",
               format_bytes(int64_t(budget)), rank, k, why);
  }
  const auto walk = [&](const std::vector<size_t>& pick) {
    if (chunks == 1) return model::plan_peak(options[0][pick[0]].plan, mems[0]);
    double cur = 0, peak = 0;
    for (const Instr& in : list) {
      if (in.chunk < 0) continue;
      const Option& o = options[size_t(in.chunk)][pick[size_t(in.chunk)]];
      if (in.op == Op::forward) {
        // (A recomputed segment's block holds its saved activations during its forward until
        // they are dropped: bounded by the chunk's peak over one micro-batch.)
        peak = std::max(peak, o.plan.segments.empty() ? cur + o.kept : cur + o.transient);
        cur += o.kept;
      } else if (in.op == Op::backward) {
        peak = std::max(peak, cur - o.kept + o.transient);
        cur -= o.kept;
      }
    }
    return peak;
  };
  std::vector<std::vector<double>> costs(chunks);
  for (size_t k = 0; k < chunks; ++k)
    for (const Option& o : options[k]) costs[k].push_back(o.cost);
  const JointChoice joint = choose_joint(costs, walk, budget);
  JointRecompute out;
  out.peak = joint.peak;
  out.exhaustive = joint.exhaustive;
  for (size_t k = 0; k < chunks; ++k) out.plans.push_back(options[k][joint.pick[k]].plan);
  return out;
}

}  // namespace loom::parallel::pipeline

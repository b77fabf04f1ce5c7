// The joint recompute plan's search (parallel/pipeline/joint_plan.h) on made-up chunks: every
// combination where they are few, the descent where they are many, against a brute force.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "core/error.h"
#include "parallel/pipeline/checker.h"
#include "parallel/pipeline/joint_plan.h"

using namespace loom;
using namespace loom::parallel::pipeline;

namespace {

// Chunk k's option i keeps kept[k][i] per micro-batch at cost costs[k][i]; a combination's peak is
// the sum of its kept times in_flight[k] (a stand-in for the schedule's walk; the search sees only
// the numbers).
struct Made {
  std::vector<std::vector<double>> costs, kept;
  std::vector<double> in_flight;
  double peak(const std::vector<size_t>& pick) const {
    double p = 0;
    for (size_t k = 0; k < pick.size(); ++k) p += kept[k][pick[k]] * in_flight[k];
    return p;
  }
};

// Options as the executor makes them: more recompute costs more and keeps less.
Made made(size_t chunks, size_t options, uint32_t seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<double> u(0.5, 1.5);
  Made m;
  for (size_t k = 0; k < chunks; ++k) {
    std::vector<double> c, kp;
    double cost = 0, keep = 10 * u(g);
    for (size_t i = 0; i < options; ++i) {
      c.push_back(cost);
      kp.push_back(keep);
      cost += u(g);
      keep *= 0.8;
    }
    m.costs.push_back(c);
    m.kept.push_back(kp);
    m.in_flight.push_back(double(1 + g() % 4));
  }
  return m;
}

// The least cost of a fitting combination, by brute force.
double least_fitting_cost(const Made& m, double budget) {
  std::vector<size_t> pick(m.costs.size(), 0);
  double best = INFINITY;
  while (true) {
    if (m.peak(pick) <= budget) {
      double c = 0;
      for (size_t k = 0; k < pick.size(); ++k) c += m.costs[k][pick[k]];
      best = std::min(best, c);
    }
    size_t k = 0;
    while (k < pick.size() && ++pick[k] == m.costs[k].size()) pick[k++] = 0;
    if (k == pick.size()) break;
  }
  return best;
}

TEST(JointPlan, EveryCombinationWhereTheyAreFew) {
  const Made m = made(3, 6, 1);
  const auto peak = [&](const std::vector<size_t>& p) { return m.peak(p); };
  const double most = m.peak({0, 0, 0}), least = m.peak({5, 5, 5});
  for (const double budget : {least, 0.3 * least + 0.7 * most, 0.7 * least + 0.3 * most, most}) {
    const JointChoice c = choose_joint(m.costs, peak, budget);
    const double want = least_fitting_cost(m, budget);
    ASSERT_TRUE(std::isfinite(want)) << budget;
    EXPECT_LE(c.peak, budget);
    EXPECT_DOUBLE_EQ(c.cost, want) << budget;
    EXPECT_DOUBLE_EQ(c.peak, m.peak(c.pick));
  }
}

// Many combinations (12^5 = 248832, over the exhaustive limit): the descent, from options that do
// not fit together (each chunk's first option keeps the most here), finds a fitting combination
// within 5% of the least cost, and where the first options fit it costs no more than they do.
TEST(JointPlan, DescentWhereTheyAreMany) {
  for (uint32_t seed = 1; seed <= 5; ++seed) {
    Made m = made(5, 12, seed);
    const auto peak = [&](const std::vector<size_t>& p) { return m.peak(p); };
    const std::vector<size_t> first(5, 0);
    const double budget = 0.6 * m.peak(first);  // the first options together do not fit
    const JointChoice c = choose_joint(m.costs, peak, budget);
    EXPECT_LE(c.peak, budget) << seed;
    const double best = least_fitting_cost(m, budget);
    EXPECT_GE(c.cost, best);
    EXPECT_LE(c.cost, 1.05 * best) << seed;  // (measured: within 1.1% at these seeds)
    std::printf("seed %u: descent cost %.3f, least by brute force %.3f (%.1f%% more)\n", seed, c.cost, best,
                100 * (c.cost / best - 1));
    // The exhaustive search over the same options (the limit raised) finds the least.
    EXPECT_DOUBLE_EQ(choose_joint(m.costs, peak, budget, 1e6).cost, best);
    // First options that fit (most recompute first): the descent costs no more than they do.
    for (size_t k = 0; k < 5; ++k) {
      std::reverse(m.costs[k].begin(), m.costs[k].end());
      std::reverse(m.kept[k].begin(), m.kept[k].end());
    }
    const double budget2 = 1.5 * m.peak(first);
    const JointChoice d = choose_joint(m.costs, peak, budget2);
    double first_cost = 0;
    for (size_t k = 0; k < 5; ++k) first_cost += m.costs[k][0];
    EXPECT_LE(d.peak, budget2);
    EXPECT_LE(d.cost, first_cost);
  }
}

// A peak that is the largest of four equal chunks' (a plateau: from the first options no change of
// one or two chunks lowers it) with 20^4 combinations: the descent from the last options finds a
// fitting choice that the one from the first options cannot.
TEST(JointPlan, DescentPastAPlateau) {
  Made m = made(4, 20, 11);
  for (size_t k = 1; k < 4; ++k) m.costs[k] = m.costs[0], m.kept[k] = m.kept[0];
  const auto peak = [&](const std::vector<size_t>& p) {
    double x = 0;
    for (size_t k = 0; k < p.size(); ++k) x = std::max(x, m.kept[k][p[k]]);
    return x;
  };
  double budget = 0;  // just above the largest of the chunks' least kept
  for (size_t k = 0; k < 4; ++k) budget = std::max(budget, m.kept[k].back() * 1.3);
  const JointChoice c = choose_joint(m.costs, peak, budget);
  EXPECT_FALSE(c.exhaustive);
  EXPECT_LE(c.peak, budget);
  const JointChoice all = choose_joint(m.costs, peak, budget, 1e6);
  EXPECT_TRUE(all.exhaustive);
  EXPECT_LE(c.cost, 1.05 * all.cost);
}

TEST(JointPlan, NoneFitsGivesTheLeastPeak) {
  const Made m = made(3, 4, 7);
  const auto peak = [&](const std::vector<size_t>& p) { return m.peak(p); };
  const JointChoice c = choose_joint(m.costs, peak, 1e-9);
  EXPECT_DOUBLE_EQ(c.peak, m.peak({3, 3, 3}));  // the most recompute keeps the least
  EXPECT_THROW(choose_joint({}, peak, 1.0), Error);
  EXPECT_THROW(choose_joint({{1.0}, {}}, peak, 1.0), Error);
}

// Every plan of a chain of L blocks: each block kept, or recomputed in a segment it starts or
// continues (the previous block recomputed).
std::vector<model::RecomputePlan> every_plan(int64_t L) {
  std::vector<model::RecomputePlan> out;
  int64_t codes = 1;
  for (int64_t l = 0; l < L; ++l) codes *= 3;
  for (int64_t code = 0; code < codes; ++code) {
    model::RecomputePlan p;
    p.blocks = L;
    bool ok = true;
    for (int64_t l = 0, c = code; l < L; ++l, c /= 3) {
      const int what = int(c % 3);  // 0 kept, 1 a new segment, 2 the previous segment goes on
      if (what == 1) p.segments.push_back({l, l});
      if (what == 2) {
        if (p.segments.empty() || p.segments.back().second != l - 1) ok = false;
        else p.segments.back().second = l;
      }
    }
    if (ok) out.push_back(p);
  }
  return out;
}

// The interleaved joint plan on a rank's real list (p = 2, v = 2, m = 4: rank 0 holds up to 5
// micro-batches of its two chunks) recomputes as little as the best of every pair of plans (of 4
// identical blocks each: 34 plans, 1156 pairs) at every budget from the least any pair needs to
// what none needs, walked as the executor walks them. (It had offered each chunk only its
// least-recompute plans for 1 .. in_flight micro-batches of its own, and recomputed a block more
// than needed at 7 of 37 such budgets.)
TEST(JointPlan, InterleavedChunksRecomputeTheLeastOfEveryPairOfPlans) {
  const Schedule sch = generate({Kind::interleaved, 2, 2, 4});
  const std::vector<Instr>& list = sch.ranks[0];
  model::ChainMemory c;
  c.full.assign(4, 16.0);
  c.out.assign(4, 1.0);
  c.forward.assign(4, 1.0);
  c.fixed = 5;
  c.in_flight = check_or_throw(sch).ranks[0].peak_in_flight;
  ASSERT_EQ(c.in_flight, 5);
  const std::vector<model::ChainMemory> mems{c, c};
  model::ChainMemory one = c;
  one.in_flight = 1;
  const std::vector<model::RecomputePlan> plans = every_plan(4);
  ASSERT_EQ(plans.size(), 34u);
  // The executor's walk: each micro-batch keeps its chunk's plan_kept from its forward to its
  // backward; a forward of a chunk that recomputes, and a backward, peak at the chunk's peak over
  // one micro-batch.
  auto walk = [&](const model::RecomputePlan& a, const model::RecomputePlan& b) {
    const model::RecomputePlan* of[2] = {&a, &b};
    double cur = 0, peak = 0;
    for (const Instr& in : list) {
      if (in.chunk < 0) continue;
      const model::RecomputePlan& p = *of[in.chunk];
      const double kept = model::plan_kept(p, c), transient = model::plan_peak(p, one);
      if (in.op == Op::forward) peak = std::max(peak, p.segments.empty() ? cur + kept : cur + transient), cur += kept;
      if (in.op == Op::backward) peak = std::max(peak, cur - kept + transient), cur -= kept;
    }
    return peak;
  };
  std::vector<std::pair<double, int64_t>> pairs;  // (peak, recomputed blocks)
  double least = 1e300, most = 0;
  for (const auto& a : plans)
    for (const auto& b : plans) {
      const double pk = walk(a, b);
      pairs.push_back({pk, a.recomputed_blocks() + b.recomputed_blocks()});
      least = std::min(least, pk), most = std::max(most, pk);
    }
  for (int i = 0; i <= 36; ++i) {
    const double budget = least + (most - least) * i / 36;
    int64_t best = 1 << 30;
    for (const auto& [pk, r] : pairs)
      if (pk <= budget) best = std::min(best, r);
    const JointRecompute j = plan_joint_recompute(mems, {std::nullopt, std::nullopt}, list, budget, 0);
    ASSERT_EQ(j.plans.size(), 2u);
    EXPECT_TRUE(j.exhaustive);
    EXPECT_LE(j.peak, budget) << "budget " << budget;
    EXPECT_DOUBLE_EQ(j.peak, walk(j.plans[0], j.plans[1])) << "budget " << budget;
    EXPECT_EQ(j.plans[0].recomputed_blocks() + j.plans[1].recomputed_blocks(), best) << "budget " << budget;
  }
}

}  // namespace


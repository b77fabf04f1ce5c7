// The joint recompute plan's search (parallel/pipeline/joint_plan.h) on made-up chunks: every
// combination where they are few, the descent where they are many, against a brute force.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "core/error.h"
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

}  // namespace

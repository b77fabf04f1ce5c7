// The interleaved schedules' joint recompute plan (executor.cpp): each chunk a rank holds offers
// recompute plans (its options, each with a cost: blocks' forwards run again), and a combination of
// one option per chunk has a peak: what the rank holds walking the schedule's list. Of the
// combinations, the one that fits the budget with the least cost (then the least peak); where none
// fits, the one with the least peak (then the least cost).
#pragma once
#include <cstddef>
#include <functional>
#include <vector>

namespace loom::parallel::pipeline {

struct JointChoice {
  std::vector<size_t> pick;  // the option of each chunk
  double cost = 0, peak = 0;
  bool exhaustive = true;  // every combination was weighed (else the descent's choice)
};

// costs[k][i]: option i of chunk k (every chunk has at least one); peak(pick) the combination's.
// Every combination where they are at most `exhaustive_limit`; otherwise descents from each
// chunk's first option and from each chunk's last that change one chunk's option, or two chunks'
// at once, while that makes the choice better, until no such change does (at least as good as the
// first options together, and as the last; not always the best).
JointChoice choose_joint(const std::vector<std::vector<double>>& costs,
                         const std::function<double(const std::vector<size_t>&)>& peak, double budget,
                         double exhaustive_limit = 1e5);

}  // namespace loom::parallel::pipeline

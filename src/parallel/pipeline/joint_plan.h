// The interleaved schedules' joint recompute plan (executor.cpp): each chunk a rank holds offers
// recompute plans (its options, each with a cost: blocks' forwards run again), and a combination of
// one option per chunk has a peak: what the rank holds walking the schedule's list. Of the
// combinations, the one that fits the budget with the least cost (then the least peak); where none
// fits, the one with the least peak (then the least cost).
#pragma once
#include <cstddef>
#include <functional>
#include <optional>
#include <vector>

#include "model/recompute.h"
#include "parallel/pipeline/schedule.h"

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

// The optimal recompute of a rank's chunks (executor.cpp): chunk k's chain mems[k] (in_flight the
// rank's micro-batches in flight), and own[k] its plan for them all where it has one. With one
// chunk that plan, at its own peak. With several (interleaved, `list` the rank's instructions):
// for each chunk every plan that may be needed (model::recompute_candidates) whose one
// micro-batch fits the budget, less those another beats in what a micro-batch keeps, its peak
// and its recompute at once; of their combinations (choose_joint) the least recompute whose walk
// along the list (each micro-batch keeping its chunk's plan_kept from its forward to its
// backward, and the one in backward at its chunk's peak) stays within `budget`. Throws naming
// `rank` and the chunk where a chunk has no plan (why: the reason its own plan failed).
struct JointRecompute {
  std::vector<model::RecomputePlan> plans;  // per chunk
  double peak = 0;
  bool exhaustive = true;
};
JointRecompute plan_joint_recompute(const std::vector<model::ChainMemory>& mems,
                                    const std::vector<std::optional<model::RecomputePlan>>& own,
                                    const std::vector<Instr>& list, double budget, int rank,
                                    const std::string& why = "no plan");

}  // namespace loom::parallel::pipeline

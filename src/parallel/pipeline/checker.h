// Proves a pipeline schedule valid without running it, by executing the instruction lists
// symbolically with blocking (rendezvous) transfers:
//   - every instruction names a micro-batch, chunk and peer that exist, and each transfer's peer
//     is the rank of the neighbouring virtual stage;
//   - every send meets the matching recv (same message, same order), with nothing left over;
//   - no deadlock: when no rank can move, the report names the cycle of waiting ranks;
//   - data dependencies: a forward after its input arrived, a backward after its forward and its
//     output gradient, a weight gradient after the input gradient, sends after the producing
//     compute, the optimizer step after every backward of the rank;
//   - each (micro-batch, chunk) forwarded and backwarded exactly once on its rank.
// It also measures each rank's peak number of micro-batch chunks in flight (forwarded, backward
// not finished: the activation-memory bound) and, with per-op costs, a timeline for pictures,
// bubble fractions and the planner's simulator, by default as the executor runs the lists (its
// sends do not block; see Timing).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "parallel/pipeline/schedule.h"

namespace loom::parallel::pipeline {

struct RankTimeline {
  std::vector<double> start, end;  // per instruction of the rank's list
  double busy = 0;                 // total compute time
  double finish = 0;               // end of the last instruction
  int peak_in_flight = 0;          // max (mb, chunk) forwarded and not fully backwarded
};

struct CheckResult {
  bool ok = false;
  std::string error;  // first violation, naming rank and instruction (empty when ok)
  std::vector<RankTimeline> ranks;
  double makespan = 0;
  // Idle share of rank r over the makespan: 1 - busy / makespan.
  double idle_fraction(int r) const;
  // Bubble over useful work, (makespan - busy) / busy: (p - 1) / m for GPipe and 1F1B with
  // backward = 2 forward.
  double bubble_ratio(int r) const;
};

// How the timeline is timed. Validity (and the in-flight bound) is always proved under blocking
// transfers, which makes it hold for non-blocking sends too.
enum class Timing : uint8_t {
  eager_sends,  // as the executor runs: a send is posted and the sender goes on; the optimizer
                // step waits until the rank's messages were received
  blocking,     // a send and its receive meet (rendezvous): both ranks wait for the later one
};

CheckResult check(const Schedule& sch, const OpCosts& costs = {}, Timing timing = Timing::eager_sends);
// The timeline of a valid schedule run as the executor runs it (eager sends, free transfers) with
// measured durations: compute_seconds[r][k] is how long rank r's k-th compute instruction (in list
// order) took. With durations measured as each rank thread's CPU time, this is the timeline the
// schedule has on one dedicated core per rank, measured on a host with fewer cores than ranks.
// Throws naming the rank when the durations do not match the lists.
CheckResult replay(const Schedule& sch, const std::vector<std::vector<double>>& compute_seconds);
// What each rank's ops cost when the ranks differ (a pipeline cut by cost gives each stage its own
// share of the chain) and, optionally, share a host's cores.
struct RankCosts {
  // [rank][chunk]: the compute ops' seconds on that rank for that chunk, each on a rank that runs
  // alone (forward, backward, backward_input, backward_weight; the other fields are ignored).
  std::vector<std::vector<OpCosts>> chunk;
  double transfer = 0;        // seconds from a send's post to its message's arrival
  double optimizer_step = 0;  // seconds on every rank
  // A shared host: `capacity` cores (capacity 0: every rank has its own device), on which
  // `copies` identical pipelines run side by side (data, tensor and context parallel replicas):
  // this pipeline has capacity / copies of them. Each rank runs on one core, which divides itself
  // among the ranks computing on it, as the OS runs threads that sleep while they wait: a rank
  // that wakes takes an idle core if there is one, else the least loaded (its own when tied); a
  // rank that computes keeps its core until a core that has gone idle takes it from a shared
  // one, `balance` seconds after both became so (the OS's load balancing).
  double capacity = 0;
  int copies = 1;
  double balance = 0;
  // On a shared host: how long after its message arrives a rank that sleeps in a receive runs
  // again (the OS's wake-up): `wake` when a core is idle then, `crowded_wake` when none is. A
  // receive whose message is already there costs neither. (loom calibrate measures all three.)
  double wake = 0;
  double crowded_wake = 0;
};

// The timeline of a schedule with per-rank costs, run as the executor runs it (eager sends):
// validity and in-flight counts as check() proves them, times from an event simulation in which
// the ranks share the host's cores as RankCosts describes. Throws naming the schedule when it
// is invalid or the costs do not cover its ranks and chunks.
CheckResult simulate(const Schedule& sch, const RankCosts& costs);

// Throws a loom::Error with the checker's message when the schedule is invalid.
CheckResult check_or_throw(const Schedule& sch, const OpCosts& costs = {}, Timing timing = Timing::eager_sends);

}  // namespace loom::parallel::pipeline

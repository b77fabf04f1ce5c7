#include <gtest/gtest.h>

#include <algorithm>

#include "core/error.h"
#include "parallel/pipeline/checker.h"
#include "parallel/pipeline/schedule.h"

namespace loom::parallel::pipeline {
namespace {

// Every generated schedule of acceptance 2 (p <= 16, m <= 64, v <= 4) passes the checker, with the
// activation bound of its kind.
TEST(PipelineSchedule, CheckerAcceptsEveryGeneratedSchedule) {
  int checked = 0;
  for (Kind k : {Kind::gpipe, Kind::one_f_one_b, Kind::interleaved, Kind::zb_h1}) {
    for (int p = 1; p <= 16; ++p) {
      for (int m = 1; m <= 64; ++m) {
        for (int v = 1; v <= 4; ++v) {
          ScheduleSpec s{k, p, v, m};
          if ((k == Kind::interleaved) != (v > 1)) continue;
          if (k == Kind::interleaved && (p < 2 || m % p != 0)) continue;
          Schedule sch = generate(s);
          CheckResult r = check(sch);
          ASSERT_TRUE(r.ok) << kind_name(k) << " p=" << p << " v=" << v << " m=" << m << ": " << r.error;
          for (int rank = 0; rank < p; ++rank) {
            const int peak = r.ranks[size_t(rank)].peak_in_flight;
            if (k == Kind::gpipe) {
              ASSERT_EQ(peak, m);
            }
            if (k == Kind::one_f_one_b) {
              ASSERT_EQ(peak, std::min(m, p - rank)) << kind_name(k);
            }
            if (k == Kind::zb_h1) {  // (rank r's weight passes r micro-batches late)
              ASSERT_EQ(peak, std::min(m, p)) << kind_name(k) << " rank " << rank;
            }
            if (k == Kind::interleaved) {
              ASSERT_LE(peak, m * v);
            }
          }
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 3000);
}

TEST(PipelineSchedule, RefusesInvalidCombinations) {
  EXPECT_THROW(generate({Kind::interleaved, 4, 2, 6}), Error);  // m not divisible by p
  EXPECT_THROW(generate({Kind::interleaved, 4, 1, 8}), Error);  // v = 1
  EXPECT_THROW(generate({Kind::one_f_one_b, 4, 2, 8}), Error);  // v > 1 outside interleaved
  EXPECT_THROW(generate({Kind::gpipe, 0, 1, 8}), Error);
  EXPECT_THROW(generate({Kind::gpipe, 2, 1, 0}), Error);
  // Sizes that would build lists without bound are refused before any is built (v = 10^8 ran out
  // of memory).
  EXPECT_THROW(generate({Kind::interleaved, 4, 100'000'000, 8}), Error);
  EXPECT_THROW(generate({Kind::interleaved, 4096, 4096, 4096}), Error);
  EXPECT_THROW(parse_kind("pipedream"), Error);
  EXPECT_EQ(parse_kind("zb-h1"), Kind::zb_h1);
  try {
    generate({Kind::interleaved, 4, 2, 6});
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("divisible"), std::string::npos) << e.what();
  }
}

// 1F1B's structure: rank r warms up with p - r - 1 forwards and ends with the optimizer step.
TEST(PipelineSchedule, OneFOneBShape) {
  Schedule s = generate({Kind::one_f_one_b, 4, 1, 8});
  for (int r = 0; r < 4; ++r) {
    int fwd_before_first_bwd = 0;
    for (const Instr& in : s.ranks[size_t(r)]) {
      if (in.op == Op::backward) break;
      fwd_before_first_bwd += in.op == Op::forward;
    }
    EXPECT_EQ(fwd_before_first_bwd, 4 - r);
    EXPECT_EQ(s.ranks[size_t(r)].back().op, Op::optimizer_step);
  }
}

// Bubble with backward = 2 x forward: (p - 1) / m for GPipe and 1F1B, (p - 1) / (v m) for
// interleaved; zb-h1 below 1F1B.
TEST(PipelineSchedule, SimulatedBubble) {
  const int p = 4, m = 8;
  auto bubble = [&](Kind k, int v) { return check_or_throw(generate({k, p, v, m})).bubble_ratio(0); };
  EXPECT_NEAR(bubble(Kind::gpipe, 1), double(p - 1) / m, 1e-12);
  EXPECT_NEAR(bubble(Kind::one_f_one_b, 1), double(p - 1) / m, 1e-12);
  EXPECT_LT(bubble(Kind::zb_h1, 1), bubble(Kind::one_f_one_b, 1));
}

// ZB-H1 reaches the paper's bubble (Qi et al. 2023, section 3.1): (p - 1)(F + Bi - W) idle on rank 0
// against m (F + Bi + W) busy, a third of 1F1B's at equal costs, while the weight pass costs at most
// a forward; with a dearer weight pass it stays below 1F1B. (It had been 1F1B with a split
// backward, W right after Bi: two thirds of 1F1B's bubble.)
TEST(PipelineSchedule, ZeroBubbleH1ReachesThePapersBubble) {
  int n = 0;
  for (const OpCosts& c : {OpCosts{1.0, 2.0, 1.0, 1.0}, OpCosts{1.0, 2.0, 1.18, 0.82}, OpCosts{1.0, 2.0, 1.5, 0.5},
                           OpCosts{1.0, 3.0, 1.2, 1.8}})
    for (int p = 2; p <= 8; ++p)
      for (int m = p; m <= 4 * p; m += p) {
        const double zb = check_or_throw(generate({Kind::zb_h1, p, 1, m}, c), c).bubble_ratio(0);
        const double fb = check_or_throw(generate({Kind::one_f_one_b, p, 1, m}, c), c).bubble_ratio(0);
        const double F = c.forward, Bi = c.backward_input, W = c.backward_weight;
        if (W <= F) {
          ASSERT_NEAR(zb, (p - 1) * (F + Bi - W) / (m * (F + Bi + W)), 1e-12) << "p=" << p << " m=" << m << " W=" << W;
        }
        ASSERT_LT(zb, fb) << "p=" << p << " m=" << m << " W=" << W;
        if (W == F && Bi == F) {
          ASSERT_NEAR(zb, fb / 3, 1e-12) << "p=" << p << " m=" << m;
        }
        ++n;
      }
  EXPECT_EQ(n, 4 * 7 * 4);
}

// Interleaved reaches Megatron's (p - 1) / (v m) under blocking transfers for every p <= 16,
// v <= 4 and m <= 64 it accepts, small p * v included (p = 2 once sat at 3x the ideal).
TEST(PipelineSchedule, InterleavedBubbleIsMegatronsIdeal) {
  int n = 0;
  for (int p = 2; p <= 16; ++p)
    for (int v = 2; v <= 4; ++v)
      for (int m = p; m <= 64; m += p) {
        const CheckResult r = check_or_throw(generate({Kind::interleaved, p, v, m}));
        for (int rank = 0; rank < p; ++rank)
          ASSERT_NEAR(r.bubble_ratio(rank), double(p - 1) / (v * m), 1e-12) << "p=" << p << " v=" << v << " m=" << m
                                                                           << " rank " << rank;
        ++n;
      }
  EXPECT_EQ(n, 441);
  // zb-h1 below 1F1B at p = 2 as well.
  EXPECT_LT(check_or_throw(generate({Kind::zb_h1, 2, 1, 8})).bubble_ratio(0),
            check_or_throw(generate({Kind::one_f_one_b, 2, 1, 8})).bubble_ratio(0));
}

// Generated for other op costs (the executor passes its model's: the input-gradient half dearer
// than the weight half), schedules stay valid with their kind's activation bound; GPipe and 1F1B
// keep (p - 1) / m while a full backward is twice a forward, and zb-h1 stays below 1F1B at p = 4
// (with blocking sends it did not once Bi / W passed about 1.2 at m = 32, 1.4 at m = 8: the
// rendezvous waited for the longer half).
TEST(PipelineSchedule, OtherOpCostsKeepValidityBoundsAndBubbles) {
  for (const OpCosts& c : {OpCosts{1.0, 2.0, 1.08, 0.92}, OpCosts{1.0, 2.0, 1.5, 0.5}, OpCosts{1.0, 3.0, 1.2, 1.8}}) {
    for (Kind k : {Kind::gpipe, Kind::one_f_one_b, Kind::interleaved, Kind::zb_h1})
      for (int p = 1; p <= 8; ++p)
        for (int m = 1; m <= 16; ++m) {
          const int v = k == Kind::interleaved ? 2 : 1;
          if (k == Kind::interleaved && (p < 2 || m % p != 0)) continue;
          const Schedule sch = generate({k, p, v, m}, c);
          const CheckResult r = check(sch, c);
          ASSERT_TRUE(r.ok) << kind_name(k) << " p=" << p << " m=" << m << " Bi=" << c.backward_input << ": " << r.error;
          // The executor's non-blocking sends never make an instruction end later than blocking ones.
          const CheckResult blocking = check(sch, c, Timing::blocking);
          for (int rank = 0; rank < p; ++rank)
            for (size_t i = 0; i < sch.ranks[size_t(rank)].size(); ++i)
              ASSERT_LE(r.ranks[size_t(rank)].end[i], blocking.ranks[size_t(rank)].end[i] + 1e-12);
          for (int rank = 0; rank < p; ++rank) {
            const int peak = r.ranks[size_t(rank)].peak_in_flight;
            if (k == Kind::gpipe) {
              ASSERT_EQ(peak, m);
            }
            if (k == Kind::one_f_one_b) {
              ASSERT_EQ(peak, std::min(m, p - rank));
            }
            if (k == Kind::zb_h1) {
              ASSERT_EQ(peak, std::min(m, p));
            }
          }
        }
    if (c.backward != 2.0) continue;
    for (int m : {8, 16}) {
      auto bubble = [&](Kind k) { return check_or_throw(generate({k, 4, 1, m}, c), c).bubble_ratio(0); };
      EXPECT_NEAR(bubble(Kind::gpipe), 3.0 / m, 1e-12);
      EXPECT_NEAR(bubble(Kind::one_f_one_b), 3.0 / m, 1e-12);
      EXPECT_LT(bubble(Kind::zb_h1), bubble(Kind::one_f_one_b)) << "Bi=" << c.backward_input << " m=" << m;
    }
  }
  EXPECT_THROW(generate({Kind::one_f_one_b, 2, 1, 4}, OpCosts{0.0, 2.0, 1.0, 1.0}), Error);
  EXPECT_THROW(generate({Kind::one_f_one_b, 2, 1, 4}, OpCosts{1.0, 2.0, -1.0, 1.0}), Error);
}

Schedule two_stage() { return generate({Kind::one_f_one_b, 2, 1, 2}); }

TEST(PipelineChecker, RejectsMissingRecv) {
  Schedule s = two_stage();
  auto& r1 = s.ranks[1];
  r1.erase(std::find_if(r1.begin(), r1.end(), [](const Instr& in) { return in.op == Op::recv_act && in.mb == 1; }));
  // Rank 0's send of mb 1 now meets rank 1's send of a gradient: both block.
  CheckResult r = check(s);
  ASSERT_FALSE(r.ok);
  EXPECT_NE(r.error.find("cyclic wait"), std::string::npos) << r.error;

  // Without the forward that needs it, the unmatched send itself is reported.
  s = two_stage();
  auto& q = s.ranks[1];
  q.erase(std::find_if(q.begin(), q.end(), [](const Instr& in) { return in.op == Op::recv_act && in.mb == 1; }));
  std::erase_if(q, [](const Instr& in) { return in.mb == 1; });
  r = check(s);
  ASSERT_FALSE(r.ok);
  EXPECT_NE(r.error.find("deadlock"), std::string::npos) << r.error;

  // A forward moved before the receive of its input.
  s = two_stage();
  auto& f = s.ranks[1];
  auto rv = std::find_if(f.begin(), f.end(), [](const Instr& in) { return in.op == Op::recv_act && in.mb == 0; });
  auto fw = std::find_if(f.begin(), f.end(), [](const Instr& in) { return in.op == Op::forward && in.mb == 0; });
  std::iter_swap(rv, fw);
  r = check(s);
  ASSERT_FALSE(r.ok);
  EXPECT_NE(r.error.find("forward before its input activation arrived"), std::string::npos) << r.error;
}

TEST(PipelineChecker, RejectsCyclicWait) {
  // Both ranks send first to each other: blocking sends wait forever.
  Schedule s;
  s.spec = {Kind::gpipe, 2, 1, 1};
  s.ranks = {{{Op::forward, 0, 0, -1}, {Op::recv_grad, 0, 0, 1}, {Op::send_act, 0, 0, 1}},
             {{Op::recv_act, 0, 0, 0}, {Op::forward, 0, 0, -1}, {Op::backward, 0, 0, -1}, {Op::send_grad, 0, 0, 0}}};
  CheckResult r = check(s);
  ASSERT_FALSE(r.ok);
  EXPECT_NE(r.error.find("cyclic wait"), std::string::npos) << r.error;

  // Swapping the order of rank 0's transfers in generated 1F1B breaks the global order.
  Schedule g = generate({Kind::one_f_one_b, 2, 1, 4});
  auto& l = g.ranks[0];
  auto a = std::find_if(l.begin(), l.end(), [](const Instr& in) { return in.op == Op::send_act && in.mb == 2; });
  auto b = std::find_if(l.begin(), l.end(), [](const Instr& in) { return in.op == Op::recv_grad && in.mb == 1; });
  ASSERT_TRUE(a != l.end() && b != l.end());
  std::iter_swap(a, b);
  r = check(g);
  ASSERT_FALSE(r.ok);
  EXPECT_NE(r.error.find("deadlock"), std::string::npos) << r.error;
}

TEST(PipelineChecker, RejectsBackwardBeforeForward) {
  Schedule s;
  s.spec = {Kind::gpipe, 1, 1, 2};
  s.ranks = {{{Op::forward, 0, 0, -1}, {Op::backward, 1, 0, -1}, {Op::forward, 1, 0, -1}, {Op::backward, 0, 0, -1},
              {Op::optimizer_step, -1, -1, -1}}};
  CheckResult r = check(s);
  ASSERT_FALSE(r.ok);
  EXPECT_NE(r.error.find("backward before forward"), std::string::npos) << r.error;
}

TEST(PipelineChecker, RejectsOtherBreakage) {
  Schedule s = generate({Kind::one_f_one_b, 2, 1, 2});
  s.ranks[0].pop_back();  // no optimizer step
  EXPECT_FALSE(check(s).ok);
  s = generate({Kind::one_f_one_b, 2, 1, 2});
  for (Instr& in : s.ranks[0])
    if (in.op == Op::send_act) in.peer = 0;  // wrong neighbour
  EXPECT_FALSE(check(s).ok);
  s = generate({Kind::zb_h1, 2, 1, 2});
  std::erase_if(s.ranks[1], [](const Instr& in) { return in.op == Op::backward_weight && in.mb == 0; });
  CheckResult r = check(s);
  ASSERT_FALSE(r.ok);
  EXPECT_NE(r.error.find("optimizer step before"), std::string::npos) << r.error;
}

// Replay with durations per instruction: the op costs themselves reproduce the checker's timeline
// for every kind, and a slow stage stretches the pipeline as it must.
TEST(PipelineReplay, OpCostDurationsGiveTheCheckersTimeline) {
  const OpCosts c{1.0, 2.0, 1.08, 0.92};
  for (Kind k : {Kind::gpipe, Kind::one_f_one_b, Kind::interleaved, Kind::zb_h1}) {
    const Schedule sch = generate({k, 4, k == Kind::interleaved ? 2 : 1, 8}, c);
    const CheckResult want = check_or_throw(sch, c);
    std::vector<std::vector<double>> d(4);
    for (int r = 0; r < 4; ++r)
      for (const Instr& in : sch.ranks[size_t(r)])
        if (is_compute(in.op)) d[size_t(r)].push_back(c.of(in.op));
    const CheckResult got = replay(sch, d);
    ASSERT_TRUE(got.ok);
    EXPECT_DOUBLE_EQ(got.makespan, want.makespan) << kind_name(k);
    for (int r = 0; r < 4; ++r) {
      EXPECT_DOUBLE_EQ(got.idle_fraction(r), want.idle_fraction(r)) << kind_name(k) << " rank " << r;
      EXPECT_EQ(got.ranks[size_t(r)].start, want.ranks[size_t(r)].start) << kind_name(k) << " rank " << r;
    }
  }
}

TEST(PipelineReplay, DurationsOfEachComputeAreHonoured) {
  // One micro-batch through two stages: F0, F1, B1, B0 in sequence.
  const Schedule sch = generate({Kind::gpipe, 2, 1, 1});
  const CheckResult r = replay(sch, {{0.5, 4.0}, {1.0, 2.0}});  // rank 0: F, B; rank 1: F, B
  EXPECT_DOUBLE_EQ(r.makespan, 0.5 + 1.0 + 2.0 + 4.0);
  EXPECT_DOUBLE_EQ(r.idle_fraction(0), 1.0 - 4.5 / 7.5);
  EXPECT_DOUBLE_EQ(r.idle_fraction(1), 1.0 - 3.0 / 7.5);
  // 1F1B at p = 4, m = 8 with stage 2 twice as slow: the pipeline runs at stage 2's pace. Its
  // 8 x (2 + 4) = 48 of work, after the first micro-batch's forwards on stages 0 and 1 (2) and a
  // wait of 1 for stage 3's first backward (stage 3's F + B = 3 against stage 2's second F = 2),
  // and before the last backwards of stages 1 and 0 (4): 55. The other stages idle at least half.
  const Schedule f = generate({Kind::one_f_one_b, 4, 1, 8});
  std::vector<std::vector<double>> d(4);
  for (int k = 0; k < 4; ++k)
    for (const Instr& in : f.ranks[size_t(k)])
      if (is_compute(in.op)) d[size_t(k)].push_back((in.op == Op::forward ? 1.0 : 2.0) * (k == 2 ? 2.0 : 1.0));
  const CheckResult s = replay(f, d);
  EXPECT_DOUBLE_EQ(s.makespan, 2.0 + 1.0 + 8 * 6.0 + 4.0);
  for (int k : {0, 1, 3}) EXPECT_GE(s.idle_fraction(k), 0.5) << k;
}

TEST(PipelineReplay, RefusesDurationsThatDoNotMatchTheLists) {
  const Schedule sch = generate({Kind::one_f_one_b, 2, 1, 2});
  try {
    replay(sch, {{1, 1, 1, 1}, {1, 1, 1}});
    FAIL() << "a missing duration was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 has 4 computes but 3 durations"), std::string::npos) << e.what();
  }
  EXPECT_THROW(replay(sch, {{1, 1, 1, 1}}), Error);
  EXPECT_THROW(replay(sch, {{1, 1, 1, -1}, {1, 1, 1, 1}}), Error);
  Schedule broken = sch;
  broken.ranks[1].erase(broken.ranks[1].begin());  // its first recv
  EXPECT_THROW(replay(broken, {{1, 1, 1, 1}, {1, 1, 1, 1}}), Error);
}

// Per-rank costs on dedicated devices: the executor's timing, as replay() gives it with the same
// durations per instruction; with a capacity of p ranks (nobody shares) the event simulation
// gives the same timeline, transfers included.
TEST(PipelineSimulate, PerRankCostsMatchReplayAndTheEventSimulationAgrees) {
  for (Kind k : {Kind::gpipe, Kind::one_f_one_b, Kind::interleaved, Kind::zb_h1}) {
    const int v = k == Kind::interleaved ? 2 : 1;
    const Schedule sch = generate({k, 4, v, 8});
    RankCosts rc;
    rc.chunk.assign(4, std::vector<OpCosts>(size_t(v)));
    std::vector<std::vector<double>> d(4);
    for (int r = 0; r < 4; ++r) {
      for (int c = 0; c < v; ++c) {
        const double s = 1.0 + 0.25 * r + 0.5 * c;  // every rank and chunk its own pace
        rc.chunk[size_t(r)][size_t(c)] = OpCosts{s, 2.1 * s, 1.2 * s, 0.9 * s};
      }
      for (const Instr& in : sch.ranks[size_t(r)])
        if (is_compute(in.op)) d[size_t(r)].push_back(rc.chunk[size_t(r)][size_t(in.chunk)].of(in.op));
    }
    const CheckResult want = replay(sch, d);
    const CheckResult got = simulate(sch, rc);
    EXPECT_DOUBLE_EQ(got.makespan, want.makespan) << kind_name(k);
    for (int r = 0; r < 4; ++r) EXPECT_EQ(got.ranks[size_t(r)].start, want.ranks[size_t(r)].start) << kind_name(k);
    rc.transfer = 0.3;
    const CheckResult dedicated = simulate(sch, rc);
    EXPECT_GT(dedicated.makespan, want.makespan) << kind_name(k);
    rc.capacity = 4;
    const CheckResult events = simulate(sch, rc);
    EXPECT_NEAR(events.makespan, dedicated.makespan, 1e-9 * dedicated.makespan) << kind_name(k);
    for (int r = 0; r < 4; ++r) {
      ASSERT_EQ(events.ranks[size_t(r)].end.size(), dedicated.ranks[size_t(r)].end.size());
      for (size_t i = 0; i < events.ranks[size_t(r)].end.size(); ++i)
        EXPECT_NEAR(events.ranks[size_t(r)].end[i], dedicated.ranks[size_t(r)].end[i], 1e-9) << kind_name(k) << " rank "
                                                                                            << r << " instruction " << i;
      EXPECT_EQ(events.ranks[size_t(r)].peak_in_flight, dedicated.ranks[size_t(r)].peak_in_flight);
    }
  }
}

// Processor sharing: ranks that compute at once divide `capacity` among them.
TEST(PipelineSimulate, RanksSharingCoresDivideThem) {
  // 1F1B over two stages on one core: some rank always computes (the other waits on it), so the
  // step takes the two ranks' work end to end: 2 x 4 x (1 + 2) = 24.
  const Schedule sch = generate({Kind::one_f_one_b, 2, 1, 4});
  RankCosts rc;
  rc.chunk.assign(2, std::vector<OpCosts>(1, OpCosts{1.0, 2.0, 1.0, 1.0}));
  EXPECT_DOUBLE_EQ(simulate(sch, rc).makespan, 3.0 * 4 + 3.0);  // dedicated: (m + p - 1) (f + b)
  rc.capacity = 1;
  EXPECT_NEAR(simulate(sch, rc).makespan, 24.0, 1e-9);
  // Two such pipelines side by side on two cores: the same.
  rc.capacity = 2, rc.copies = 2;
  EXPECT_NEAR(simulate(sch, rc).makespan, 24.0, 1e-9);
  // One micro-batch through two stages never has two ranks computing at once: sharing changes
  // nothing.
  const Schedule one = generate({Kind::gpipe, 2, 1, 1});
  rc.copies = 1, rc.capacity = 1;
  EXPECT_NEAR(simulate(one, rc).makespan, 6.0, 1e-9);
  // Four stages on two cores: between the dedicated makespan and the work over two cores, at
  // least; the fill and drain, where fewer than three ranks compute, run at full speed.
  const Schedule four = generate({Kind::one_f_one_b, 4, 1, 4});
  rc.chunk.assign(4, std::vector<OpCosts>(1, OpCosts{1.0, 2.0, 1.0, 1.0}));
  rc.capacity = 0;
  const double dedicated = simulate(four, rc).makespan;
  rc.capacity = 2;
  const double shared = simulate(four, rc).makespan;
  EXPECT_GT(shared, dedicated);
  EXPECT_GE(shared, 4 * 4 * 3.0 / 2 - 1e-9);
  EXPECT_LT(shared, 2 * dedicated);  // what dividing the host by four for the whole step predicts
  // Costs that do not cover the ranks are refused naming them.
  rc.chunk.pop_back();
  try {
    simulate(four, rc);
    FAIL() << "costs for 3 of 4 ranks were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("costs for 3 ranks, the schedule has 4"), std::string::npos) << e.what();
  }
}

// The first compute instruction of rank r at or after list index `from`.
size_t first_compute(const Schedule& sch, int r, size_t from = 0) {
  for (size_t i = from; i < sch.ranks[size_t(r)].size(); ++i)
    if (is_compute(sch.ranks[size_t(r)][i].op)) return i;
  ADD_FAILURE() << "rank " << r << " has no compute after " << from;
  return 0;
}

// Wake-ups: a rank asleep in a receive runs `wake` after its message arrives when a core is idle
// then, `crowded_wake` when none is; a receive whose message is there costs neither.
TEST(PipelineSimulate, RanksAsleepInAReceiveWakeUp) {
  // 1F1B over two stages on one core, forward 1 and backward 2 (worked through by hand):
  // rank 1 sleeps until rank 0's first activation arrives at t = 1, while rank 0 starts its
  // second forward on the core: a crowded wake-up, so rank 1 starts at 1 + crowded_wake. The core
  // stays busy until rank 1's last backward ends at t = 10, when rank 0, asleep on that gradient,
  // wakes with the core idle: its last backward starts at 10 + wake, and the step is the work,
  // 12, plus that one wake-up.
  const Schedule sch = generate({Kind::one_f_one_b, 2, 1, 2});
  RankCosts rc;
  rc.chunk.assign(2, std::vector<OpCosts>(1, OpCosts{1.0, 2.0, 1.0, 1.0}));
  rc.capacity = 1;
  EXPECT_NEAR(simulate(sch, rc).makespan, 12.0, 1e-9);
  rc.wake = 0.5, rc.crowded_wake = 0.25;
  const CheckResult r = simulate(sch, rc);
  EXPECT_NEAR(r.makespan, 12.5, 1e-9);
  EXPECT_NEAR(r.ranks[1].start[first_compute(sch, 1)], 1.25, 1e-9);
  size_t last = 0;
  for (size_t i = 0; i < sch.ranks[0].size(); ++i)
    if (is_compute(sch.ranks[0][i].op) && sch.ranks[0][i].op != Op::optimizer_step) last = i;
  EXPECT_NEAR(r.ranks[0].start[last], 10.5, 1e-9);
  // On a device per rank nothing of the host's applies.
  rc.capacity = 0;
  EXPECT_NEAR(simulate(sch, rc).makespan, 3.0 * (2 + 1), 1e-9);
  rc.capacity = 1, rc.wake = -0.5;
  try {
    simulate(sch, rc);
    FAIL() << "a negative wake-up was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("wake -0.5 s"), std::string::npos) << e.what();
  }
}

// Each rank runs on one core: a rank that wakes takes an idle core if there is one, else shares
// the least loaded; a rank sharing a core moves to one that has gone idle `balance` after both
// became so (the OS's load balancing).
TEST(PipelineSimulate, RanksKeepTheirCoreUntilTheHostBalances) {
  // GPipe over three stages, forward 1, on two cores (worked through by hand): at t = 2 rank 0
  // starts its third forward on core 0, rank 1 its second on core 1, and rank 2 wakes for its
  // first with no core idle: it shares core 0 with rank 0. At t = 3 rank 1 waits and core 1 goes
  // idle; `balance` later rank 2 moves there. Its forward, half done at t = 3 at half speed, ends
  // at 3.5 + balance / 2 (balance <= 1), at 4 when the shared core is never balanced in time.
  const Schedule sch = generate({Kind::gpipe, 3, 1, 3});
  RankCosts rc;
  rc.chunk.assign(3, std::vector<OpCosts>(1, OpCosts{1.0, 2.0, 1.0, 1.0}));
  rc.capacity = 2;
  const size_t f0 = first_compute(sch, 2);
  for (auto [balance, end] : {std::pair{0.0, 3.5}, std::pair{0.25, 3.625}, std::pair{2.0, 4.0}}) {
    rc.balance = balance;
    const CheckResult r = simulate(sch, rc);
    EXPECT_NEAR(r.ranks[2].start[f0], 2.0, 1e-9) << "balance " << balance;
    EXPECT_NEAR(r.ranks[2].end[f0], end, 1e-9) << "balance " << balance;
  }
  rc.balance = -1;
  EXPECT_THROW(simulate(sch, rc), Error);
}

}  // namespace
}  // namespace loom::parallel::pipeline

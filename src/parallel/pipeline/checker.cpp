#include "parallel/pipeline/checker.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <fmt/format.h>

#include "core/error.h"

namespace loom::parallel::pipeline {

double CheckResult::idle_fraction(int r) const {
  return makespan > 0 ? 1.0 - ranks.at(size_t(r)).busy / makespan : 0.0;
}

double CheckResult::bubble_ratio(int r) const {
  const double busy = ranks.at(size_t(r)).busy;
  return busy > 0 ? (makespan - busy) / busy : 0.0;
}

namespace {

struct Violation {
  std::string what;
};

// Per rank and (mb, chunk): what has happened so far.
struct State {
  int m, v;
  std::vector<uint8_t> fwd, bwd, wgt, got_act, got_grad, sent_act, sent_grad;
  State(int m_, int v_) : m(m_), v(v_) {
    for (auto* x : {&fwd, &bwd, &wgt, &got_act, &got_grad, &sent_act, &sent_grad}) x->assign(size_t(m * v), 0);
  }
  size_t ix(int mb, int c) const { return size_t(c * m + mb); }
};

// Times a valid schedule as the executor runs it: a send is posted and the sender goes on; a
// receive waits for its message (posted time + transfer); the optimizer step waits until the
// rank's messages were received. Validity under blocking transfers implies this completes (a
// non-blocking send only removes waits), and each instruction ends no later than when blocking.
// duration(r, i, in): how long compute instruction i of rank r takes.
template <class Duration>
void time_eager(const Schedule& sch, double transfer, double step_cost, const Duration& duration, CheckResult& res) {
  const int p = sch.p();
  std::vector<size_t> pc(size_t(p), 0);
  std::vector<double> clock(size_t(p), 0.0);
  // Messages posted on each channel (from, to), in order, with the time they can be taken; and
  // per rank the latest time one of its messages was received.
  std::map<std::pair<int, int>, std::deque<double>> posted;
  std::vector<double> taken(size_t(p), 0.0);
  std::vector<int> unreceived(size_t(p), 0);
  for (auto& tl : res.ranks) tl.busy = 0;
  size_t left = 0;
  for (auto& o : sch.ranks) left += o.size();
  while (left > 0) {
    bool progress = false;
    for (int r = 0; r < p; ++r) {
      const auto& list = sch.ranks[size_t(r)];
      RankTimeline& tl = res.ranks[size_t(r)];
      while (pc[size_t(r)] < list.size()) {
        const Instr& in = list[pc[size_t(r)]];
        double start = clock[size_t(r)], end = start;
        if (in.op == Op::send_act || in.op == Op::send_grad) {
          posted[{r, in.peer}].push_back(start + transfer);
          ++unreceived[size_t(r)];
        } else if (in.op == Op::recv_act || in.op == Op::recv_grad) {
          auto& q = posted[{in.peer, r}];
          if (q.empty()) break;  // not sent yet
          end = std::max(start, q.front());
          q.pop_front();
          taken[size_t(in.peer)] = std::max(taken[size_t(in.peer)], end);
          --unreceived[size_t(in.peer)];
        } else if (in.op == Op::optimizer_step) {
          if (unreceived[size_t(r)] > 0) break;  // its sends are waited for first
          start = std::max(start, taken[size_t(r)]);
          end = start + step_cost;
        } else {
          const double d = duration(r, pc[size_t(r)], in);
          end = start + d;
          tl.busy += d;
        }
        tl.start[pc[size_t(r)]] = start;
        tl.end[pc[size_t(r)]] = end;
        clock[size_t(r)] = end;
        ++pc[size_t(r)];
        --left;
        progress = true;
      }
    }
    LOOM_CHECK(progress, "pipeline checker: {} p={} v={} m={} stalls with non-blocking sends although it is valid "
               "with blocking ones", kind_name(sch.spec.kind), p, sch.v(), sch.m());
  }
  res.makespan = 0;
  for (int r = 0; r < p; ++r) {
    res.ranks[size_t(r)].finish = clock[size_t(r)];
    res.makespan = std::max(res.makespan, clock[size_t(r)]);
  }
}

}  // namespace

CheckResult check(const Schedule& sch, const OpCosts& costs, Timing timing) {
  CheckResult res;
  const int p = sch.p(), v = sch.v(), m = sch.m(), V = p * v;
  const bool split = sch.split_backward();
  auto fail = [&](std::string msg) {
    res.ok = false;
    res.error = std::move(msg);
    return res;
  };
  if (int(sch.ranks.size()) != p) return fail(fmt::format("schedule has {} rank lists for p = {}", sch.ranks.size(), p));
  res.ranks.resize(size_t(p));
  std::vector<State> st(size_t(p), State(m, v));
  std::vector<size_t> pc(size_t(p), 0);
  std::vector<double> clock(size_t(p), 0.0);
  std::vector<int> in_flight(size_t(p), 0);
  for (int r = 0; r < p; ++r) {
    res.ranks[size_t(r)].start.assign(sch.ranks[size_t(r)].size(), 0);
    res.ranks[size_t(r)].end.assign(sch.ranks[size_t(r)].size(), 0);
  }
  auto where = [&](int r) { return fmt::format("rank {} instruction {} '{}'", r, pc[size_t(r)], to_string(sch.ranks[size_t(r)][pc[size_t(r)]])); };

  // Static checks of one instruction; returns an error message or "".
  auto static_error = [&](int r, const Instr& in) -> std::string {
    if (in.op == Op::optimizer_step) return "";
    if (in.mb < 0 || in.mb >= m) return fmt::format("{}: micro-batch out of [0, {})", where(r), m);
    if (in.chunk < 0 || in.chunk >= v) return fmt::format("{}: chunk out of [0, {})", where(r), v);
    if (split && in.op == Op::backward) return fmt::format("{}: a split-backward schedule uses Bi and W", where(r));
    if (!split && (in.op == Op::backward_input || in.op == Op::backward_weight))
      return fmt::format("{}: Bi/W in a schedule without split backward", where(r));
    const int vs = sch.virtual_stage(r, in.chunk);
    int want = -1;
    if (in.op == Op::send_act || in.op == Op::recv_grad) {
      if (vs + 1 >= V) return fmt::format("{}: the last virtual stage has no next stage", where(r));
      want = sch.rank_of(vs + 1);
    }
    if (in.op == Op::recv_act || in.op == Op::send_grad) {
      if (vs == 0) return fmt::format("{}: the first virtual stage has no previous stage", where(r));
      want = sch.rank_of(vs - 1);
    }
    if (is_transfer(in.op) && in.peer != want)
      return fmt::format("{}: peer {} is not the neighbouring stage's rank {}", where(r), in.peer, want);
    return "";
  };

  // Runs the compute (or step) at pc of rank r; returns an error message or "".
  auto run_local = [&](int r) -> std::string {
    const Instr& in = sch.ranks[size_t(r)][pc[size_t(r)]];
    State& s = st[size_t(r)];
    RankTimeline& tl = res.ranks[size_t(r)];
    if (in.op == Op::optimizer_step) {
      for (int c = 0; c < v; ++c)
        for (int mb = 0; mb < m; ++mb)
          if (!s.bwd[s.ix(mb, c)] || (split && !s.wgt[s.ix(mb, c)]))
            return fmt::format("{}: optimizer step before the backward of (mb {}, c {})", where(r), mb, c);
    } else {
      const size_t i = s.ix(in.mb, in.chunk);
      const int vs = sch.virtual_stage(r, in.chunk);
      switch (in.op) {
        case Op::forward:
          if (s.fwd[i]) return fmt::format("{}: forward twice", where(r));
          if (vs > 0 && !s.got_act[i]) return fmt::format("{}: forward before its input activation arrived", where(r));
          s.fwd[i] = 1;
          tl.peak_in_flight = std::max(tl.peak_in_flight, ++in_flight[size_t(r)]);
          break;
        case Op::backward:
        case Op::backward_input:
          if (!s.fwd[i]) return fmt::format("{}: backward before forward", where(r));
          if (s.bwd[i]) return fmt::format("{}: backward twice", where(r));
          if (vs + 1 < V && !s.got_grad[i]) return fmt::format("{}: backward before its output gradient arrived", where(r));
          s.bwd[i] = 1;
          if (in.op == Op::backward) --in_flight[size_t(r)];
          break;
        case Op::backward_weight:
          if (!s.bwd[i]) return fmt::format("{}: weight gradient before the input-gradient backward", where(r));
          if (s.wgt[i]) return fmt::format("{}: weight gradient twice", where(r));
          s.wgt[i] = 1;
          --in_flight[size_t(r)];
          break;
        default: break;
      }
    }
    tl.start[pc[size_t(r)]] = clock[size_t(r)];
    clock[size_t(r)] += costs.of(in.op);
    tl.end[pc[size_t(r)]] = clock[size_t(r)];
    if (is_compute(in.op)) tl.busy += costs.of(in.op);
    ++pc[size_t(r)];
    return "";
  };

  size_t left = 0;
  for (int r = 0; r < p; ++r) {
    left += sch.ranks[size_t(r)].size();
    for (size_t k = 0; k < sch.ranks[size_t(r)].size(); ++k) {
      pc[size_t(r)] = k;
      std::string e = static_error(r, sch.ranks[size_t(r)][k]);
      if (!e.empty()) return fail(e);
    }
    pc[size_t(r)] = 0;
  }
  auto done = [&](int r) { return pc[size_t(r)] >= sch.ranks[size_t(r)].size(); };
  auto cur = [&](int r) -> const Instr& { return sch.ranks[size_t(r)][pc[size_t(r)]]; };

  while (left > 0) {
    bool progress = false;
    for (int r = 0; r < p; ++r) {
      while (!done(r) && !is_transfer(cur(r).op)) {
        std::string e = run_local(r);
        if (!e.empty()) return fail(e);
        --left;
        progress = true;
      }
    }
    // Rendezvous: a send at the head of rank a meets a recv at the head of its peer.
    for (int a = 0; a < p; ++a) {
      if (done(a)) continue;
      const Instr& s = cur(a);
      if (s.op != Op::send_act && s.op != Op::send_grad) continue;
      const int b = s.peer;
      if (done(b) || !is_transfer(cur(b).op)) continue;
      const Instr& rv = cur(b);
      if (rv.op != Op::recv_act && rv.op != Op::recv_grad) continue;
      if (rv.peer != a) continue;
      // Same channel (a -> b, one tag): the messages must be the same or the data would be wrong.
      const bool act = s.op == Op::send_act;
      const int dst_vs = act ? sch.virtual_stage(a, s.chunk) + 1 : sch.virtual_stage(a, s.chunk) - 1;
      const bool same = (rv.op == (act ? Op::recv_act : Op::recv_grad)) && rv.mb == s.mb &&
                        sch.virtual_stage(b, rv.chunk) == dst_vs;
      if (!same)
        return fail(fmt::format("{} is received by {}: messages out of order or missing their receive", where(a), where(b)));
      State& sa = st[size_t(a)];
      State& sb = st[size_t(b)];
      if (act && !sa.fwd[sa.ix(s.mb, s.chunk)]) return fail(fmt::format("{}: send before the forward that produces it", where(a)));
      if (!act && !sa.bwd[sa.ix(s.mb, s.chunk)]) return fail(fmt::format("{}: send before the backward that produces it", where(a)));
      uint8_t& sent = act ? sa.sent_act[sa.ix(s.mb, s.chunk)] : sa.sent_grad[sa.ix(s.mb, s.chunk)];
      uint8_t& got = act ? sb.got_act[sb.ix(rv.mb, rv.chunk)] : sb.got_grad[sb.ix(rv.mb, rv.chunk)];
      if (sent || got) return fail(fmt::format("{}: message transferred twice", where(a)));
      sent = got = 1;
      const double t = std::max(clock[size_t(a)], clock[size_t(b)]);
      const double e = t + costs.transfer;
      res.ranks[size_t(a)].start[pc[size_t(a)]] = res.ranks[size_t(b)].start[pc[size_t(b)]] = t;
      res.ranks[size_t(a)].end[pc[size_t(a)]] = res.ranks[size_t(b)].end[pc[size_t(b)]] = e;
      clock[size_t(a)] = clock[size_t(b)] = e;
      ++pc[size_t(a)];
      ++pc[size_t(b)];
      left -= 2;
      progress = true;
    }
    if (!progress) {
      // Deadlock: follow the wait-for edges from a blocked rank to name the cycle.
      int r = 0;
      while (done(r)) ++r;
      std::vector<int> seen(size_t(p), -1), path;
      while (r >= 0 && !done(r) && seen[size_t(r)] < 0) {
        seen[size_t(r)] = int(path.size());
        path.push_back(r);
        r = cur(r).peer;
      }
      std::string msg = "deadlock under blocking transfers: ";
      if (r >= 0 && !done(r) && seen[size_t(r)] >= 0) {
        msg += "cyclic wait";
        for (size_t k = size_t(seen[size_t(r)]); k < path.size(); ++k) msg += fmt::format(", {}", where(path[k]));
        msg += fmt::format(" (waiting on rank {})", r);
      } else {
        for (size_t k = 0; k < path.size(); ++k) msg += fmt::format("{}{}", k ? ", " : "", where(path[k]));
        msg += r >= 0 && done(r) ? fmt::format(", waiting on rank {} which has finished (missing transfer)", r)
                                 : std::string(" (waiting)");
      }
      return fail(msg);
    }
  }
  for (int r = 0; r < p; ++r) {
    const State& s = st[size_t(r)];
    for (int c = 0; c < v; ++c)
      for (int mb = 0; mb < m; ++mb) {
        const size_t i = s.ix(mb, c);
        if (!s.fwd[i] || !s.bwd[i] || (split && !s.wgt[i]))
          return fail(fmt::format("rank {}: (mb {}, c {}) is never {}", r, mb, c,
                                  !s.fwd[i] ? "forwarded" : !s.bwd[i] ? "backwarded" : "given its weight gradient"));
      }
    if (sch.ranks[size_t(r)].empty() || sch.ranks[size_t(r)].back().op != Op::optimizer_step)
      return fail(fmt::format("rank {}: the list does not end with the optimizer step", r));
    res.ranks[size_t(r)].finish = clock[size_t(r)];
    res.makespan = std::max(res.makespan, clock[size_t(r)]);
  }
  res.ok = true;
  if (timing == Timing::eager_sends)
    time_eager(sch, costs.transfer, costs.of(Op::optimizer_step),
               [&](int, size_t, const Instr& in) { return costs.of(in.op); }, res);
  return res;
}

CheckResult replay(const Schedule& sch, const std::vector<std::vector<double>>& compute_seconds) {
  CheckResult res = check(sch, {}, Timing::blocking);
  LOOM_CHECK(res.ok, "pipeline replay: schedule {} p={} v={} m={} is invalid: {}", kind_name(sch.spec.kind), sch.p(),
             sch.v(), sch.m(), res.error);
  LOOM_CHECK(int(compute_seconds.size()) == sch.p(), "pipeline replay: {} ranks of durations for p = {}",
             compute_seconds.size(), sch.p());
  // Index of each instruction among its rank's computes.
  std::vector<std::vector<size_t>> nth(size_t(sch.p()));
  for (int r = 0; r < sch.p(); ++r) {
    size_t k = 0;
    for (const Instr& in : sch.ranks[size_t(r)]) nth[size_t(r)].push_back(is_compute(in.op) ? k++ : 0);
    LOOM_CHECK(compute_seconds[size_t(r)].size() == k, "pipeline replay: rank {} has {} computes but {} durations", r,
               k, compute_seconds[size_t(r)].size());
    for (double d : compute_seconds[size_t(r)])
      LOOM_CHECK(std::isfinite(d) && d >= 0, "pipeline replay: rank {} has a duration of {}", r, d);
  }
  time_eager(sch, 0.0, 0.0,
             [&](int r, size_t i, const Instr&) { return compute_seconds[size_t(r)][nth[size_t(r)][i]]; }, res);
  return res;
}

CheckResult simulate(const Schedule& sch, const RankCosts& costs) {
  CheckResult res = check(sch, {}, Timing::blocking);
  LOOM_CHECK(res.ok, "pipeline simulation: schedule {} p={} v={} m={} is invalid: {}", kind_name(sch.spec.kind),
             sch.p(), sch.v(), sch.m(), res.error);
  const int p = sch.p();
  LOOM_CHECK(int(costs.chunk.size()) == p, "pipeline simulation: costs for {} ranks, the schedule has {}",
             costs.chunk.size(), p);
  for (int r = 0; r < p; ++r) {
    LOOM_CHECK(int(costs.chunk[size_t(r)].size()) == sch.v(), "pipeline simulation: rank {} has costs for {} chunks, not {}",
               r, costs.chunk[size_t(r)].size(), sch.v());
    for (const OpCosts& c : costs.chunk[size_t(r)]) c.validate();
  }
  LOOM_CHECK(std::isfinite(costs.transfer) && costs.transfer >= 0 && std::isfinite(costs.optimizer_step) &&
                 costs.optimizer_step >= 0 && std::isfinite(costs.capacity) && costs.capacity >= 0 && costs.copies >= 1,
             "pipeline simulation: transfer {}, optimizer step {}, capacity {} and copies {} must be finite and "
             "non-negative (copies >= 1)", costs.transfer, costs.optimizer_step, costs.capacity, costs.copies);
  LOOM_CHECK(std::isfinite(costs.balance) && costs.balance >= 0 && std::isfinite(costs.wake) && costs.wake >= 0 &&
                 std::isfinite(costs.crowded_wake) && costs.crowded_wake >= 0,
             "pipeline simulation: balance {} s, wake {} s and crowded_wake {} s must be finite and non-negative",
             costs.balance, costs.wake, costs.crowded_wake);
  auto work_of = [&](int r, const Instr& in) {
    return in.op == Op::optimizer_step ? costs.optimizer_step : costs.chunk[size_t(r)][size_t(in.chunk)].of(in.op);
  };
  if (costs.capacity <= 0) {  // every rank on its own device: the executor's timing as check() gives it
    time_eager(sch, costs.transfer, costs.optimizer_step, [&](int r, size_t, const Instr& in) { return work_of(r, in); },
               res);
    return res;
  }
  // Event simulation. Each rank is computing (remaining work, in seconds at full speed), waiting
  // (for a message, or for its own messages to be received before the optimizer step) or done.
  // The host's cores, as the OS runs threads on them: this pipeline's share of the cores
  // (capacity / copies, as `cores` cores of `core_speed`, a rank never faster than 1) runs the
  // ranks that hold them, each core dividing itself among its own. A rank holds its core from the
  // compute it starts until it sleeps (a receive whose message is not there, or the step's wait
  // for its sends) or its list ends, so a rank going from one compute to the next keeps it. A
  // rank that wakes goes to a core that is idle if there is one (else to the least loaded, its own
  // when tied); a rank keeps its core until an idle core takes it from a shared one, `balance`
  // seconds after both became so (RankCosts).
  const double share = costs.capacity / costs.copies;
  const int cores = std::max(1, int(std::floor(share + 1e-9)));
  const double core_speed = share / cores;
  std::vector<size_t> pc(size_t(p), 0);
  std::vector<double> ready(size_t(p), 0.0), remaining(size_t(p), -1.0), taken(size_t(p), 0.0);
  std::vector<int> unreceived(size_t(p), 0);
  std::vector<int> core(size_t(p), -1);   // the core a rank last ran on
  std::vector<char> slept(size_t(p), 1);  // it slept since its last compute (or has not run): holds no core
  // In a receive it slept in: 0 until its message arrives, then the time it runs again; else -1.
  std::vector<double> resume(size_t(p), -1.0);
  std::vector<double> placed(size_t(p), 0.0);  // when it came to its core
  std::vector<int> on(size_t(cores), 0);       // ranks holding each core
  std::vector<double> idle_since(size_t(cores), 0.0), shared_since(size_t(cores), -1.0);
  std::map<std::pair<int, int>, std::deque<double>> posted;  // (from, to): arrival times, in order
  for (auto& tl : res.ranks) tl.busy = 0;
  double now = 0;
  auto finish = [&](int r, double end) {
    RankTimeline& tl = res.ranks[size_t(r)];
    tl.end[pc[size_t(r)]] = end;
    ready[size_t(r)] = end;
    ++pc[size_t(r)];
  };
  auto holds = [&](int r) {
    return !slept[size_t(r)] && core[size_t(r)] >= 0 && pc[size_t(r)] < sch.ranks[size_t(r)].size();
  };
  auto count = [&] {
    std::fill(on.begin(), on.end(), 0);
    for (int r = 0; r < p; ++r)
      if (holds(r)) ++on[size_t(core[size_t(r)])];
  };
  // When each core became idle or shared (from `on`, as count() left it).
  auto mark = [&] {
    for (int k = 0; k < cores; ++k) {
      if (on[size_t(k)] > 0) idle_since[size_t(k)] = -1;
      else if (idle_since[size_t(k)] < 0) idle_since[size_t(k)] = now;
      if (on[size_t(k)] < 2) shared_since[size_t(k)] = -1;
      else if (shared_since[size_t(k)] < 0) shared_since[size_t(k)] = now;
    }
  };
  // Starts rank r's compute: a rank that slept wakes on an idle core if there is one.
  auto start = [&](int r) {
    if (slept[size_t(r)]) {
      count();
      int& c = core[size_t(r)];
      int best = c < 0 ? 0 : c;
      for (int k = 0; k < cores; ++k)
        if (on[size_t(k)] < on[size_t(best)]) best = k;
      if (c != best) c = best, placed[size_t(r)] = now;
      slept[size_t(r)] = 0;
    }
  };
  for (;;) {
    // Run every rank's non-compute instructions that can happen now, and start its next compute.
    // (Repeated until nothing moves: a receive lets its sender's optimizer step go.)
    double wake = std::numeric_limits<double>::infinity();  // the next time a waiting rank can go on
    for (bool moved = true; moved;) {
      moved = false;
      for (int r = 0; r < p; ++r) {
      const auto& list = sch.ranks[size_t(r)];
      RankTimeline& tl = res.ranks[size_t(r)];
      while (remaining[size_t(r)] < 0 && pc[size_t(r)] < list.size()) {
        const Instr& in = list[pc[size_t(r)]];
        tl.start[pc[size_t(r)]] = ready[size_t(r)];
        if (in.op == Op::send_act || in.op == Op::send_grad) {
          posted[{r, in.peer}].push_back(now + costs.transfer);
          ++unreceived[size_t(r)];
          finish(r, now);
          moved = true;
        } else if (in.op == Op::recv_act || in.op == Op::recv_grad) {
          auto& q = posted[{in.peer, r}];
          // Not sent yet, or on its way: the rank sleeps, and runs again a wake-up after the
          // message arrives (its duration as the cores are when it arrives).
          if (q.empty() || q.front() > now) {
            if (!slept[size_t(r)]) slept[size_t(r)] = 1, moved = true;
            resume[size_t(r)] = 0;
            if (!q.empty()) wake = std::min(wake, q.front());
            break;
          }
          if (resume[size_t(r)] == 0) {
            count();
            const bool idle = std::find(on.begin(), on.end(), 0) != on.end();
            resume[size_t(r)] = now + (idle ? costs.wake : costs.crowded_wake);
          }
          if (resume[size_t(r)] > now) {
            wake = std::min(wake, resume[size_t(r)]);
            break;
          }
          resume[size_t(r)] = -1;
          q.pop_front();
          taken[size_t(in.peer)] = std::max(taken[size_t(in.peer)], now);
          --unreceived[size_t(in.peer)];
          finish(r, now);
          moved = true;
        } else {
          if (in.op == Op::optimizer_step && unreceived[size_t(r)] > 0) {  // its sends are waited for first
            if (!slept[size_t(r)]) slept[size_t(r)] = 1, moved = true;
            break;
          }
          start(r);
          tl.start[pc[size_t(r)]] = now;
          remaining[size_t(r)] = work_of(r, in);
          moved = true;
        }
      }
      }
    }
    bool left = false;
    for (int r = 0; r < p; ++r)
      if (pc[size_t(r)] < sch.ranks[size_t(r)].size()) left = true;
    if (!left) break;
    // The cores as the instructions left them (every rank holding one now computes): when each
    // became idle or shared; an idle core takes the rank that came last to a shared one, `balance`
    // after both became so.
    count();
    mark();
    double next = wake;
    for (bool again = true; again;) {
      again = false;
      for (int i = 0; i < cores && !again; ++i) {
        if (on[size_t(i)] > 0) continue;
        for (int j = 0; j < cores && !again; ++j) {
          if (on[size_t(j)] < 2) continue;
          const double at = std::max(idle_since[size_t(i)], shared_since[size_t(j)]) + costs.balance;
          if (at > now) {
            next = std::min(next, at);
            continue;
          }
          int last = -1;
          for (int r = 0; r < p; ++r)
            if (holds(r) && core[size_t(r)] == j && (last < 0 || placed[size_t(r)] >= placed[size_t(last)])) last = r;
          core[size_t(last)] = i;
          placed[size_t(last)] = now;
          count();
          mark();
          again = true;
        }
      }
    }
    auto speed = [&](int r) { return std::min(1.0, core_speed / on[size_t(core[size_t(r)])]); };
    for (int r = 0; r < p; ++r)
      if (remaining[size_t(r)] >= 0) next = std::min(next, now + remaining[size_t(r)] / speed(r));
    LOOM_CHECK(std::isfinite(next), "pipeline simulation: {} p={} v={} m={} stalls although it is valid",
               kind_name(sch.spec.kind), p, sch.v(), sch.m());
    const double dt = next - now;
    now = next;
    std::vector<int> done;
    for (int r = 0; r < p; ++r) {
      if (remaining[size_t(r)] < 0) continue;
      remaining[size_t(r)] -= dt * speed(r);
      const Instr& in = sch.ranks[size_t(r)][pc[size_t(r)]];
      if (remaining[size_t(r)] <= 1e-12 * std::max(1.0, work_of(r, in))) done.push_back(r);
    }
    for (int r : done) {
      res.ranks[size_t(r)].busy += now - res.ranks[size_t(r)].start[pc[size_t(r)]];
      remaining[size_t(r)] = -1;
      finish(r, now);
    }
  }
  res.makespan = 0;
  for (int r = 0; r < p; ++r) {
    res.ranks[size_t(r)].finish = ready[size_t(r)];
    res.makespan = std::max(res.makespan, ready[size_t(r)]);
  }
  return res;
}

CheckResult check_or_throw(const Schedule& sch, const OpCosts& costs, Timing timing) {
  CheckResult r = check(sch, costs, timing);
  LOOM_CHECK(r.ok, "pipeline schedule {} p={} v={} m={} is invalid: {}", kind_name(sch.spec.kind), sch.p(), sch.v(),
             sch.m(), r.error);
  return r;
}

}  // namespace loom::parallel::pipeline

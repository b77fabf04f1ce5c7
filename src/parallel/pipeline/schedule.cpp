#include "parallel/pipeline/schedule.h"

#include <algorithm>
#include <cmath>
#include <fmt/format.h>
#include <limits>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "core/error.h"
#include "parallel/pipeline/checker.h"

namespace loom::parallel::pipeline {

std::string_view kind_name(Kind k) {
  switch (k) {
    case Kind::gpipe: return "gpipe";
    case Kind::one_f_one_b: return "1f1b";
    case Kind::interleaved: return "interleaved";
    case Kind::zb_h1: return "zb-h1";
  }
  return "?";
}

Kind parse_kind(std::string_view s, std::string_view field) {
  for (Kind k : {Kind::gpipe, Kind::one_f_one_b, Kind::interleaved, Kind::zb_h1})
    if (s == kind_name(k)) return k;
  throw Error(fmt::format("{}: unknown pipeline schedule '{}' (expected gpipe, 1f1b, interleaved or zb-h1)", field, s));
}

std::string_view op_name(Op op) {
  switch (op) {
    case Op::forward: return "F";
    case Op::backward: return "B";
    case Op::backward_input: return "Bi";
    case Op::backward_weight: return "W";
    case Op::send_act: return "send_act";
    case Op::recv_act: return "recv_act";
    case Op::send_grad: return "send_grad";
    case Op::recv_grad: return "recv_grad";
    case Op::optimizer_step: return "step";
  }
  return "?";
}

bool is_compute(Op op) {
  return op == Op::forward || op == Op::backward || op == Op::backward_input || op == Op::backward_weight;
}
bool is_transfer(Op op) {
  return op == Op::send_act || op == Op::recv_act || op == Op::send_grad || op == Op::recv_grad;
}

std::string to_string(const Instr& in) {
  if (in.op == Op::optimizer_step) return "step";
  std::string s = fmt::format("{}(mb {}, c {})", op_name(in.op), in.mb, in.chunk);
  if (in.op == Op::send_act || in.op == Op::send_grad) s += fmt::format(" -> {}", in.peer);
  if (in.op == Op::recv_act || in.op == Op::recv_grad) s += fmt::format(" <- {}", in.peer);
  return s;
}

std::string Schedule::str() const {
  std::string out;
  for (size_t r = 0; r < ranks.size(); ++r) {
    out += fmt::format("rank {}:", r);
    for (const Instr& in : ranks[r]) {
      out += ' ';
      out += to_string(in);
    }
    out += "\n";
  }
  return out;
}

double OpCosts::of(Op op) const {
  switch (op) {
    case Op::forward: return forward;
    case Op::backward: return backward;
    case Op::backward_input: return backward_input;
    case Op::backward_weight: return backward_weight;
    case Op::optimizer_step: return optimizer_step;
    default: return transfer;
  }
}

void OpCosts::validate() const {
  const std::pair<const char*, double> compute[] = {
      {"forward", forward}, {"backward", backward}, {"backward_input", backward_input},
      {"backward_weight", backward_weight}};
  for (const auto& [name, v] : compute)
    LOOM_CHECK(std::isfinite(v) && v > 0, "pipeline schedule costs: {} must be a positive number, got {}", name, v);
  LOOM_CHECK(std::isfinite(transfer) && transfer >= 0, "pipeline schedule costs: transfer must be >= 0, got {}",
             transfer);
  LOOM_CHECK(std::isfinite(optimizer_step) && optimizer_step >= 0,
             "pipeline schedule costs: optimizer_step must be >= 0, got {}", optimizer_step);
}

void ScheduleSpec::validate() const {
  LOOM_REQUIRE(stages >= 1, "pipeline schedule: stages (p) must be >= 1, got {}", stages);
  LOOM_REQUIRE(micro_batches >= 1, "pipeline schedule: micro_batches (m) must be >= 1, got {}", micro_batches);
  LOOM_REQUIRE(virtual_stages >= 1, "pipeline schedule: virtual_stages (v) must be >= 1, got {}", virtual_stages);
  if (kind == Kind::interleaved) {
    LOOM_REQUIRE(virtual_stages > 1, "pipeline schedule: interleaved needs virtual_stages (v) > 1, got {}",
               virtual_stages);
    LOOM_REQUIRE(stages > 1, "pipeline schedule: interleaved needs stages (p) > 1, got {}", stages);
    LOOM_REQUIRE(micro_batches % stages == 0,
               "pipeline schedule: interleaved needs micro_batches (m = {}) divisible by stages (p = {})",
               micro_batches, stages);
  } else {
    LOOM_REQUIRE(virtual_stages == 1, "pipeline schedule: {} needs virtual_stages (v) = 1, got {} (only interleaved "
               "uses more than one chunk per rank)", kind_name(kind), virtual_stages);
  }
  LOOM_REQUIRE(micro_batches <= 4096 && stages <= 4096 && virtual_stages <= 4096,
             "pipeline schedule: p = {}, v = {} or m = {} is too large (at most 4096 each)", stages, virtual_stages,
             micro_batches);
  LOOM_REQUIRE(int64_t(stages) * virtual_stages * micro_batches <= (int64_t(1) << 24),
             "pipeline schedule: p x v x m = {} x {} x {} is too large (at most 2^24 chunks of micro-batches)", stages,
             virtual_stages, micro_batches);
}

namespace {

// A compute instruction with its virtual stage and its place on the rank's timeline.
struct Timed {
  Instr in;
  int vs = 0;
  double start = 0, end = 0;
};

// Dependency classes: forward, input-gradient backward (B or Bi), weight gradient.
int dep_class(Op op) { return op == Op::forward ? 0 : op == Op::backward_weight ? 2 : 1; }

struct EndTimes {
  int m, V;
  std::vector<double> t;  // [3][V][m], +inf until done
  EndTimes(int m_, int V_) : m(m_), V(V_), t(size_t(3 * V_ * m_), std::numeric_limits<double>::infinity()) {}
  double& at(int cls, int vs, int mb) { return t[size_t((cls * V + vs) * m + mb)]; }
};

// When the inputs of a compute on virtual stage vs are ready (+inf: not yet produced).
double ready_time(EndTimes& e, Op op, int vs, int mb) {
  if (op == Op::forward) return vs == 0 ? 0.0 : e.at(0, vs - 1, mb);
  if (op == Op::backward_weight) return e.at(1, vs, mb);
  double r = e.at(0, vs, mb);
  if (vs + 1 < e.V) r = std::max(r, e.at(1, vs + 1, mb));
  return r;
}

// Compute order per rank (virtual stage filled in later).
std::vector<std::vector<Instr>> fixed_orders(const ScheduleSpec& s) {
  const int p = s.stages, v = s.virtual_stages, m = s.micro_batches;
  std::vector<std::vector<Instr>> out(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    auto& o = out[size_t(r)];
    if (s.kind == Kind::gpipe) {
      for (int i = 0; i < m; ++i) o.push_back({Op::forward, i, 0, -1});
      for (int i = 0; i < m; ++i) o.push_back({Op::backward, i, 0, -1});
    } else if (s.kind == Kind::one_f_one_b) {
      const int warm = std::min(p - r - 1, m);
      for (int i = 0; i < warm; ++i) o.push_back({Op::forward, i, 0, -1});
      for (int i = 0; i < m - warm; ++i) {
        o.push_back({Op::forward, warm + i, 0, -1});
        o.push_back({Op::backward, i, 0, -1});
      }
      for (int i = m - warm; i < m; ++i) o.push_back({Op::backward, i, 0, -1});
    } else if (s.kind == Kind::zb_h1) {
      // ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1): 1F1B's warm-up
      // forwards and forward / input-gradient pairs, with rank r's weight passes delayed by r
      // micro-batches: after each input-gradient pass a weight pass runs only while more than r
      // are pending, and the last r run at the end, where they fill the cool-down's bubbles. Every
      // rank then holds up to p micro-batches between forward and weight pass (min(p, m)): rank
      // 0's 1F1B count, the schedule's peak unchanged; the bubble is about a third of 1F1B's at
      // equal forward, input and weight costs ((p - 1)(F + B - W) against (p - 1)(F + B + W)).
      const int warm = std::min(p - r - 1, m);
      int nb = 0, nw = 0;
      auto input_grad = [&] {
        o.push_back({Op::backward_input, nb++, 0, -1});
        if (nb - nw > r) o.push_back({Op::backward_weight, nw++, 0, -1});
      };
      for (int i = 0; i < warm; ++i) o.push_back({Op::forward, i, 0, -1});
      for (int i = 0; i < m - warm; ++i) {
        o.push_back({Op::forward, warm + i, 0, -1});
        input_grad();
      }
      while (nb < m) input_grad();
      while (nw < m) o.push_back({Op::backward_weight, nw++, 0, -1});
    } else {  // interleaved (Megatron's order of virtual micro-batches)
      const int total = m * v;
      // (Megatron-LM ran every forward first on every rank when m == p; since its 2024 schedule
      // tables only the ranks this count reaches do, with the same bubble and fewer micro-batches
      // held on the later ranks.)
      const int warm = std::min((p - r - 1) * 2 + (v - 1) * p, total);
      auto fwd = [&](int k) {
        return Instr{Op::forward, (k / (p * v)) * p + k % p, (k % (p * v)) / p, -1};
      };
      auto bwd = [&](int k) {
        return Instr{Op::backward, (k / (p * v)) * p + k % p, v - 1 - (k % (p * v)) / p, -1};
      };
      for (int k = 0; k < warm; ++k) o.push_back(fwd(k));
      for (int k = 0; k < total - warm; ++k) {
        o.push_back(fwd(warm + k));
        o.push_back(bwd(k));
      }
      for (int k = total - warm; k < total; ++k) o.push_back(bwd(k));
    }
  }
  return out;
}

// Times a fixed compute order as a data flow (transfers free, a rank runs one op at a time).
std::vector<std::vector<Timed>> time_orders(const Schedule& sch, const std::vector<std::vector<Instr>>& orders,
                                            const OpCosts& c) {
  const int p = sch.p(), m = sch.m();
  EndTimes e(m, sch.num_virtual_stages());
  std::vector<std::vector<Timed>> out(static_cast<size_t>(p));
  std::vector<size_t> pc(size_t(p), 0);
  std::vector<double> free(size_t(p), 0.0);
  size_t left = 0;
  for (auto& o : orders) left += o.size();
  while (left > 0) {
    bool progress = false;
    for (int r = 0; r < p; ++r) {
      auto& o = orders[size_t(r)];
      while (pc[size_t(r)] < o.size()) {
        const Instr& in = o[pc[size_t(r)]];
        const int vs = sch.virtual_stage(r, in.chunk);
        double ready = ready_time(e, in.op, vs, in.mb);
        if (ready == std::numeric_limits<double>::infinity()) break;
        Timed t{in, vs, std::max(ready, free[size_t(r)]), 0};
        t.end = t.start + c.of(in.op);
        free[size_t(r)] = t.end;
        e.at(dep_class(in.op), vs, in.mb) = t.end;
        out[size_t(r)].push_back(t);
        ++pc[size_t(r)];
        --left;
        progress = true;
      }
    }
    LOOM_CHECK(progress, "pipeline schedule: the {} compute order for p={} v={} m={} cannot make progress",
               kind_name(sch.spec.kind), p, sch.v(), m);
  }
  return out;
}

// Transfers placed from the planned compute times: every cross-rank dependency is listed on both
// ranks at one rendezvous time tau chosen from the plan.
std::vector<std::vector<Instr>> placed_by_plan(const Schedule& sch, const std::vector<std::vector<Timed>>& timed) {
  const int p = sch.p(), V = sch.num_virtual_stages();
  // All ranks list their transfers in the same global order (tau, then message id), so
  // blocking transfers cannot wait on each other in a cycle. tau is the planned time in
  // [producer's end, consumer's start] at which the two ranks wait least for each other (ideally
  // both between computes).
  struct Item {
    double time;
    int cls;  // 0 transfer, 1 compute (a transfer at the same time goes first)
    std::tuple<int, int, int> id;  // transfers: (kind, mb, consumer virtual stage)
    Instr in;
  };
  EndTimes ends(sch.m(), V);
  for (int r = 0; r < p; ++r)
    for (const Timed& t : timed[size_t(r)]) ends.at(dep_class(t.in.op), t.vs, t.in.mb) = t.end;
  // How long rank r still computes after time x (0 at a boundary or in a gap; computes are
  // sorted and do not overlap).
  auto busy_after = [&](int r, double x) {
    const auto& tl = timed[size_t(r)];
    auto it = std::upper_bound(tl.begin(), tl.end(), x, [](double v, const Timed& t) { return v < t.start; });
    if (it == tl.begin() || std::prev(it)->start == x) return 0.0;
    return std::max(0.0, std::prev(it)->end - x);
  };
  // The time in [lo, hi] whose rendezvous makes the two ranks wait least (earliest on ties).
  auto rendezvous = [&](int a, int b, double lo, double hi) {
    std::vector<double> cand{lo, hi};
    for (int r : {a, b})
      for (const Timed& t : timed[size_t(r)]) {
        if (t.start > lo && t.start < hi) cand.push_back(t.start);
        if (t.end > lo && t.end < hi) cand.push_back(t.end);
      }
    std::sort(cand.begin(), cand.end());
    double best = hi, best_wait = std::numeric_limits<double>::infinity();
    for (double x : cand) {
      const double wait = std::max(busy_after(a, x), busy_after(b, x));
      if (wait < best_wait) {
        best_wait = wait;
        best = x;
      }
      if (wait == 0) break;
    }
    return best;
  };
  std::vector<std::vector<Item>> items(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    double prev_end = 0;  // end of the rank's previous compute
    for (const Timed& t : timed[size_t(r)]) {
      items[size_t(r)].push_back({t.start, 1, {0, 0, 0}, t.in});
      const double after = std::exchange(prev_end, t.end);
      if (p == 1) continue;
      if (t.in.op == Op::forward && t.vs > 0) {
        const int src = t.vs - 1, q = sch.rank_of(src);
        // Not before the consumer's previous compute ends: the executor takes the micro-batch's
        // activation slot at the receive, so an earlier receive would exceed the in-flight bound.
        const double tau = rendezvous(q, r, std::max(ends.at(0, src, t.in.mb), after), t.start);
        items[size_t(q)].push_back({tau, 0, {0, t.in.mb, t.vs}, {Op::send_act, t.in.mb, sch.chunk_of(src), r}});
        items[size_t(r)].push_back({tau, 0, {0, t.in.mb, t.vs}, {Op::recv_act, t.in.mb, t.in.chunk, q}});
      }
      if ((t.in.op == Op::backward || t.in.op == Op::backward_input) && t.vs + 1 < V) {
        const int src = t.vs + 1, q = sch.rank_of(src);
        const double tau = rendezvous(q, r, ends.at(1, src, t.in.mb), t.start);
        items[size_t(q)].push_back({tau, 0, {1, t.in.mb, t.vs}, {Op::send_grad, t.in.mb, sch.chunk_of(src), r}});
        items[size_t(r)].push_back({tau, 0, {1, t.in.mb, t.vs}, {Op::recv_grad, t.in.mb, t.in.chunk, q}});
      }
    }
  }
  std::vector<std::vector<Instr>> ranks(static_cast<size_t>(p));
  for (int r = 0; r < p; ++r) {
    auto& it = items[size_t(r)];
    std::stable_sort(it.begin(), it.end(), [](const Item& a, const Item& b) {
      return std::tie(a.time, a.cls, a.id) < std::tie(b.time, b.cls, b.id);
    });
    for (const Item& x : it) ranks[size_t(r)].push_back(x.in);
    ranks[size_t(r)].push_back({Op::optimizer_step, -1, -1, -1});
  }
  return ranks;
}


// Transfers placed by simulating the blocking execution of the compute order: time advances from
// event to event; at each instant, every produced message whose two ranks are both between
// computes is exchanged (in message-id order), then each free rank starts its next compute if
// its inputs have arrived. A message is thus listed on both ranks at the instant it really
// happens, so the lists follow one global order (deadlock-free) and a rank never blocks on a peer
// that is computing. Plans drift from real times once a rendezvous waits; this follows them.
std::vector<std::vector<Instr>> placed_by_simulation(const Schedule& sch,
                                                     const std::vector<std::vector<Timed>>& timed,
                                                     const OpCosts& c) {
  const int p = sch.p(), m = sch.m(), V = sch.num_virtual_stages();
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<Instr>> ranks(static_cast<size_t>(p));
  // arrived[cls][vs][mb]: the input of class cls (0 activation, 1 gradient) of (vs, mb) is here.
  std::vector<uint8_t> arrived(size_t(2 * V * m), 0), done(size_t(3 * V * m), 0);
  auto arr = [&](int cls, int vs, int mb) -> uint8_t& { return arrived[size_t((cls * V + vs) * m + mb)]; };
  auto fin = [&](int cls, int vs, int mb) -> uint8_t& { return done[size_t((cls * V + vs) * m + mb)]; };
  struct Msg {
    std::tuple<int, int, int> id;  // (kind, mb, consumer virtual stage)
    int from, to;
  };
  std::vector<Msg> pending;
  std::vector<size_t> pc(size_t(p), 0);
  std::vector<double> busy_until(size_t(p), 0.0);
  struct Running {
    int vs = -1;
    Instr in;
  };
  std::vector<Running> running(static_cast<size_t>(p));
  auto ready = [&](int r, const Instr& in, int vs) {
    if (in.op == Op::forward) return vs == 0 || (sch.rank_of(vs - 1) == r ? fin(0, vs - 1, in.mb) : arr(0, vs, in.mb));
    if (in.op == Op::backward_weight) return bool(fin(1, vs, in.mb));
    if (!fin(0, vs, in.mb)) return false;
    if (vs + 1 >= V) return true;
    return bool(sch.rank_of(vs + 1) == r ? fin(1, vs + 1, in.mb) : arr(1, vs, in.mb));
  };
  double t = 0;
  size_t left = 0;
  for (auto& o : timed) left += o.size();
  while (left > 0 || !pending.empty()) {
    // Computes ending now produce their messages.
    for (int r = 0; r < p; ++r) {
      Running& run = running[size_t(r)];
      if (run.vs < 0 || busy_until[size_t(r)] > t) continue;
      const Instr& in = run.in;
      fin(dep_class(in.op), run.vs, in.mb) = 1;
      if (in.op == Op::forward && run.vs + 1 < V && sch.rank_of(run.vs + 1) != r)
        pending.push_back({{0, in.mb, run.vs + 1}, r, sch.rank_of(run.vs + 1)});
      if (in.op != Op::forward && in.op != Op::backward_weight && run.vs > 0 && sch.rank_of(run.vs - 1) != r)
        pending.push_back({{1, in.mb, run.vs - 1}, r, sch.rank_of(run.vs - 1)});
      run.vs = -1;
    }
    auto is_free = [&](int r) { return busy_until[size_t(r)] <= t; };
    std::sort(pending.begin(), pending.end(), [](const Msg& a, const Msg& b) { return a.id < b.id; });
    std::vector<Msg> keep;
    // An activation is received only when its forward is the consumer's next compute: the
    // executor takes the micro-batch's activation slot at the receive, so receiving earlier would
    // hold more micro-batches than the checker's in-flight bound.
    auto wanted = [&](const Msg& msg) {
      if (std::get<0>(msg.id) != 0) return true;
      const auto& o = timed[size_t(msg.to)];
      const size_t k = pc[size_t(msg.to)];
      return k < o.size() && o[k].in.op == Op::forward && o[k].in.mb == std::get<1>(msg.id) &&
             o[k].vs == std::get<2>(msg.id);
    };
    for (const Msg& msg : pending) {
      if (!is_free(msg.from) || !is_free(msg.to) || !wanted(msg)) {
        keep.push_back(msg);
        continue;
      }
      const auto [kind, mb, vs] = msg.id;
      const int src = kind == 0 ? vs - 1 : vs + 1;
      ranks[size_t(msg.from)].push_back({kind == 0 ? Op::send_act : Op::send_grad, mb, sch.chunk_of(src), msg.to});
      ranks[size_t(msg.to)].push_back({kind == 0 ? Op::recv_act : Op::recv_grad, mb, sch.chunk_of(vs), msg.from});
      arr(kind, vs, mb) = 1;
    }
    pending.swap(keep);
    bool started = false;
    for (int r = 0; r < p; ++r) {
      if (!is_free(r) || pc[size_t(r)] >= timed[size_t(r)].size()) continue;
      const Timed& tm = timed[size_t(r)][pc[size_t(r)]];
      if (!ready(r, tm.in, tm.vs)) continue;
      ranks[size_t(r)].push_back(tm.in);
      running[size_t(r)] = {tm.vs, tm.in};
      busy_until[size_t(r)] = t + c.of(tm.in.op);
      ++pc[size_t(r)];
      --left;
      started = true;
    }
    double next = inf;
    for (int r = 0; r < p; ++r)
      if (busy_until[size_t(r)] > t) next = std::min(next, busy_until[size_t(r)]);
    if (next == inf) {
      // Nothing runs: either zero-cost computes finished now (go round again) or no progress.
      bool any_running = false;
      for (const Running& run : running) any_running |= run.vs >= 0;
      LOOM_CHECK(started || any_running, "pipeline schedule: {} p={} v={} m={}: simulated transfers cannot make "
                 "progress", kind_name(sch.spec.kind), p, sch.v(), m);
      continue;
    }
    t = next;
  }
  for (auto& o : ranks) o.push_back({Op::optimizer_step, -1, -1, -1});
  return ranks;
}

// For the executor's non-blocking sends: each send moves up past the computes before it (not
// past its producer, another transfer or the step), so the message leaves as soon as it exists;
// each receive moves down past the computes that do not need it, so the rank does not wait for a
// message before work that does not use it. Transfers keep their order on every rank, so the
// lists stay deadlock-free under blocking transfers as well.
void move_transfers(std::vector<std::vector<Instr>>& ranks) {
  // Whether compute c is where transfer t's data is made (a send) or used (a receive): the forward
  // of the same (mb, chunk) for activations, its input-gradient backward for gradients.
  auto holds = [](const Instr& c, const Instr& t) {
    if (c.mb != t.mb || c.chunk != t.chunk) return false;
    const bool act = t.op == Op::send_act || t.op == Op::recv_act;
    return act ? c.op == Op::forward : (c.op == Op::backward || c.op == Op::backward_input);
  };
  for (auto& list : ranks) {
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i].op != Op::send_act && list[i].op != Op::send_grad) continue;
      size_t j = i;
      while (j > 0 && is_compute(list[j - 1].op) && !holds(list[j - 1], list[j])) {
        std::swap(list[j - 1], list[j]);
        --j;
      }
    }
    for (size_t i = list.size(); i-- > 0;) {
      if (list[i].op != Op::recv_act && list[i].op != Op::recv_grad) continue;
      size_t j = i;
      while (j + 1 < list.size() && is_compute(list[j + 1].op) && !holds(list[j + 1], list[j])) {
        std::swap(list[j], list[j + 1]);
        ++j;
      }
    }
  }
}

}  // namespace

std::vector<std::pair<int, int>> split_peaks_of(const std::vector<Instr>& list) {
  std::set<std::pair<int, int>> all;  // (distinct: at most p x p of them)
  int n = 0, q = 0;
  for (const Instr& in : list) {
    if (in.op == Op::forward) ++n;
    else if (in.op == Op::backward_input) ++q;
    else if (in.op == Op::backward_weight) --n, --q;
    else continue;
    if (in.op != Op::backward_weight) all.insert({n, q});
  }
  std::vector<std::pair<int, int>> out;
  for (const auto& a : all) {
    bool exceeded = false;
    for (const auto& b : all) exceeded |= b != a && b.first >= a.first && b.second >= a.second;
    if (!exceeded) out.push_back(a);
  }
  return out;
}

Schedule generate(const ScheduleSpec& spec, const OpCosts& costs) {
  spec.validate();
  costs.validate();
  Schedule sch;
  sch.spec = spec;
  std::vector<std::vector<Timed>> timed = time_orders(sch, fixed_orders(spec), costs);
  // Two placements of the transfers (then moved for non-blocking sends); the checker times both
  // as the executor runs them (the same costs) and the shorter
  // valid one is kept (the plan's on ties).
  sch.ranks = placed_by_plan(sch, timed);
  if (spec.stages == 1) return sch;
  move_transfers(sch.ranks);
  Schedule alt = sch;
  try {
    alt.ranks = placed_by_simulation(sch, timed, costs);
  } catch (const Error&) {
    return sch;  // a simulation that cannot finish: the plan's placement stands (callers check it)
  }
  move_transfers(alt.ranks);
  const CheckResult a = check(sch, costs), b = check(alt, costs);
  if (b.ok && (!a.ok || b.makespan < a.makespan)) return alt;
  return sch;
}

}  // namespace loom::parallel::pipeline

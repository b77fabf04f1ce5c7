#include "comm/threads.h"
#include "core/threads.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <optional>
#include <system_error>
#include <thread>

#include <fmt/ranges.h>

#include "comm/reduce.h"
#include "core/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define LOOM_CPU_RELAX() _mm_pause()
#else
#define LOOM_CPU_RELAX() std::this_thread::yield()
#endif

namespace loom::comm {

using Clock = std::chrono::steady_clock;

namespace detail {

struct ThreadWorldState {
  explicit ThreadWorldState(int n) : size(n) {}
  const int size;
  std::atomic<int> failed{-1};
  std::mutex mu;
  std::string failure;  // written once, before `failed` is set

  void fail(int rank, const std::string& what) {
    std::lock_guard lk(mu);
    if (failed.load() >= 0) return;
    failure = what;
    failed.store(rank);
  }
};

enum class Op : uint8_t { all_reduce, reduce_scatter, all_gather, broadcast, barrier, split };

std::string_view op_name(Op op) {
  switch (op) {
    case Op::all_reduce: return "all_reduce";
    case Op::reduce_scatter: return "reduce_scatter";
    case Op::all_gather: return "all_gather";
    case Op::broadcast: return "broadcast";
    case Op::barrier: return "barrier";
    case Op::split: return "split";
  }
  return "?";
}

// What a rank passed to a collective; written by its owner before it publishes `arrived`.
struct Desc {
  Op op = Op::barrier;
  DType dt = DType::f32;
  ReduceOp rop = ReduceOp::sum;
  int64_t count = 0;
  int root = 0;
  int color = 0;
  int key = 0;
  const void* send = nullptr;
  void* recv = nullptr;
  const int64_t* counts = nullptr;  // [group size] for the _v collectives
  std::shared_ptr<ThreadGroup> created;  // split: the new group, set by its leader
};

// One rank's synchronisation state in a group. Counters hold the sequence number of the last
// collective that reached the phase; descriptors alternate by parity, which is enough because
// no rank can be two collectives ahead of a rank that still reads its descriptor.
struct alignas(64) Slot {
  std::atomic<uint64_t> arrived{0};
  alignas(64) std::atomic<uint64_t> ready{0};  // all_reduce: own chunk reduced; split: group made
  alignas(64) std::atomic<uint64_t> done{0};   // finished reading the others' buffers
  std::atomic<uint64_t> aborted{0};            // left a collective with an error (sequence)
  std::string abort_reason;                    // written once, before `aborted`
  Desc desc[2];
};

enum MsgState : int { kPosted = 0, kTaken = 1, kDelivered = 2, kRejected = 3 };

struct Msg {
  int src = 0;
  int tag = 0;
  DType dt = DType::f32;
  int64_t count = 0;
  const void* data = nullptr;
  std::atomic<int> state{kPosted};
  std::string error;  // set by the receiver before kRejected
};

struct Mailbox {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Msg*> queue;  // posted, not yet taken
};

struct ThreadGroup {
  ThreadGroup(std::shared_ptr<ThreadWorldState> w, std::vector<int> ranks)
      : world(std::move(w)),
        world_ranks(std::move(ranks)),
        slots(new Slot[world_ranks.size()]),
        boxes(new Mailbox[world_ranks.size()]) {}

  int size() const { return int(world_ranks.size()); }

  // Wakes the ranks sleeping on this group's collectives (cheap when none sleeps).
  void notify() {
    if (sleepers.load() > 0) {
      std::lock_guard lk(mu);
      cv.notify_all();
    }
  }

  std::shared_ptr<ThreadWorldState> world;
  std::vector<int> world_ranks;  // group rank -> world rank
  std::unique_ptr<Slot[]> slots;
  std::unique_ptr<Mailbox[]> boxes;
  std::mutex mu;  // only for sleeping and waking, never held while data moves
  std::condition_variable cv;
  std::atomic<int> sleepers{0};
};

}  // namespace detail

namespace {

using detail::Desc;
using detail::Msg;
using detail::Op;
using detail::Slot;
using detail::ThreadGroup;

constexpr int kSpin = 256;
constexpr int kYield = 32;
constexpr auto kSlice = std::chrono::milliseconds(20);  // failure checks while asleep
constexpr int64_t kBlock = 2048;                        // elements reduced per pass (8 KiB f32)

std::string seconds(std::chrono::milliseconds t) { return fmt::format("{:g} s", t.count() / 1000.0); }

std::string rank_list(const std::vector<int>& r) {
  std::string s;
  for (size_t i = 0; i < r.size(); ++i) s += (i ? ", " : "") + std::to_string(r[i]);
  return s;
}

class ThreadComm final : public Comm {
 public:
  ThreadComm(std::shared_ptr<ThreadGroup> g, int rank, CommOptions opts)
      : Comm(opts), g_(std::move(g)), rank_(rank) {}

  int rank() const override { return rank_; }
  int size() const override { return g_->size(); }
  std::string_view backend() const override { return "threads"; }
  int world_rank() const override { return g_->world_ranks[size_t(rank_)]; }

 protected:
  void do_all_reduce(void* buf, int64_t count, DType dt, ReduceOp op) override;
  void do_reduce_scatter(const void* send, void* recv, std::span<const int64_t> counts, DType dt,
                         ReduceOp op) override;
  void do_all_gather(const void* send, void* recv, std::span<const int64_t> counts,
                     DType dt) override;
  void do_broadcast(void* buf, int64_t count, DType dt, int root) override;
  void do_send(const void* buf, int64_t count, DType dt, int dst, int tag) override;
  void do_recv(void* buf, int64_t count, DType dt, int src, int tag) override;
  std::unique_ptr<PendingSend> do_isend(const void* buf, int64_t count, DType dt, int dst, int tag) override;
  void do_sendrecv(const void* send_buf, int64_t send_count, int dst, void* recv_buf,
                   int64_t recv_count, int src, DType dt, int tag) override;
  void do_barrier() override;
  std::unique_ptr<Comm> do_split(int color, int key) override;

 private:
  Slot& slot(int r) const { return g_->slots[size_t(r)]; }
  int wr(int r) const { return g_->world_ranks[size_t(r)]; }
  const Desc& desc(int r, uint64_t seq) const { return slot(r).desc[seq & 1]; }

  void check_usable(std::string_view call) const {
    LOOM_CHECK(!broken_, "threads comm: {} on rank {}: the communicator is unusable after an "
               "earlier error", call, world_rank());
  }

  [[noreturn]] void throw_failed(std::string_view what) const {
    auto& w = *g_->world;
    throw Error(fmt::format("threads comm: {} on rank {} stopped because rank {} failed: {}", what,
                            world_rank(), w.failed.load(), w.failure));
  }

  // Blocks until ready() holds. Throws when the world failed, when left() names a peer (>= 0)
  // that abandoned the call, or at the deadline (with timeout_msg()).
  template <class Ready, class Left, class TimeoutMsg>
  void wait(std::string_view what, Ready&& ready, Left&& left, TimeoutMsg&& timeout_msg) {
    for (int i = 0; i < kSpin; ++i) {
      if (ready()) return;
      LOOM_CPU_RELAX();
    }
    for (int i = 0; i < kYield; ++i) {
      if (ready()) return;
      std::this_thread::yield();
    }
    ThreadGroup& g = *g_;
    std::unique_lock lk(g.mu);
    g.sleepers.fetch_add(1);
    struct Leave {
      ThreadGroup& g;
      ~Leave() { g.sleepers.fetch_sub(1); }
    } leave{g};
    for (;;) {
      if (ready()) return;
      if (g.world->failed.load() >= 0) throw_failed(what);
      int l = left();
      if (l >= 0) {
        throw Error(fmt::format("threads comm: {} on rank {} stopped because rank {} left it: {}",
                                what, world_rank(), wr(l), slot(l).abort_reason));
      }
      auto now = Clock::now();
      if (now >= deadline_) {
        throw Error(fmt::format("threads comm: {} on rank {} timed out after {}: {}", what,
                                world_rank(), seconds(opts_.timeout), timeout_msg()));
      }
      g.cv.wait_until(lk, std::min(deadline_, now + kSlice));
    }
  }

  // Waits, without throwing, until no peer can read this rank's buffers any more: each peer either
  // finished, left the call with an error, or has not arrived (it then sees this rank's abort
  // before it reads anything: it checks for aborted peers after publishing its own arrival, and
  // this rank checks arrivals after publishing its abort). Bounded: every peer's own waits end by
  // their deadlines; the grace covers clock skew.
  void drain(uint64_t seq) {
    auto all_out = [&] {
      for (int j = 0; j < size(); ++j) {
        const Slot& o = slot(j);
        if (o.arrived.load() >= seq && o.done.load() < seq && o.aborted.load() == 0) return false;
      }
      return true;
    };
    if (all_out()) return;
    ThreadGroup& g = *g_;
    auto limit = deadline_ + opts_.timeout + std::chrono::seconds(1);
    std::unique_lock lk(g.mu);
    g.sleepers.fetch_add(1);
    while (!all_out() && Clock::now() < limit) g.cv.wait_until(lk, std::min(limit, Clock::now() + kSlice));
    g.sleepers.fetch_sub(1);
  }

  int first_broken_peer() const {
    for (int j = 0; j < size(); ++j) {
      if (j != rank_ && slot(j).aborted.load() != 0) return j;
    }
    return -1;
  }

  // Runs one collective: publishes the descriptor, waits for every rank, validates, runs `work`,
  // then waits until nobody reads this rank's buffers any more. On error the rank marks itself
  // aborted and still drains before the exception leaves (its buffers may be in use).
  template <class Work>
  void collective(Desc d, Work&& work) {
    what_ = describe(d);
    const std::string& what = what_;
    check_usable(what);
    uint64_t seq = ++seq_;
    deadline_ = Clock::now() + opts_.timeout;
    Slot& me = slot(rank_);
    me.desc[seq & 1] = std::move(d);
    me.arrived.store(seq);
    g_->notify();
    try {
      wait(what, [&] {
        for (int j = 0; j < size(); ++j) if (slot(j).arrived.load() < seq) return false;
        return true;
      }, [&] { return first_broken_peer(); }, [&] {
        std::vector<int> missing;
        for (int j = 0; j < size(); ++j) if (slot(j).arrived.load() < seq) missing.push_back(wr(j));
        return fmt::format("rank(s) {} did not arrive (group of world ranks {})", rank_list(missing),
                           rank_list(g_->world_ranks));
      });
      // A peer may have arrived and left with an error at once; then its buffers are off limits.
      if (int l = first_broken_peer(); l >= 0) {
        throw Error(fmt::format("threads comm: {} on rank {} stopped because rank {} left it: {}", what,
                                world_rank(), wr(l), slot(l).abort_reason));
      }
      validate(seq);
      work(seq);
    } catch (const std::exception& e) {
      abort(seq, e.what());
      throw;
    } catch (...) {
      abort(seq, "unknown exception");
      throw;
    }
    if (desc(rank_, seq).op != Op::barrier) {
      me.done.store(seq);
      g_->notify();
      drain(seq);
    }
  }

  void abort(uint64_t seq, const char* why) {
    Slot& me = slot(rank_);
    broken_ = true;
    me.abort_reason = why;
    me.aborted.store(seq);
    g_->notify();
    drain(seq);
  }

  std::string describe(const Desc& d) const {
    switch (d.op) {
      case Op::barrier: return "barrier";
      case Op::split: return fmt::format("split (color {}, key {})", d.color, d.key);
      case Op::broadcast:
        return fmt::format("broadcast ({} [{}] from rank {})", dtype_name(d.dt), d.count, d.root);
      case Op::all_reduce:
      case Op::reduce_scatter:
        return fmt::format("{} ({}, {} [{}])", op_name(d.op), reduce_op_name(d.rop), dtype_name(d.dt),
                           d.count);
      case Op::all_gather: return fmt::format("all_gather ({} [{}])", dtype_name(d.dt), d.count);
    }
    return "?";
  }

  // Every rank checks that every other rank called the same collective with the same shape.
  void validate(uint64_t seq) const {
    const Desc& m = desc(rank_, seq);
    for (int j = 0; j < size(); ++j) {
      if (j == rank_) continue;
      const Desc& o = desc(j, seq);
      bool same = o.op == m.op;
      if (same && m.op != Op::barrier && m.op != Op::split) {
        same = o.dt == m.dt && o.count == m.count && o.rop == m.rop && o.root == m.root;
        if (same && m.counts) {
          same = std::equal(m.counts, m.counts + size(), o.counts);
        }
      }
      if (!same) {
        throw Error(fmt::format("threads comm: mismatched collectives: rank {} called {} while rank "
                                "{} called {}{}", world_rank(), describe(m), wr(j), describe(o),
                                m.counts && o.op == m.op ? " (or different counts)" : ""));
      }
    }
  }

  // Reduces elements [range) of the ranks' buffers src[j] (offset base elements) in the ring order
  // ending at this rank, into out.
  void reduce_range(const std::vector<const char*>& src, Range range, void* out, DType dt,
                    ReduceOp op) const {
    const int n = size();
    const size_t es = dtype_size(dt);
    alignas(64) float acc[kBlock];
    char* o = static_cast<char*>(out);
    for (int64_t b = range.begin; b < range.end; b += kBlock) {
      int64_t len = std::min(kBlock, range.end - b);
      detail::load_f32(acc, src[size_t((rank_ + 1) % n)] + size_t(b) * es, dt, len);
      for (int k = 2; k <= n; ++k) {
        detail::fold(acc, src[size_t((rank_ + k) % n)] + size_t(b) * es, dt, len, op);
      }
      detail::store_f32(o + size_t(b - range.begin) * es, dt, acc, len);
    }
  }

  // Point to point.
  // Fills m as this rank's message of buf [count] with tag and posts it to dst's mailbox.
  void post(Msg& m, const void* buf, int64_t count, DType dt, int dst, int tag) {
    m.src = rank_;
    m.tag = tag;
    m.dt = dt;
    m.count = count;
    m.data = buf;
    auto& box = g_->boxes[size_t(dst)];
    {
      std::lock_guard lk(box.mu);
      box.queue.push_back(&m);
    }
    box.cv.notify_all();
  }
  void finish_send(Msg& m, int dst, std::string_view what, bool throw_on_error);
  // Withdraws a posted message nobody took yet, or waits for the receiver's copy (short).
  void withdraw(Msg& m, int dst);
  struct Pending;
  void take(void* buf, int64_t count, DType dt, int src, int tag, std::string_view what);
  template <class Pred>
  void wait_box(std::string_view what, Pred&& pred, const std::function<std::string()>& timeout_msg);

  std::shared_ptr<ThreadGroup> g_;
  int rank_;
  uint64_t seq_ = 0;
  bool broken_ = false;
  Clock::time_point deadline_{};
  std::string what_;  // the collective in progress, for messages
};

void ThreadComm::do_all_reduce(void* buf, int64_t count, DType dt, ReduceOp op) {
  if (size() == 1) return;
  Desc d;
  d.op = Op::all_reduce;
  d.dt = dt;
  d.rop = op;
  d.count = count;
  d.recv = buf;
  collective(std::move(d), [&](uint64_t seq) {
    const int n = size();
    const size_t es = dtype_size(dt);
    std::vector<const char*> src(static_cast<size_t>(n));
    for (int j = 0; j < n; ++j) src[size_t(j)] = static_cast<const char*>(desc(j, seq).recv);
    Range mine = chunk_range(count, n, rank_);
    reduce_range(src, mine, static_cast<char*>(buf) + size_t(mine.begin) * es, dt, op);
    slot(rank_).ready.store(seq);
    g_->notify();
    // Gather the other chunks, starting with the next rank's so the ranks spread their reads.
    for (int k = 1; k < n; ++k) {
      int j = (rank_ + k) % n;
      wait(what_, [&] { return slot(j).ready.load() >= seq; },
           [&] { return slot(j).aborted.load() != 0 ? j : -1; },
           [&] { return fmt::format("rank {} did not finish reducing its chunk", wr(j)); });
      Range r = chunk_range(count, n, j);
      std::memcpy(static_cast<char*>(buf) + size_t(r.begin) * es, src[size_t(j)] + size_t(r.begin) * es,
                  size_t(r.size()) * es);
    }
  });
}

void ThreadComm::do_reduce_scatter(const void* send, void* recv, std::span<const int64_t> counts,
                                   DType dt, ReduceOp op) {
  const int n = size();
  const size_t es = dtype_size(dt);
  int64_t off = 0;
  for (int j = 0; j < rank_; ++j) off += counts[size_t(j)];
  if (n == 1) {
    if (recv != send) std::memmove(recv, send, size_t(counts[0]) * es);
    return;
  }
  Desc d;
  d.op = Op::reduce_scatter;
  d.dt = dt;
  d.rop = op;
  for (auto c : counts) d.count += c;
  d.send = send;
  d.recv = recv;
  d.counts = counts.data();
  collective(std::move(d), [&](uint64_t seq) {
    std::vector<const char*> src(static_cast<size_t>(n));
    for (int j = 0; j < n; ++j) src[size_t(j)] = static_cast<const char*>(desc(j, seq).send);
    reduce_range(src, Range{off, off + counts[size_t(rank_)]}, recv, dt, op);
  });
}

void ThreadComm::do_all_gather(const void* send, void* recv, std::span<const int64_t> counts, DType dt) {
  const int n = size();
  const size_t es = dtype_size(dt);
  std::vector<int64_t> offs(size_t(n) + 1, 0);
  for (int j = 0; j < n; ++j) offs[size_t(j) + 1] = offs[size_t(j)] + counts[size_t(j)];
  char* out = static_cast<char*>(recv);
  auto copy_own = [&] {
    char* dst = out + size_t(offs[size_t(rank_)]) * es;
    if (dst != send) std::memmove(dst, send, size_t(counts[size_t(rank_)]) * es);
  };
  if (n == 1) {
    copy_own();
    return;
  }
  Desc d;
  d.op = Op::all_gather;
  d.dt = dt;
  d.count = offs[size_t(n)];
  d.send = send;
  d.recv = recv;
  d.counts = counts.data();
  collective(std::move(d), [&](uint64_t seq) {
    // The own chunk is moved last: when send aliases recv, peers read it before it moves (they
    // read the same bytes, which do not change, so even then the order does not matter).
    for (int k = 1; k < n; ++k) {
      int j = (rank_ + k) % n;
      std::memcpy(out + size_t(offs[size_t(j)]) * es, desc(j, seq).send, size_t(counts[size_t(j)]) * es);
    }
    copy_own();
  });
}

void ThreadComm::do_broadcast(void* buf, int64_t count, DType dt, int root) {
  if (size() == 1) return;
  Desc d;
  d.op = Op::broadcast;
  d.dt = dt;
  d.count = count;
  d.root = root;
  d.recv = buf;
  collective(std::move(d), [&](uint64_t seq) {
    if (rank_ != root) std::memcpy(buf, desc(root, seq).recv, size_t(count) * dtype_size(dt));
  });
}

void ThreadComm::do_barrier() {
  if (size() == 1) return;
  Desc d;
  d.op = Op::barrier;
  collective(std::move(d), [](uint64_t) {});
}

std::unique_ptr<Comm> ThreadComm::do_split(int color, int key) {
  std::shared_ptr<ThreadGroup> group;
  int new_rank = -1;
  Desc d;
  d.op = Op::split;
  d.color = color;
  d.key = key;
  collective(std::move(d), [&](uint64_t seq) {
    if (color < 0) return;
    std::vector<int> members;
    for (int j = 0; j < size(); ++j) if (desc(j, seq).color == color) members.push_back(j);
    std::stable_sort(members.begin(), members.end(),
                     [&](int a, int b) { return desc(a, seq).key < desc(b, seq).key; });
    new_rank = int(std::find(members.begin(), members.end(), rank_) - members.begin());
    int leader = members[0];
    if (leader == rank_) {
      std::vector<int> ranks;
      for (int j : members) ranks.push_back(wr(j));
      group = std::make_shared<ThreadGroup>(g_->world, std::move(ranks));
      slot(rank_).desc[seq & 1].created = group;
      slot(rank_).ready.store(seq);
      g_->notify();
    } else {
      wait(what_, [&] { return slot(leader).ready.load() >= seq; },
           [&] { return slot(leader).aborted.load() != 0 ? leader : -1; },
           [&] { return fmt::format("rank {} did not create the group", wr(leader)); });
      group = desc(leader, seq).created;
    }
  });
  // Every member holds the group now (the collective drained); the leader drops its extra ref.
  slot(rank_).desc[seq_ & 1].created.reset();
  if (!group) return nullptr;
  return std::make_unique<ThreadComm>(std::move(group), new_rank, opts_);
}

template <class Pred>
void ThreadComm::wait_box(std::string_view what, Pred&& pred,
                          const std::function<std::string()>& timeout_msg) {
  auto& box = g_->boxes[size_t(rank_)];
  std::unique_lock lk(box.mu);
  for (;;) {
    if (pred()) return;
    if (g_->world->failed.load() >= 0) throw_failed(what);
    auto now = Clock::now();
    if (now >= deadline_) {
      throw Error(fmt::format("threads comm: {} on rank {} timed out after {}: {}", what, world_rank(),
                              seconds(opts_.timeout), timeout_msg()));
    }
    box.cv.wait_until(lk, std::min(deadline_, now + kSlice));
  }
}

// Waits until the receiver has copied m. On failure or timeout a message nobody took is withdrawn;
// one being copied is waited for (the copy is short), so m never outlives its reader.
void ThreadComm::finish_send(Msg& m, int dst, std::string_view what, bool throw_on_error) {
  try {
    wait_box(what, [&] { return m.state.load() >= detail::kDelivered; }, [&] {
      return fmt::format("rank {} did not receive it", wr(dst));
    });
  } catch (...) {
    auto& box = g_->boxes[size_t(dst)];
    {
      std::lock_guard lk(box.mu);
      auto it = std::find(box.queue.begin(), box.queue.end(), &m);
      if (it != box.queue.end()) {
        box.queue.erase(it);
        if (throw_on_error) throw;
        return;
      }
    }
    while (m.state.load() < detail::kDelivered) std::this_thread::yield();
    if (throw_on_error) throw;
    return;
  }
  if (m.state.load() == detail::kRejected && throw_on_error) throw Error(m.error);
}

void ThreadComm::take(void* buf, int64_t count, DType dt, int src, int tag, std::string_view what) {
  auto& box = g_->boxes[size_t(rank_)];
  Msg* m = nullptr;
  wait_box(what, [&] {
    for (auto it = box.queue.begin(); it != box.queue.end(); ++it) {
      if ((*it)->src == src && (*it)->tag == tag) {
        m = *it;
        box.queue.erase(it);
        m->state.store(detail::kTaken);
        return true;
      }
    }
    return false;
  }, [&] { return fmt::format("no message from rank {} with tag {} arrived", wr(src), tag); });
  auto& sender_box = g_->boxes[size_t(src)];
  auto complete = [&](int state) {
    m->state.store(state);  // m may be gone after this store
    std::lock_guard lk(sender_box.mu);
    sender_box.cv.notify_all();
  };
  if (m->count != count || m->dt != dt) {
    std::string err = fmt::format("threads comm: rank {} sent {} [{}] with tag {} but rank {} "
                                  "receives {} [{}]", wr(src), dtype_name(m->dt), m->count, tag,
                                  world_rank(), dtype_name(dt), count);
    m->error = err;
    complete(detail::kRejected);
    throw Error(err);
  }
  std::memcpy(buf, m->data, size_t(count) * dtype_size(dt));
  complete(detail::kDelivered);
}

void ThreadComm::do_send(const void* buf, int64_t count, DType dt, int dst, int tag) {
  std::string what = fmt::format("send of {} [{}] to rank {} tag {}", dtype_name(dt), count, wr(dst), tag);
  check_usable(what);
  deadline_ = Clock::now() + opts_.timeout;
  Msg m;
  post(m, buf, count, dt, dst, tag);
  finish_send(m, dst, what, true);
}

struct ThreadComm::Pending final : PendingSend {
  ThreadComm* comm;
  std::unique_ptr<Msg> msg = std::make_unique<Msg>();
  int dst;
  std::string what;
  bool finished = false;
  Pending(ThreadComm* c, int d, std::string w) : comm(c), dst(d), what(std::move(w)) {}
  void wait() override {
    if (finished) return;
    finished = true;  // finish_send withdraws or completes the message even when it throws
    comm->deadline_ = Clock::now() + comm->opts_.timeout;
    comm->finish_send(*msg, dst, what, true);
  }
  bool done() override { return finished || msg->state.load() >= detail::kDelivered; }
  ~Pending() override {
    if (!finished) comm->withdraw(*msg, dst);
  }
};

std::unique_ptr<PendingSend> ThreadComm::do_isend(const void* buf, int64_t count, DType dt, int dst, int tag) {
  auto p = std::make_unique<Pending>(
      this, dst, fmt::format("send of {} [{}] to rank {} tag {} (non-blocking)", dtype_name(dt), count, wr(dst), tag));
  check_usable(p->what);
  post(*p->msg, buf, count, dt, dst, tag);
  return p;
}

void ThreadComm::withdraw(Msg& m, int dst) {
  {
    auto& box = g_->boxes[size_t(dst)];
    std::lock_guard lk(box.mu);
    auto it = std::find(box.queue.begin(), box.queue.end(), &m);
    if (it != box.queue.end()) {
      box.queue.erase(it);
      return;
    }
  }
  while (m.state.load() < detail::kDelivered) std::this_thread::yield();
}

void ThreadComm::do_recv(void* buf, int64_t count, DType dt, int src, int tag) {
  std::string what = fmt::format("recv of {} [{}] from rank {} tag {}", dtype_name(dt), count, wr(src), tag);
  check_usable(what);
  deadline_ = Clock::now() + opts_.timeout;
  take(buf, count, dt, src, tag, what);
}

void ThreadComm::do_sendrecv(const void* send_buf, int64_t send_count, int dst, void* recv_buf,
                             int64_t recv_count, int src, DType dt, int tag) {
  std::string what = fmt::format("sendrecv ({} [{}] to rank {}, [{}] from rank {}, tag {})",
                                 dtype_name(dt), send_count, wr(dst), recv_count, wr(src), tag);
  check_usable(what);
  deadline_ = Clock::now() + opts_.timeout;
  Msg m;
  post(m, send_buf, send_count, dt, dst, tag);
  try {
    take(recv_buf, recv_count, dt, src, tag, what);
  } catch (...) {
    finish_send(m, dst, what, false);
    throw;
  }
  finish_send(m, dst, what, true);
}

}  // namespace

ThreadWorld::ThreadWorld(int size, CommOptions opts) : opts_(opts) {
  LOOM_CHECK(size >= 1, "ThreadWorld: world size must be at least 1, got {}", size);
  LOOM_CHECK(opts.timeout.count() > 0, "ThreadWorld: timeout must be positive, got {} ms",
             opts.timeout.count());
  state_ = std::make_shared<detail::ThreadWorldState>(size);
  std::vector<int> ranks(static_cast<size_t>(size));
  for (int i = 0; i < size; ++i) ranks[size_t(i)] = i;
  root_ = std::make_shared<ThreadGroup>(state_, std::move(ranks));
  issued_.assign(size_t(size), false);
}

ThreadWorld::~ThreadWorld() = default;

int ThreadWorld::size() const { return state_->size; }

std::unique_ptr<Comm> ThreadWorld::comm(int rank) {
  LOOM_CHECK(rank >= 0 && rank < size(), "ThreadWorld::comm: rank {} outside a world of {}", rank, size());
  std::lock_guard lk(mu_);
  LOOM_CHECK(!issued_[size_t(rank)], "ThreadWorld::comm: the handle of rank {} was already taken", rank);
  issued_[size_t(rank)] = true;
  return std::make_unique<ThreadComm>(root_, rank, opts_);
}

void ThreadWorld::fail(int rank, const std::string& what) {
  state_->fail(rank, what);
  root_->notify();
}

int ThreadWorld::failed_rank() const { return state_->failed.load(); }

std::string ThreadWorld::failure() const {
  std::lock_guard lk(state_->mu);
  return state_->failed.load() >= 0 ? state_->failure : std::string();
}

int threads_per_rank(int n, const RunOptions& opts) {
  return opts.threads_per_rank > 0 ? opts.threads_per_rank : std::max(1, omp_get_max_threads() / std::max(1, n));
}

void run_rank_threads(ThreadWorld& world, const std::function<void(int)>& body, const std::string& context) {
  const int n = world.size();
  // Which rank threads have returned, shared with them: a thread left running outlives this call.
  struct Ended {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<bool> done;
  };
  auto ended = std::make_shared<Ended>();
  ended->done.assign(size_t(n), false);
  std::vector<std::thread> threads;
  threads.reserve(size_t(n));
  auto join_all = [&] {
    for (auto& t : threads) t.join();
  };
  for (int r = 0; r < n; ++r) {
    try {
      threads.emplace_back([ended, &body, r] {
        body(r);
        std::lock_guard lk(ended->mu);
        ended->done[size_t(r)] = true;
        ended->cv.notify_all();
      });
    } catch (const std::system_error& e) {
      const std::string what = fmt::format("cannot start the thread of rank {} of {}: {}", r, n, e.what());
      world.fail(r, what);
      join_all();
      throw Error(fmt::format("{}: {}", context, what));
    }
  }
  // Every rank ends by itself unless one failed: its peers then leave their collectives at once and
  // a rank outside any collective at its next one, which a rank computing or sleeping may never
  // reach. Such a rank is waited for as long as a peer would wait in a collective.
  const auto grace = std::max<Clock::duration>(world.options().timeout, std::chrono::seconds(1));
  std::unique_lock lk(ended->mu);
  auto all_done = [&] { return std::all_of(ended->done.begin(), ended->done.end(), [](bool d) { return d; }); };
  std::optional<Clock::time_point> give_up;
  while (!all_done()) {
    if (!give_up && world.failed_rank() >= 0) give_up = Clock::now() + grace;
    if (give_up && Clock::now() >= *give_up) break;
    ended->cv.wait_for(lk, std::chrono::milliseconds(50));
  }
  if (all_done()) {
    lk.unlock();
    join_all();
    return;
  }
  std::vector<int> stuck;
  for (int r = 0; r < n; ++r)
    if (!ended->done[size_t(r)]) stuck.push_back(r);
  lk.unlock();
  // A thread cannot be stopped from outside, and it still uses what this call's callers hold: the
  // process ends here, without unwinding them (the MPI backend's MPI_Abort ends a job alike).
  const std::string what =
      fmt::format("{}: rank {} of {} failed: {}; rank{} {} did not stop within {:.0f} s of it (busy or stalled outside "
                  "any collective: parallel.timeout_s bounds the wait), and the process ends without waiting for {}",
                  context, world.failed_rank(), n, world.failure(), stuck.size() > 1 ? "s" : "", fmt::join(stuck, ", "),
                  std::chrono::duration<double>(grace).count(), stuck.size() > 1 ? "them" : "it");
  std::fflush(stdout);
  std::fprintf(stderr, "loom: error: %s\n", what.c_str());
  std::fflush(nullptr);
  std::_Exit(1);
}

void run_ranks(int n, const std::function<void(Comm&)>& fn, const RunOptions& opts) {
  LOOM_CHECK(n >= 1, "run_ranks: need at least one rank, got {}", n);
  ThreadWorld world(n, opts.comm);
  const int per_rank = threads_per_rank(n, opts);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  std::vector<std::unique_ptr<Comm>> comms(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) comms[size_t(r)] = world.comm(r);
  auto body = [&](int r) {
    set_omp_threads(per_rank);
    try {
      fn(*comms[size_t(r)]);
    } catch (const std::exception& e) {
      errors[size_t(r)] = std::current_exception();
      world.fail(r, e.what());
    } catch (...) {
      errors[size_t(r)] = std::current_exception();
      world.fail(r, "unknown exception");
    }
  };
  run_rank_threads(world, body, "run_ranks");
  int first = world.failed_rank();
  if (first >= 0) std::rethrow_exception(errors[size_t(first)]);
}

}  // namespace loom::comm

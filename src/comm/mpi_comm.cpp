#include "comm/mpi_comm.h"

#include <chrono>

#include <atomic>

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "comm/reduce.h"
#include "core/error.h"

namespace loom::comm {

namespace {

using Clock = std::chrono::steady_clock;

// Messages larger than this many elements are sent in pieces (MPI counts are int).
constexpr int64_t kMaxPiece = int64_t(1) << 30;
constexpr int kSpin = 2000;
// Ring messages are cut into pieces of this many elements (1 MiB of f32) and each piece is
// combined as soon as it arrives, while it is still in cache.
constexpr int64_t kSegment = int64_t(1) << 18;
// Pieces of a ring step's last receive in flight at once.
constexpr int64_t kWindow = 4;

MPI_Datatype mpi_type(DType dt) {
  switch (dt) {
    case DType::f32: return MPI_FLOAT;
    case DType::bf16:
    case DType::f16:
    case DType::u16: return MPI_UINT16_T;
    case DType::i32: return MPI_INT32_T;
    case DType::u32: return MPI_UINT32_T;
  }
  return MPI_BYTE;
}

std::string mpi_error_string(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(buf, size_t(len));
}

// MPI calls made before any message is in flight: an error throws.
void check_mpi(int rc, const char* call) {
  if (rc != MPI_SUCCESS) throw Error(fmt::format("mpi comm: {} failed: {}", call, mpi_error_string(rc)));
}
#define LOOM_MPI(call) check_mpi((call), #call)

std::string seconds(std::chrono::milliseconds t) { return fmt::format("{:g} s", t.count() / 1000.0); }

// A duplicate of the world made when the session starts, on which a rank whose collective timed
// out tells every other rank so (see abort_timed_out).
MPI_Comm g_health = MPI_COMM_NULL;
constexpr int kHealthTag = 31001;

// Once per process: two threads of a rank (the compute thread and a communication thread) can
// fail at once; the first one says why and aborts the job, a later one waits for that (two
// concurrent MPI_Abort calls crash inside Open MPI, and a second message would only repeat or
// confuse the first).
std::atomic<bool> g_aborting{false};
[[noreturn]] void wait_for_the_abort() {
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

// A collective of this rank timed out (`text` says which and what it waited for). The ranks
// waiting on a stalled one time out at about the same moment, and a rank waiting on a healthy
// rank that itself waits would name that healthy rank. So each rank that times out tells all the
// others, listens for a grace period, and only the lowest of the ranks that timed out speaks: it
// names the ranks that did not time out (stalled, dead, or stuck outside any collective) and
// aborts the job. Exactly one message, and it blames no rank that was waiting like itself.
[[noreturn]] void abort_timed_out(int me, const std::string& text, std::chrono::milliseconds timeout) {
  if (g_aborting.exchange(true)) wait_for_the_abort();
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::vector<int> timed{me};
  const auto grace = std::clamp(timeout / 4, std::chrono::milliseconds(500), std::chrono::milliseconds(5000));
  if (g_health != MPI_COMM_NULL && size > 1) {
    static int token = 0;
    token = me;
    std::vector<MPI_Request> sent(size_t(size), MPI_REQUEST_NULL);
    for (int r = 0; r < size; ++r)
      if (r != me) MPI_Isend(&token, 1, MPI_INT, r, kHealthTag, g_health, &sent[size_t(r)]);
    const auto until = std::chrono::steady_clock::now() + grace;
    while (std::chrono::steady_clock::now() < until) {
      int flag = 0;
      MPI_Status st;
      MPI_Iprobe(MPI_ANY_SOURCE, kHealthTag, g_health, &flag, &st);
      if (!flag) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
      int who = -1;
      MPI_Recv(&who, 1, MPI_INT, st.MPI_SOURCE, kHealthTag, g_health, MPI_STATUS_IGNORE);
      if (std::find(timed.begin(), timed.end(), st.MPI_SOURCE) == timed.end()) timed.push_back(st.MPI_SOURCE);
    }
    std::sort(timed.begin(), timed.end());
    // Another rank that timed out speaks; should its abort not come, say this rank's own.
    if (timed.front() != me) std::this_thread::sleep_for(3 * grace);
  }
  std::vector<int> quiet;
  for (int r = 0; r < size; ++r)
    if (std::find(timed.begin(), timed.end(), r) == timed.end()) quiet.push_back(r);
  auto list = [](const std::vector<int>& v) {
    std::string out;
    for (size_t i = 0; i < v.size(); ++i) out += fmt::format("{}{}", i ? ", " : "", v[i]);
    return out;
  };
  std::string verdict;
  if (size == 1)
    verdict = "";
  else if (quiet.empty())
    verdict = fmt::format("; every rank timed out waiting (a deadlock, or parallel.timeout_s is shorter than a step)");
  else
    verdict = fmt::format("; rank{} {} timed out waiting in collectives and rank{} {} did not: {} stalled or dead",
                          timed.size() > 1 ? "s" : "", list(timed), quiet.size() > 1 ? "s" : "", list(quiet),
                          quiet.size() > 1 ? "one of them is" : fmt::format("rank {} is", quiet[0]));
  std::fprintf(stderr, "loom: rank %d (mpi): %s%s; aborting the job\n", me, text.c_str(), verdict.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  MPI_Abort(MPI_COMM_WORLD, 2);
  std::_Exit(2);
}

int mod(int a, int n) { return ((a % n) + n) % n; }

// Staging memory from the communicator's pool, tagged MemTag::comm. Kept between calls (fresh
// pages would be faulted in on every call) and grown to the largest request.
class Scratch {
 public:
  Scratch() = default;
  ~Scratch() { release(); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <class T> T* get(MemoryPool* pool, size_t bytes) {
    if (bytes > bytes_) {
      release();
      pool_ = pool;
      p_ = pool_->allocate(bytes, MemTag::comm);
      bytes_ = bytes;
    }
    return static_cast<T*>(p_);
  }

 private:
  void release() {
    if (p_) pool_->deallocate(p_, bytes_, MemTag::comm);
    p_ = nullptr;
    bytes_ = 0;
  }
  MemoryPool* pool_ = nullptr;
  size_t bytes_ = 0;
  void* p_ = nullptr;
};

class MpiComm final : public Comm {
 public:
  // Takes ownership of coll (freed on destruction); point-to-point traffic gets its own duplicate
  // so user tags never meet the collectives' messages.
  MpiComm(MPI_Comm coll, CommOptions opts) : Comm(opts), coll_(coll) {
    LOOM_MPI(MPI_Comm_set_errhandler(coll_, MPI_ERRORS_RETURN));
    LOOM_MPI(MPI_Comm_dup(coll_, &p2p_));
    LOOM_MPI(MPI_Comm_set_errhandler(p2p_, MPI_ERRORS_RETURN));
    LOOM_MPI(MPI_Comm_rank(coll_, &rank_));
    LOOM_MPI(MPI_Comm_size(coll_, &size_));
    MPI_Group g, wg;
    LOOM_MPI(MPI_Comm_group(coll_, &g));
    LOOM_MPI(MPI_Comm_group(MPI_COMM_WORLD, &wg));
    std::vector<int> mine(static_cast<size_t>(size_));
    for (int i = 0; i < size_; ++i) mine[size_t(i)] = i;
    world_ranks_.resize(size_t(size_));
    LOOM_MPI(MPI_Group_translate_ranks(g, size_, mine.data(), wg, world_ranks_.data()));
    MPI_Group_free(&g);
    MPI_Group_free(&wg);
    if (!opts_.pool) opts_.pool = &default_cpu_pool();
  }

  ~MpiComm() override {
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin) return;
    MPI_Comm_free(&p2p_);
    MPI_Comm_free(&coll_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "mpi"; }
  int world_rank() const override { return world_ranks_[size_t(rank_)]; }

 protected:
  void do_all_reduce(void* buf, int64_t count, DType dt, ReduceOp op) override {
    if (size_ == 1) return;
    begin(fmt::format("all_reduce ({}, {} [{}])", reduce_op_name(op), dtype_name(dt), count));
    auto offs = offsets(equal_split(count));
    char* b = static_cast<char*>(buf);
    ring_reduce_scatter(b, offs, dt, op, b + size_t(offs[size_t(rank_)]) * dtype_size(dt));
    ring_all_gather(b, offs, dt, /*after_reduce=*/true);
  }

  void do_reduce_scatter(const void* send, void* recv, std::span<const int64_t> counts, DType dt,
                         ReduceOp op) override {
    auto offs = offsets(counts);
    if (size_ == 1) {
      if (recv != send) std::memmove(recv, send, size_t(counts[0]) * dtype_size(dt));
      return;
    }
    begin(fmt::format("reduce_scatter ({}, {} [{}])", reduce_op_name(op), dtype_name(dt), offs.back()));
    ring_reduce_scatter(static_cast<const char*>(send), offs, dt, op, recv);
  }

  void do_all_gather(const void* send, void* recv, std::span<const int64_t> counts, DType dt) override {
    auto offs = offsets(counts);
    char* out = static_cast<char*>(recv);
    char* own = out + size_t(offs[size_t(rank_)]) * dtype_size(dt);
    if (own != send) std::memmove(own, send, size_t(counts[size_t(rank_)]) * dtype_size(dt));
    if (size_ == 1) return;
    begin(fmt::format("all_gather ({} [{}])", dtype_name(dt), offs.back()));
    ring_all_gather(out, offs, dt);
  }

  void do_broadcast(void* buf, int64_t count, DType dt, int root) override {
    if (size_ == 1) return;
    begin(fmt::format("broadcast ({} [{}] from rank {})", dtype_name(dt), count, world_ranks_[size_t(root)]));
    std::vector<MPI_Request> reqs;
    char* b = static_cast<char*>(buf);
    int64_t off = 0;
    do {
      int piece = int(std::min(kMaxPiece, count - off));
      reqs.emplace_back();
      progress_call(MPI_Ibcast(b + size_t(off) * dtype_size(dt), piece, mpi_type(dt), root, coll_,
                               &reqs.back()), "MPI_Ibcast");
      off += piece;
    } while (off < count);
    wait_all(reqs, nullptr, [&] {
      return fmt::format("rank {} or another rank of the group did not take part",
                         world_ranks_[size_t(root)]);
    });
  }

  void do_send(const void* buf, int64_t count, DType dt, int dst, int tag) override {
    begin(fmt::format("send of {} [{}] to rank {} tag {}", dtype_name(dt), count, world_ranks_[size_t(dst)], tag));
    std::vector<MPI_Request> reqs;
    isend(buf, count, dt, dst, tag, p2p_, reqs);
    wait_all(reqs, nullptr, [&] { return fmt::format("rank {} did not receive it", world_ranks_[size_t(dst)]); });
  }

  struct Pending final : PendingSend {
    MpiComm* comm;
    std::vector<MPI_Request> reqs;
    std::string what;
    int dst;
    Pending(MpiComm* c, std::string w, int d) : comm(c), what(std::move(w)), dst(d) {}
    void wait() override {
      if (reqs.empty()) return;
      comm->begin(what);
      comm->wait_all(reqs, nullptr,
                 [&] { return fmt::format("rank {} did not receive it", comm->world_ranks_[size_t(dst)]); });
    }
    bool done() override {
      if (reqs.empty()) return true;
      int flag = 0;
      comm->progress_call(MPI_Testall(int(reqs.size()), reqs.data(), &flag, MPI_STATUSES_IGNORE), "MPI_Testall");
      if (flag) reqs.clear();
      return flag != 0;
    }
    // Unwinding after an error: the job is ending (an MPI failure aborts it), so the requests are
    // released to complete or die with it.
    ~Pending() override {
      for (MPI_Request& r : reqs)
        if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
    }
  };

  std::unique_ptr<PendingSend> do_isend(const void* buf, int64_t count, DType dt, int dst, int tag) override {
    auto p = std::make_unique<Pending>(this, fmt::format("send of {} [{}] to rank {} tag {} (non-blocking)",
                                                         dtype_name(dt), count, world_ranks_[size_t(dst)], tag), dst);
    begin(p->what);
    isend(buf, count, dt, dst, tag, p2p_, p->reqs);
    return p;
  }

  void do_recv(void* buf, int64_t count, DType dt, int src, int tag) override {
    begin(fmt::format("recv of {} [{}] from rank {} tag {}", dtype_name(dt), count, world_ranks_[size_t(src)], tag));
    std::vector<MPI_Request> reqs;
    irecv(buf, count, dt, src, tag, p2p_, reqs);
    std::vector<MPI_Status> st(reqs.size());
    wait_all(reqs, st.data(), [&] {
      return fmt::format("no message from rank {} with tag {} arrived", world_ranks_[size_t(src)], tag);
    });
    check_received(st, count, dt, src, tag);
  }

  void do_sendrecv(const void* send_buf, int64_t send_count, int dst, void* recv_buf, int64_t recv_count,
                   int src, DType dt, int tag) override {
    begin(fmt::format("sendrecv ({} [{}] to rank {}, [{}] from rank {}, tag {})", dtype_name(dt), send_count,
                      world_ranks_[size_t(dst)], recv_count, world_ranks_[size_t(src)], tag));
    std::vector<MPI_Request> reqs;
    irecv(recv_buf, recv_count, dt, src, tag, p2p_, reqs);
    size_t nrecv = reqs.size();
    isend(send_buf, send_count, dt, dst, tag, p2p_, reqs);
    std::vector<MPI_Status> st(reqs.size());
    wait_all(reqs, st.data(), [&] {
      return fmt::format("rank {} (receiving) or rank {} (sending) did not take part",
                         world_ranks_[size_t(dst)], world_ranks_[size_t(src)]);
    });
    st.resize(nrecv);
    check_received(st, recv_count, dt, src, tag);
  }

  void do_barrier() override {
    if (size_ == 1) return;
    begin("barrier");
    std::vector<MPI_Request> reqs(1);
    progress_call(MPI_Ibarrier(coll_, &reqs[0]), "MPI_Ibarrier");
    wait_all(reqs, nullptr, [] { return std::string("not every rank of the group arrived"); });
  }

  std::unique_ptr<Comm> do_split(int color, int key) override {
    begin(fmt::format("split (color {}, key {})", color, key));
    // Everybody's arrival is awaited with the timeout first; MPI_Comm_split itself cannot be polled.
    int mine[2] = {color, key};
    std::vector<int> all(size_t(2 * size_));
    std::vector<MPI_Request> reqs(1);
    progress_call(MPI_Iallgather(mine, 2, MPI_INT, all.data(), 2, MPI_INT, coll_, &reqs[0]), "MPI_Iallgather");
    wait_all(reqs, nullptr, [] { return std::string("not every rank of the group arrived"); });
    MPI_Comm out = MPI_COMM_NULL;
    LOOM_MPI(MPI_Comm_split(coll_, color < 0 ? MPI_UNDEFINED : color, key, &out));
    if (out == MPI_COMM_NULL) return nullptr;
    return std::make_unique<MpiComm>(out, opts_);
  }

 private:
  void begin(std::string what) {
    what_ = std::move(what);
    deadline_ = Clock::now() + opts_.timeout;
  }

  [[noreturn]] void fatal(const std::string& msg) const {
    mpi_abort(fmt::format("loom: rank {} (mpi): {}; aborting the job", world_rank(), msg), 2);
  }

  // A call that starts a transfer: from here on an error cannot be thrown safely.
  void progress_call(int rc, const char* call) const {
    if (rc != MPI_SUCCESS) fatal(fmt::format("{}: {} failed: {}", what_, call, mpi_error_string(rc)));
  }

  void isend(const void* p, int64_t count, DType dt, int peer, int tag, MPI_Comm c,
             std::vector<MPI_Request>& reqs) const {
    const char* b = static_cast<const char*>(p);
    int64_t off = 0;
    do {
      int piece = int(std::min(kMaxPiece, count - off));
      reqs.emplace_back();
      progress_call(MPI_Isend(b + size_t(off) * dtype_size(dt), piece, mpi_type(dt), peer, tag, c, &reqs.back()),
                    "MPI_Isend");
      off += piece;
    } while (off < count);
  }

  void irecv(void* p, int64_t count, DType dt, int peer, int tag, MPI_Comm c,
             std::vector<MPI_Request>& reqs) const {
    char* b = static_cast<char*>(p);
    int64_t off = 0;
    do {
      int piece = int(std::min(kMaxPiece, count - off));
      reqs.emplace_back();
      progress_call(MPI_Irecv(b + size_t(off) * dtype_size(dt), piece, mpi_type(dt), peer, tag, c, &reqs.back()),
                    "MPI_Irecv");
      off += piece;
    } while (off < count);
  }

  // Polls until every request completed; past the deadline the job is aborted with a message
  // naming the call and, from waiting_for(), the ranks it waited for.
  template <class WaitingFor>
  void wait_requests(MPI_Request* reqs, int n, MPI_Status* statuses, WaitingFor&& waiting_for) const {
    int flag = 0;
    for (long it = 0;; ++it) {
      int rc = MPI_Testall(n, reqs, &flag, statuses ? statuses : MPI_STATUSES_IGNORE);
      if (rc != MPI_SUCCESS) {
        std::string detail = mpi_error_string(rc);
        if (rc == MPI_ERR_IN_STATUS && statuses) {
          for (int i = 0; i < n; ++i) {
            if (statuses[i].MPI_ERROR != MPI_SUCCESS) detail = mpi_error_string(statuses[i].MPI_ERROR);
          }
        }
        fatal(fmt::format("{} failed: {} (mismatched counts between ranks?)", what_, detail));
      }
      if (flag) return;
      // Past the spin, sleep between polls (20 us, doubling to 0.5 ms): a waiting thread that
      // only yields stays runnable and takes CPU from the computing threads when ranks share
      // cores (a communication thread waiting through a whole backward).
      if (it >= kSpin) {
        const long doublings = std::min<long>(5, (it - kSpin) / 8);
        std::this_thread::sleep_for(std::chrono::microseconds(std::min<long>(500, 20L << doublings)));
      }
      if ((it & 63) == 0 && Clock::now() >= deadline_)
        abort_timed_out(world_rank(), fmt::format("{} timed out after {}: {}", what_, seconds(opts_.timeout),
                                                  waiting_for()),
                        opts_.timeout);
    }
  }

  template <class WaitingFor>
  void wait_all(std::vector<MPI_Request>& reqs, MPI_Status* statuses, WaitingFor&& waiting_for) const {
    wait_requests(reqs.data(), int(reqs.size()), statuses, waiting_for);
    reqs.clear();
  }

  void check_received(const std::vector<MPI_Status>& st, int64_t count, DType dt, int src, int tag) const {
    int64_t got = 0;
    for (auto& s : st) {
      int c = 0;
      MPI_Get_count(&s, mpi_type(dt), &c);
      got += c;
    }
    LOOM_CHECK(got == count, "mpi comm: rank {} received {} elements from rank {} with tag {} but expected {}",
               world_rank(), got, world_ranks_[size_t(src)], tag, count);
  }

  std::vector<int64_t> equal_split(int64_t count) const {
    std::vector<int64_t> c(static_cast<size_t>(size_));
    for (int i = 0; i < size_; ++i) c[size_t(i)] = chunk_range(count, size_, i).size();
    return c;
  }

  std::vector<int64_t> offsets(std::span<const int64_t> counts) const {
    std::vector<int64_t> o(counts.size() + 1, 0);
    for (size_t i = 0; i < counts.size(); ++i) o[i + 1] = o[i] + counts[i];
    return o;
  }

  // Ring reduce-scatter: at step s rank r sends its partial of chunk r-s-1 to r+1 and receives the
  // partial of chunk r-s-2 from r-1, so chunk c is folded in the order c+1, c+2, ..., c and ends
  // at rank c (the order the threads backend uses). out (dt) [counts[r]] may alias chunk r of send.
  void ring_reduce_scatter(const char* send, const std::vector<int64_t>& offs, DType dt, ReduceOp op, void* out) {
    const int n = size_, r = rank_;
    const int next = mod(r + 1, n), prev = mod(r - 1, n);
    const size_t es = dtype_size(dt);
    int64_t maxc = 0;
    for (int i = 0; i < n; ++i) maxc = std::max(maxc, offs[size_t(i) + 1] - offs[size_t(i)]);
    // Two f32 partial buffers alternate over the steps before the last: one is sent while the
    // other receives and is combined in place (bf16 inputs arrive as bf16 on the first step, in
    // buffer c). The last step's pieces are combined straight into out, so they are received into
    // a window of kWindow pieces rather than a whole chunk: two ranks need no chunk-sized buffer.
    float* partial[2] = {nullptr, nullptr};
    if (n > 2)
      partial[0] = scratch_[0].get<float>(opts_.pool, size_t(maxc) * 4),
      partial[1] = scratch_[1].get<float>(opts_.pool, size_t(maxc) * 4);
    char* first_in = dt == DType::f32 || n == 2 ? nullptr : scratch_[2].get<char>(opts_.pool, size_t(maxc) * es);
    // The window, then (non-f32 inputs) one f32 piece the last step combines into before storing.
    const size_t window_bytes = size_t(kWindow * kSegment) * 4;
    char* window = scratch_[3].get<char>(opts_.pool, window_bytes + (dt == DType::f32 ? 0 : size_t(kSegment) * 4));
    float* staged = dt == DType::f32 ? nullptr : reinterpret_cast<float*>(window + window_bytes);
    auto cnt = [&](int i) { return offs[size_t(i) + 1] - offs[size_t(i)]; };
    auto segments = [](int64_t count) { return std::max<int64_t>(1, (count + kSegment - 1) / kSegment); };
    std::vector<MPI_Request> rreqs, sreqs;
    for (int s = 0; s <= n - 2; ++s) {
      int sc = mod(r - s - 1, n), rc = mod(r - s - 2, n);
      bool first = s == 0, last = s == n - 2;
      float* rx = partial[s & 1];
      const float* tx = partial[(s + 1) & 1];
      DType rdt = first ? dt : DType::f32;
      const size_t res = dtype_size(rdt);
      char* rbuf = last ? window : first && dt != DType::f32 ? first_in : reinterpret_cast<char*>(rx);
      const char* sbuf = first ? send + size_t(offs[size_t(sc)]) * es : reinterpret_cast<const char*>(tx);
      DType sdt = first ? dt : DType::f32;
      // Pieces of kSegment elements, so each is combined while it is still in cache; piece k of
      // the last step lands in window slot k % kWindow, posted when the slot's last piece is done.
      const int64_t nr = segments(cnt(rc));
      auto piece = [&](int64_t k) { return std::pair{k * kSegment, std::min(kSegment, cnt(rc) - k * kSegment)}; };
      auto post = [&](int64_t k) {
        auto [o, len] = piece(k);
        char* at = last ? window + size_t(k % kWindow) * size_t(kSegment) * res : rbuf + size_t(o) * res;
        irecv(at, len, rdt, prev, 0, coll_, rreqs);
      };
      for (int64_t k = 0; k < (last ? std::min<int64_t>(nr, kWindow) : nr); ++k) post(k);
      for (int64_t k = 0, ns = segments(cnt(sc)); k < ns; ++k) {
        int64_t o = k * kSegment, len = std::min(kSegment, cnt(sc) - o);
        isend(sbuf + size_t(o) * dtype_size(sdt), len, sdt, next, 0, coll_, sreqs);
      }
      auto waiting = [&] { return no_data_message("ring", s, 2 * (n - 1)); };
      const char* own = send + size_t(offs[size_t(rc)]) * es;
      for (int64_t k = 0; k < nr; ++k) {
        wait_requests(&rreqs[size_t(k)], 1, nullptr, waiting);
        auto [o, len] = piece(k);
        const char* mine = own + size_t(o) * es;
        if (!last) {
          detail::combine(rx + o, rbuf + size_t(o) * res, rdt, mine, dt, len, op);
          continue;
        }
        const char* in = window + size_t(k % kWindow) * size_t(kSegment) * res;
        if (dt == DType::f32) {
          detail::combine(static_cast<float*>(out) + o, in, rdt, mine, dt, len, op);
        } else {
          detail::combine(staged, in, rdt, mine, dt, len, op);
          detail::store_f32(static_cast<char*>(out) + size_t(o) * es, dt, staged, len);
        }
        if (k + kWindow < nr) post(k + kWindow);
      }
      rreqs.clear();
      wait_all(sreqs, nullptr, [&] {
        return fmt::format("ring step {} of {}: rank {} did not take the data", s + 1, 2 * (n - 1),
                           world_ranks_[size_t(next)]);
      });
    }
  }

  // What a rank waiting for step s (of `steps`) of a ring phase names: the data comes from prev,
  // which forwards what it received, so any rank of the chain prev, prev - 1, ..., r - 1 - s may
  // be the one that has not arrived (exactly prev at the first step).
  std::string no_data_message(const char* phase, int s, int steps) const {
    const int n = size_, r = rank_;
    std::string chain;
    for (int k = 0; k <= s && k < n - 1; ++k)
      chain += fmt::format("{}{}", k ? ", " : "", world_ranks_[size_t(mod(r - 1 - k, n))]);
    if (s == 0)
      return fmt::format("{} step 1 of {}: no data from rank {}; rank {} has not arrived or is stalled", phase, steps,
                         chain, chain);
    return fmt::format("{} step {} of {}: no data from rank {}; one of ranks {} (the data's way round the ring) has "
                       "not arrived or is stalled",
                       phase, s + 1, steps, world_ranks_[size_t(mod(r - 1, n))], chain);
  }

  // Ring all-gather in place: buf holds this rank's chunk at offs[r]; step s passes chunk r-s on.
  // after_reduce: the second half of an all-reduce, whose steps are numbered on from the
  // reduce-scatter's; the chunk a rank waits for was reduced round the whole ring, so any rank
  // may be the one holding it up.
  void ring_all_gather(char* buf, const std::vector<int64_t>& offs, DType dt, bool after_reduce = false) {
    const int n = size_, r = rank_;
    const int next = mod(r + 1, n), prev = mod(r - 1, n);
    const size_t es = dtype_size(dt);
    auto cnt = [&](int i) { return offs[size_t(i) + 1] - offs[size_t(i)]; };
    std::vector<MPI_Request> rreqs, sreqs;
    for (int s = 0; s <= n - 2; ++s) {
      int sc = mod(r - s, n), rc = mod(r - s - 1, n);
      irecv(buf + size_t(offs[size_t(rc)]) * es, cnt(rc), dt, prev, 1, coll_, rreqs);
      isend(buf + size_t(offs[size_t(sc)]) * es, cnt(sc), dt, next, 1, coll_, sreqs);
      // The receive and the send are waited for apart, so a rank blocked on a stalled receiver
      // names the receiver rather than its own sender.
      const int step = after_reduce ? n - 1 + s : s, steps = after_reduce ? 2 * (n - 1) : n - 1;
      const char* phase = after_reduce ? "ring" : "gather";
      wait_all(rreqs, nullptr, [&] { return no_data_message(phase, step, steps); });
      wait_all(sreqs, nullptr, [&] {
        return fmt::format("{} step {} of {}: rank {} did not take the data", phase, step + 1, steps,
                           world_ranks_[size_t(next)]);
      });
    }
  }

  MPI_Comm coll_ = MPI_COMM_NULL;
  MPI_Comm p2p_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  std::vector<int> world_ranks_;
  std::string what_;
  Clock::time_point deadline_{};
  Scratch scratch_[4];  // ring partials (2 x f32), bf16 first-step input, the last step's window
};

}  // namespace

namespace {

// (rank, size) of this process among the job's processes on its host. Collective.
std::pair<int, int> host_ranks() {
  int rank = 0, local = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm host;
  LOOM_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &host));
  MPI_Comm_rank(host, &local);
  MPI_Comm_size(host, &size);
  MPI_Comm_free(&host);
  return {local, size};
}

}  // namespace

MpiSession::MpiSession(int* argc, char*** argv) {
  int init = 0;
  MPI_Initialized(&init);
  int provided = 0;
  if (!init) {
    LOOM_MPI(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
    owner_ = true;
  } else {
    MPI_Query_thread(&provided);
  }
  thread_multiple_ = provided >= MPI_THREAD_MULTIPLE;
  if (g_health == MPI_COMM_NULL) LOOM_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &g_health));
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
  local_size_ = host_ranks().second;
}

int mpi_local_rank() {
  int init = 0;
  MPI_Initialized(&init);
  LOOM_CHECK(init, "mpi_local_rank: MPI is not initialised");
  return host_ranks().first;
}

MpiSession::~MpiSession() {
  int fin = 0;
  MPI_Finalized(&fin);
  if (owner_ && !fin) MPI_Finalize();
}

std::unique_ptr<Comm> mpi_world(CommOptions opts) {
  int init = 0;
  MPI_Initialized(&init);
  LOOM_CHECK(init, "mpi comm: MPI is not initialised (create an MpiSession first)");
  LOOM_CHECK(opts.timeout.count() > 0, "mpi comm: timeout must be positive, got {} ms", opts.timeout.count());
  MPI_Comm c;
  LOOM_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &c));
  return std::make_unique<MpiComm>(c, opts);
}

void mpi_abort(const std::string& msg, int code) {
  if (g_aborting.exchange(true)) wait_for_the_abort();  // another thread of this rank is aborting
  std::fprintf(stderr, "%s\n", msg.c_str());
  std::fflush(stderr);
  std::fflush(stdout);
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

int run_mpi(int* argc, char*** argv, const std::function<void(Comm&)>& fn, CommOptions opts) {
  MpiSession session(argc, argv);
  try {
    auto world = mpi_world(opts);
    fn(*world);
  } catch (const std::exception& e) {
    mpi_abort(fmt::format("loom: rank {} of {} failed: {}", session.rank(), session.size(), e.what()), 1);
  } catch (...) {
    mpi_abort(fmt::format("loom: rank {} of {} failed: unknown exception", session.rank(), session.size()), 1);
  }
  return 0;
}

}  // namespace loom::comm

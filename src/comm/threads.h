// The threads backend: every rank is a thread of one process and the collectives work directly
// in shared memory (no staging copies). The default backend, so a laptop runs dp=4.
//
//   ThreadWorld world(4);                  // shared state, created once
//   auto c = world.comm(rank);             // in rank's thread: its handle
//
// or, simpler, run_ranks(4, [](Comm& c) { ... }) launches the threads and propagates the first
// exception. A rank that throws marks the world failed: every collective blocked on another rank
// (and every later one) throws loom::Error naming the failed rank within milliseconds. A wait
// longer than the timeout throws naming the call and the ranks that did not arrive.
//
// Algorithm: reduce-scatter + all-gather over the ranks' own buffers. Rank r reduces chunk r
// (chunk_range) reading every rank's input once, in the ring order of comm.h, and the others then
// copy it: each rank reads ~2x and writes ~1x its buffer, independent of the world size.
// Synchronisation is per rank (arrival, chunk-ready and done counters; a rank sleeps on its
// group's condition variable only after spinning briefly); no lock is held while data moves.
#pragma once
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/comm.h"

namespace loom::comm {

namespace detail {
struct ThreadWorldState;
struct ThreadGroup;
}  // namespace detail

class ThreadWorld {
 public:
  explicit ThreadWorld(int size, CommOptions opts = {});
  ~ThreadWorld();
  ThreadWorld(const ThreadWorld&) = delete;
  ThreadWorld& operator=(const ThreadWorld&) = delete;

  int size() const;
  // The handle of `rank` on the whole world; once per rank, used by that rank's thread only.
  // Handles (and communicators split from them) may outlive the ThreadWorld.
  std::unique_ptr<Comm> comm(int rank);
  // Marks the world failed because `rank` failed with message `what` (the first call wins).
  void fail(int rank, const std::string& what);
  // The first rank that failed, or -1, and its message ("" while none failed).
  int failed_rank() const;
  std::string failure() const;
  const CommOptions& options() const { return opts_; }

 private:
  std::shared_ptr<detail::ThreadWorldState> state_;
  std::shared_ptr<detail::ThreadGroup> root_;
  CommOptions opts_;
  std::mutex mu_;
  std::vector<bool> issued_;
};

struct RunOptions {
  CommOptions comm;
  // OpenMP threads for each rank's kernels; 0: max(1, omp_get_max_threads() / n), so the ranks
  // share the cores instead of oversubscribing them.
  int threads_per_rank = 0;
};

// The OpenMP threads each of n ranks gets under `opts` (see RunOptions::threads_per_rank).
int threads_per_rank(int n, const RunOptions& opts = {});

// Runs body(r) on a thread for each rank r of `world` and joins them all. A thread that cannot be
// started fails the world as its rank (the ranks already running then fail at their next
// collective), and once they have ended a loom::Error "<context>: cannot start the thread of rank
// r of n: ..." is thrown. Once the world has failed, the ranks still running are waited for as long
// as a collective waits (CommOptions::timeout, at least 1 s). A rank that has not returned by then
// (stalled outside any collective) cannot be stopped, and it still uses what the callers hold: the
// process then prints "loom: error: <context>: rank F of n failed: ...; rank R did not stop ..."
// and ends with status 1 at once (std::_Exit, as MPI_Abort ends an MPI job).
void run_rank_threads(ThreadWorld& world, const std::function<void(int)>& body, const std::string& context);

// Runs fn(comm) on n threads, one per rank, and returns when all are done. If ranks throw, the
// exception of the first rank that failed is rethrown (the others' are consequences of it).
void run_ranks(int n, const std::function<void(Comm&)>& fn, const RunOptions& opts = {});

}  // namespace loom::comm

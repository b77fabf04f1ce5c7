// Chrome traces (chrome://tracing, Perfetto): complete events {"name", "ph": "X", "ts", "dur",
// "pid": rank, "tid": stream} in microseconds since a process-wide origin. Each rank records into
// its own Trace from any of its threads; gather_trace() collects every rank's events on rank 0
// over a communicator (both backends), so one file shows all ranks.
#pragma once
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "comm/comm.h"

namespace loom::parallel {

// Streams (the "tid" of an event).
enum class TraceStream : int { compute = 0, comm = 1, wait = 2, optimizer = 3 };

class Trace {
 public:
  using Clock = std::chrono::steady_clock;
  explicit Trace(int rank, bool enabled = true) : rank_(rank), enabled_(enabled) {}
  bool enabled() const { return enabled_; }
  int rank() const { return rank_; }
  // Records an event that ran from t0 to t1 (thread-safe).
  void add(std::string name, TraceStream stream, Clock::time_point t0, Clock::time_point t1);
  size_t size() const;
  // This rank's events as JSON objects separated by commas (no brackets).
  std::string json_events() const;

 private:
  struct Event {
    std::string name;
    int tid;
    int64_t ts_us, dur_us;
  };
  int rank_;
  bool enabled_;
  mutable std::mutex mu_;
  std::vector<Event> events_;
};

// Collective over `comm`: returns, on rank 0, the JSON array of every rank's events (rank order);
// other ranks get "".
std::string gather_trace(comm::Comm& comm, const Trace& trace);

}  // namespace loom::parallel

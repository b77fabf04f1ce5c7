#include "parallel/data/trace.h"

#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace loom::parallel {

namespace {
// The origin of every timestamp of this process (first use).
Trace::Clock::time_point origin() {
  static const Trace::Clock::time_point t0 = Trace::Clock::now();
  return t0;
}
int64_t micros(Trace::Clock::duration d) { return std::chrono::duration_cast<std::chrono::microseconds>(d).count(); }
}  // namespace

void Trace::add(std::string name, TraceStream stream, Clock::time_point t0, Clock::time_point t1) {
  if (!enabled_) return;
  Event e{std::move(name), int(stream), micros(t0 - origin()), micros(t1 - t0)};
  std::lock_guard<std::mutex> lk(mu_);
  events_.push_back(std::move(e));
}

size_t Trace::size() const {
  std::lock_guard<std::mutex> lk(mu_);
  return events_.size();
}

std::string Trace::json_events() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::string out;
  for (const Event& e : events_) {
    nlohmann::json j = {{"name", e.name}, {"ph", "X"}, {"ts", e.ts_us}, {"dur", e.dur_us}, {"pid", rank_},
                        {"tid", e.tid}};
    if (!out.empty()) out += ",\n";
    out += j.dump();
  }
  return out;
}

std::string gather_trace(comm::Comm& comm, const Trace& trace) {
  (void)origin();
  std::string mine = trace.json_events();
  // Bytes travel as i32 words: lengths first, then the padded texts.
  const int n = comm.size();
  std::vector<int32_t> lens(size_t(n), 0);
  int32_t my_len = int32_t(mine.size());
  comm.all_gather(&my_len, lens.data(), n, DType::i32);
  std::vector<int64_t> words(static_cast<size_t>(n));
  int64_t total = 0;
  for (int r = 0; r < n; ++r) total += words[size_t(r)] = (int64_t(lens[size_t(r)]) + 3) / 4;
  std::vector<int32_t> send(static_cast<size_t>(words[size_t(comm.rank())]), 0);
  std::vector<int32_t> recv(static_cast<size_t>(total), 0);
  if (!mine.empty()) std::memcpy(send.data(), mine.data(), mine.size());
  comm.all_gather_v(send.data(), recv.data(), words, DType::i32);
  if (comm.rank() != 0) return "";
  std::string out = "[\n";
  const char* base = reinterpret_cast<const char*>(recv.data());
  int64_t off = 0;
  bool first = true;
  for (int r = 0; r < n; ++r) {
    if (lens[size_t(r)] > 0) {
      if (!first) out += ",\n";
      out.append(base + off * 4, size_t(lens[size_t(r)]));
      first = false;
    }
    off += words[size_t(r)];
  }
  return out + "\n]\n";
}

}  // namespace loom::parallel

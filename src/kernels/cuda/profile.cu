#include "kernels/cuda/profile.cuh"

#include "kernels/cuda/common.cuh"

#include <algorithm>

namespace loom::cuda {

StepProfile::StepProfile(cudaStream_t stream, bool in_graph) : stream_(stream), in_graph_(in_graph) {}

StepProfile::~StepProfile() {
  for (cudaEvent_t e : events_) cudaEventDestroy(e);  // no throwing from a destructor
}

cudaEvent_t StepProfile::event(size_t i) {
  while (events_.size() <= i) {
    cudaEvent_t e = nullptr;
    LOOM_CUDA_CHECK(cudaEventCreate(&e));
    events_.push_back(e);
  }
  return events_[i];
}

size_t StepProfile::part_index(const char* name) {
  for (size_t i = 0; i < parts_.size(); ++i)
    if (parts_[i].name == name) return i;
  parts_.push_back({name, 0, 0});
  return parts_.size() - 1;
}

void StepProfile::start() {
  LOOM_CHECK(!open_, "StepProfile: start() while a step is open");
  pending_.clear();
  // (In the graph, the events a capture records are made here, before it: a step of up to a
  // thousand ops, or of as many as the last one marked.)
  if (in_graph_) event(std::max<size_t>(1024, 2 * last_.size()));
  LOOM_CUDA_CHECK(cudaEventRecord(event(0), stream_));
  open_ = true;
}

void StepProfile::mark(const char* part, double flops) {
  const bool captured = in_graph_ && stream_capturing(stream_);
  if (!open_) {
    LOOM_CHECK(!captured,
               "StepProfile: op '{}' was captured into a graph while no step was open (start() first): the graph "
               "would hold no events",
               part);
    return;
  }
  const size_t i = part_index(part);
  // Captured: an event-record node (external: a plain record in a capture is only an ordering, and
  // the flag is refused outside a capture).
  LOOM_CUDA_CHECK(cudaEventRecordWithFlags(event(pending_.size() + 1), stream_,
                                           captured ? cudaEventRecordExternal : cudaEventRecordDefault));
  pending_.push_back({i, flops, captured});
}

void StepProfile::finish() {
  LOOM_CHECK(open_, "StepProfile: finish() without start()");
  open_ = false;
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (in_graph_) {
    // A step that marked captured its graph (its first interval holds the host's capture) or ran
    // ops outside a graph: not counted. The replays after a capture are, with its marks.
    if (!pending_.empty()) {
      if (std::all_of(pending_.begin(), pending_.end(), [](const Mark& m) { return m.captured; })) last_ = pending_;
      return;
    }
    LOOM_CHECK(!last_.empty(), "StepProfile: a step in the graph without a capture before it (nothing to time)");
    pending_ = last_;
  }
  for (size_t k = 0; k < pending_.size(); ++k) {
    float ms = 0;
    LOOM_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[k], events_[k + 1]));
    Part& p = parts_[pending_[k].part];
    p.ms += ms;
    p.flops += pending_[k].flops;
  }
  ++steps_;
}

double StepProfile::total_ms() const {
  double t = 0;
  for (const Part& p : parts_) t += p.ms;
  return t;
}

}  // namespace loom::cuda

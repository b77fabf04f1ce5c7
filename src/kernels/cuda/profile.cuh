// Where a GPU step's time goes, without a profiler: CUDA events recorded on one stream between
// the parts of the step (mark), and the time between consecutive events charged to the part that
// ends there. Kernels of one stream run in order, so an interval is the part's kernels plus any
// idle time of the GPU before them.
//   Op by op (the default): the step runs eagerly, and the intervals include the GPU's idle time
//   while the host launched the kernels one by one (small kernels look larger than they are).
//   In the graph (in_graph): the marks are captured into the step's CUDA graph as event-record
//   nodes (cudaEventRecordExternal), recorded again by every replay; the intervals are the parts'
//   kernels as the graphed step runs them. A step whose ops marked (the capture) is not counted;
//   the steps after it (replays, whose ops do not mark) are, with the capture's marks. One graph
//   replay per step (StepRunner::train_step): a step that also runs ops outside the graph
//   (gradient accumulation's optimizer step) is not counted.
// The step runner marks the start of a step's ops (Backend::step_begins): the interval before
// it, "(before the step)", is the host's work ahead of the step's first kernel (the batch's upload,
// the graph's launch).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/backend.h"

namespace loom::cuda {

// As a backend's OpObserver (Backend::set_observer), every op marks itself.
class StepProfile final : public OpObserver {
 public:
  struct Part {
    std::string name;
    double ms = 0;     // summed over the profiled steps
    double flops = 0;  // declared by the marks, summed over the profiled steps
  };

  explicit StepProfile(cudaStream_t stream, bool in_graph = false);
  ~StepProfile();
  StepProfile(const StepProfile&) = delete;
  StepProfile& operator=(const StepProfile&) = delete;

  // Opens a step: records its first event. Throws if a step is open.
  void start();
  // The work queued on the stream since the previous mark (or start) belongs to `part`, which did
  // `flops` floating-point operations. No-op outside a step.
  void mark(const char* part, double flops = 0);
  void op_done(const char* what, double flops) override { mark(what, flops); }
  bool in_graph() const override { return in_graph_; }
  // Closes the step: waits for the stream and adds the intervals to the parts (in_graph: not those
  // of a step that captured).
  void finish();

  const std::vector<Part>& parts() const { return parts_; }  // in the order first marked
  int64_t steps() const { return steps_; }
  double total_ms() const;  // all parts, all steps

 private:
  cudaStream_t stream_;
  bool in_graph_ = false;
  std::vector<cudaEvent_t> events_;  // reused across steps; [0] is the start
  struct Mark {
    size_t part = 0;
    double flops = 0;
    bool captured = false;  // recorded as a node of the graph being captured
  };
  // The marks of the open step, and (in the graph) of the last capture
  std::vector<Mark> pending_, last_;
  std::vector<Part> parts_;
  int64_t steps_ = 0;
  bool open_ = false;
  size_t part_index(const char* name);
  cudaEvent_t event(size_t i);
};

}  // namespace loom::cuda

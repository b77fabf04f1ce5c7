// Timing alternatives for one problem on the device, the first time the problem is seen: the GEMM
// algorithms (matmul.cu) and the CUDA backend's choice between kernels that give the same bits
// (backend.cu). Never while the stream is being captured into a graph.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/memory.h"
#include "kernels/cuda/common.cuh"

namespace loom::cuda {

// A choice is taken over the default only when it beats it by more than this (so noise does not
// pick).
constexpr double kTuneMargin = 0.03;
// Timing never asks the pool for more scratch than this at once (an accumulating output is timed on
// a scratch copy of itself; larger ones are not timed and keep the default).
constexpr size_t kTuneScratchBytes = size_t(32) << 20;

// LOOM_GEMM_TUNE: unset or 1 = on, 0 = off, 2 = on and print each choice to stderr.
int gemm_tuning();

bool stream_capturing(cudaStream_t stream);

// Device scratch from the pool (workspace tag) for the length of a tuning, returned on any exit.
struct TuneScratch {
  MemoryPool& pool;
  void* p = nullptr;
  size_t bytes = 0;
  TuneScratch(MemoryPool& pool, size_t n) : pool(pool), p(pool.allocate(n, MemTag::workspace)), bytes(n) {}
  ~TuneScratch() { pool.deallocate(p, bytes, MemTag::workspace); }
  TuneScratch(const TuneScratch&) = delete;
  TuneScratch& operator=(const TuneScratch&) = delete;
};

struct EventPair {
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  EventPair() {
    LOOM_CUDA_CHECK(cudaEventCreate(&e0));
    LOOM_CUDA_CHECK(cudaEventCreate(&e1));
  }
  ~EventPair() {
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
  EventPair(const EventPair&) = delete;
  EventPair& operator=(const EventPair&) = delete;
};

// Median milliseconds of `run` (which enqueues work on stream and returns false when it cannot
// run) over kTuneRuns launches after one warm-up; infinity when it cannot run.
template <class Run>
double median_ms(Run&& run, cudaStream_t stream) {
  constexpr int kTuneRuns = 5;
  if (!run()) return INFINITY;
  EventPair ev;
  std::vector<double> ms;
  for (int i = 0; i < kTuneRuns && ms.size() == size_t(i); ++i) {
    LOOM_CUDA_CHECK(cudaEventRecord(ev.e0, stream));
    const bool ok = run();
    LOOM_CUDA_CHECK(cudaEventRecord(ev.e1, stream));
    LOOM_CUDA_CHECK(cudaEventSynchronize(ev.e1));
    float t = 0.f;
    LOOM_CUDA_CHECK(cudaEventElapsedTime(&t, ev.e0, ev.e1));
    if (ok) ms.push_back(t);
  }
  if (ms.size() != size_t(kTuneRuns)) return INFINITY;
  std::sort(ms.begin(), ms.end());
  return ms[kTuneRuns / 2];
}

}  // namespace loom::cuda

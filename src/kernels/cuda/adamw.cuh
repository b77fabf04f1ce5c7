// Multi-tensor AdamW with f32 master weights: one launch updates every tensor of a list (and
// refreshes each tensor's bf16 or f16 compute copy), after one global-norm pass over all gradients that
// gives the clipping scale. Hyperparameters live in device memory, copied from pinned host memory
// by a copy that is part of the launch sequence, so the whole update can be captured in a CUDA
// graph and replayed with a new learning rate and step each time.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "core/memory.h"
#include "kernels/cuda/common.cuh"

namespace loom::cuda {

struct AdamWTensor {
  float* param = nullptr;       // f32 [n] master weights
  bf16* param_bf16 = nullptr;   // bf16 [n] compute copy, rewritten after the update (may be null)
  f16* param_f16 = nullptr;     // or an f16 [n] compute copy (train.precision fp16; may be null)
  const float* grad = nullptr;  // f32 [n]
  float* m = nullptr;           // f32 [n] first moment
  float* v = nullptr;           // f32 [n] second moment
  int64_t n = 0;
  float weight_decay = 0.f;     // decoupled, multiplied by lr
};

struct AdamWHyper {
  float lr = 3e-4f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  int64_t step = 1;        // 1-based, for bias correction
  float max_norm = 0.f;    // global-norm clipping threshold; <= 0 disables clipping
  float grad_scale = 1.f;  // > 0, applied to every gradient before the norm and clipping (1 / micro-batches)
  // >= 0 or not finite: the global norm the caller formed (its own pass is skipped); < 0: none.
  float global_norm = -1.f;
};

class MultiTensorAdamW {
 public:
  // Device tables (tensor list, chunk map, norm partials) come from `pool` under the optimizer tag.
  MultiTensorAdamW(std::vector<AdamWTensor> tensors, MemoryPool& pool);
  ~MultiTensorAdamW();
  MultiTensorAdamW(const MultiTensorAdamW&) = delete;
  MultiTensorAdamW& operator=(const MultiTensorAdamW&) = delete;

  // Host only: the values the next launch() will use. Must not be called while a launch that
  // reads the previous values may still be running (synchronise first).
  void set_hyper(const AdamWHyper& h);
  // Enqueues: hyperparameter copy, sum of squares of all gradients, norm and clip scale, update.
  void launch(cudaStream_t stream);
  // Device f32 [2]: the gradient global norm (after grad_scale) and the scale applied
  // (grad_scale * min(1, max_norm / (norm + 1e-6))), valid after launch() completes.
  const float* norm_and_scale() const { return stats_; }
  int64_t numel() const { return numel_; }

  static constexpr int64_t kChunk = 1 << 16;
  struct Chunk {  // a block's share: elements [start, start + kChunk) of one tensor
    int32_t tensor;
    int64_t start;
  };
  struct DeviceHyper {  // bc1, bc2: bias corrections 1 - beta^step
    float lr, beta1, beta2, eps, bc1, bc2, max_norm, grad_scale, global_norm;
  };

 private:
  MemoryPool& pool_;
  std::vector<AdamWTensor> tensors_;
  int64_t numel_ = 0;
  int64_t num_chunks_ = 0;
  AdamWTensor* d_tensors_ = nullptr;
  Chunk* d_chunks_ = nullptr;
  float* partials_ = nullptr;  // f32 [num_chunks]
  float* stats_ = nullptr;     // f32 [2]
  DeviceHyper* d_hyper_ = nullptr;
  DeviceHyper* h_hyper_ = nullptr;  // pinned
  size_t bytes_tensors_ = 0, bytes_chunks_ = 0, bytes_partials_ = 0;
};

// Per-block partial sums of squares (double) of the f32 ranges x[i] [n[i]] (device), in a fixed
// order: sums[i] (host) is range i's, its partials added in order on the host. One copy back and
// one synchronisation for all of them.
void sum_squares_ranges(const std::vector<const float*>& x, const std::vector<int64_t>& n, double* sums,
                        MemoryPool& pool, cudaStream_t stream);

}  // namespace loom::cuda

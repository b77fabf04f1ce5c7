// AdamW over a model's parameters (PyTorch torch.optim.AdamW semantics) with nanoGPT's parameter
// groups (weight decay on parameters of two or more dimensions only) and global-norm gradient
// clipping. The two moments are f32 tensors of each parameter's logical shape (tag optimizer).
#pragma once
#include <cstdint>
#include <vector>

#include "core/memory.h"
#include "core/tensor.h"
#include "model/param.h"

namespace loom::optim {

struct AdamWConfig {
  // Doubles, like the Python floats torch.optim.AdamW holds (the kernel rounds once, as it does).
  double lr = 6e-4;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;  // applied to parameters with dim >= 2 only
  float max_norm = 1.0f;      // global gradient-norm clip; <= 0 disables
  // GaLore (optim/galore.h): the rank the gradients of transformer blocks' matrices are projected
  // to (0: plain AdamW), the steps between projector refreshes and the projected update's scale.
  int64_t galore_rank = 0;
  int64_t galore_update_every = 200;
  double galore_scale = 0.25;
  void validate() const;      // throws naming the field
};

struct StepStats {
  double grad_norm = 0;    // global L2 norm of the gradients before clipping
  float clip_scale = 1.0f; // the factor the gradients were multiplied by
  int64_t step = 0;        // 1-based step just taken
  bool skipped = false;    // the update was not applied (a non-finite gradient norm or loss)
};

class AdamW {
 public:
  AdamW(std::vector<model::Parameter*> params, const AdamWConfig& cfg, MemoryPool& pool);

  // Clips by the global norm of this process's gradients and updates every parameter with
  // learning rate lr (the configured one when lr < 0).
  StepStats step(double lr = -1.0);
  // The same with a global norm computed elsewhere (e.g. summed over ranks).
  StepStats step_with_norm(double grad_norm, double lr = -1.0);
  // Sum of squares of all gradients (deterministic for any thread count).
  double grad_sum_squares() const;

  const AdamWConfig& config() const { return cfg_; }
  int64_t steps_taken() const { return t_; }
  void set_steps_taken(int64_t t) { t_ = t; }  // when restoring a checkpoint
  int64_t state_bytes() const;                 // declared bytes of both moments
  const std::vector<model::Parameter*>& parameters() const { return params_; }
  Tensor& exp_avg(size_t i) { return m_.at(i); }     // f32, the parameter's shape
  Tensor& exp_avg_sq(size_t i) { return v_.at(i); }  // f32, the parameter's shape

 private:
  AdamWConfig cfg_;
  std::vector<model::Parameter*> params_;
  std::vector<Tensor> m_, v_;
  int64_t t_ = 0;
};

}  // namespace loom::optim

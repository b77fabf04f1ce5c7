#pragma once
#include <cstdint>

namespace loom::cpu {

// Hyper-parameters are doubles, like the Python floats torch.optim.AdamW holds; the derived
// per-step scalars are formed in double and rounded to float once, as PyTorch does.
struct AdamWArgs {
  double lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.0;
  int64_t step = 1;          // 1-based, for bias correction
  float grad_scale = 1.0f;   // gradients are multiplied by this first (clipping, loss scaling)
};

// Decoupled weight decay, bias-corrected moments (PyTorch torch.optim.AdamW semantics):
// p *= 1 - lr * wd; m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// denom = sqrt(v) / sqrt(1 - b2^t) + eps; p -= (lr / (1 - b1^t)) * m / denom.
// g = grad * grad_scale. Element-wise, so any slice of a tensor (a ZeRO shard) updates alike.
void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWArgs& a);

// Sum of squares of x [n] in double, deterministic for any thread count.
double sum_squares(const float* x, int64_t n);

// Clip scale for a global norm: min(1, max_norm / (norm + 1e-6)); max_norm <= 0 disables.
float clip_scale(double global_norm, float max_norm);

}  // namespace loom::cpu

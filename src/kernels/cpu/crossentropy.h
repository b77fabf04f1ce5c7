// Fused softmax + cross-entropy over a vocabulary padded to Vp (a multiple of 128); columns
// [V, Vp) are padding and are masked (they never receive probability or gradient).
#pragma once
#include <cstdint>

namespace loom::cpu {

// losses f32 [N] = -log softmax(logits[n, :V])[targets[n]]; logits f32 [N, Vp]; targets i32 [N].
// A target of -1 is ignored (loss 0). Targets outside [-1, V) throw loom::Error.
void crossentropy_forward(float* losses, const float* logits, const int32_t* targets, int64_t N, int64_t V,
                          int64_t Vp);

// One pass: losses as above and dlogits [N, Vp] = dloss * (softmax - onehot) with zeros in the
// padding and in ignored rows. dlogits may alias logits (in place). dloss is the gradient of the
// reported objective with respect to each row's loss (1 / number of counted rows for a mean).
void crossentropy_forward_backward(float* losses, float* dlogits, const float* logits, const int32_t* targets,
                                   float dloss, int64_t N, int64_t V, int64_t Vp);

// The pieces for a vocabulary split over ranks (parallel/tensor/vocab_parallel.h), vectorised as
// above: the max of x [n]; the sum of exp(x - shift) over x [n] (float within chunks of 2048, the
// chunks added in double); d [n] = scale * exp(x - shift).
float row_max(const float* x, int64_t n);
double row_sum_exp(const float* x, int64_t n, float shift);
void scaled_exp(float* d, const float* x, int64_t n, float shift, float scale);

}  // namespace loom::cpu

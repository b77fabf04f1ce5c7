// Fused softmax + cross-entropy (+ the logits' gradient) over a vocabulary padded to Vp; columns
// [V, Vp) are padding: masked out of the softmax and given zero gradient. bf16 or f16 logits, f32 math.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/common.cuh"

namespace loom::cuda {

// losses f32 [N] = -log softmax(logits[n, :V])[targets[n]]; logits [N, Vp]; targets i32 [N]
// (device). A target of -1 gives loss 0; other targets outside [0, V) give NaN (validate on the
// host with check_token_ids). Vp must be a multiple of 8.
template <class T>  // bf16 or f16
void crossentropy_forward(float* losses, const T* logits, const int32_t* targets, int64_t N, int64_t V, int64_t Vp,
                          cudaStream_t stream);

// One kernel: losses as above and dlogits [N, Vp] = dloss * (softmax - onehot), zeros in the
// padding and in ignored rows. dlogits may alias logits (in place, as the model does). losses may
// be null.
template <class T>  // bf16 or f16
void crossentropy_forward_backward(float* losses, T* dlogits, const T* logits, const int32_t* targets, float dloss,
                                   int64_t N, int64_t V, int64_t Vp, cudaStream_t stream);

// Backend::vocab_crossentropy (core/backend.h) on logits [N, Vs], columns [v0, v0 + Vs) of a
// vocabulary of V real columns: pass 0 (max), 1 (sums), 2 (finish); stats f32 [3 N] (device).
template <class T>  // bf16 or f16
void vocab_crossentropy(int pass, float* losses, T* dlogits, const T* logits, const int32_t* targets, float* stats,
                        float dloss, int64_t N, int64_t Vs, int64_t v0, int64_t V, cudaStream_t stream);

}  // namespace loom::cuda

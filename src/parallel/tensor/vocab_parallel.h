// Vocabulary-parallel cross-entropy (Megatron style): rank r of the tp group holds columns
// [v0, v0 + Vs) of the (padded) vocabulary's logits, v0 = r * Vs. Columns >= V are padding: never
// given probability or gradient. No rank ever holds the full logits; the loss is assembled from
// three per-row statistics reduced over the group (max, sum of exp, target logit). (The
// vocabulary-parallel embedding is the backend's embedding op with a vocabulary split.)
#pragma once
#include <cstdint>

#include "comm/comm.h"
#include "core/backend.h"

namespace loom::parallel::tp {

struct VocabCEArgs {
  DType dtype = DType::f32;  // the logits'
  int64_t N = 0;   // rows
  int64_t Vs = 0;  // columns of this shard
  int64_t v0 = 0;  // global index of the shard's first column
  int64_t V = 0;   // real vocabulary (columns >= V are padding)
  float dloss = 0; // gradient of the objective with respect to each counted row's loss
};

// Collective over g (null: one rank; a communicator that takes the backend's buffers). losses f32
// [N] = -log softmax(full logits row)[target]; targets i32 [N] in [-1, V) (-1: ignored, loss 0,
// gradient 0; the caller checks the range). With dlogits ([N, Vs], may alias logits) also writes
// dloss * (softmax - onehot) for this shard's columns (0 in padding). stats: f32 [3N] scratch (the
// reduced statistics). Every buffer is in the backend's memory: Backend::vocab_crossentropy's
// passes, the statistics reduced over g between them.
void vocab_cross_entropy(comm::Comm* g, Backend& be, float* losses, void* dlogits, const void* logits,
                         const int32_t* targets, float* stats, const VocabCEArgs& a);

}  // namespace loom::parallel::tp

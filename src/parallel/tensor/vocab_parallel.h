// Vocabulary-parallel embedding and cross-entropy (Megatron style): rank r of the tp group holds
// rows [v0, v0 + Vs) of the (padded) vocabulary, v0 = r * Vs. Rows >= V are padding: never
// looked up, never given probability or gradient. No rank ever holds the full logits; the loss is
// assembled from three per-row statistics reduced over the group (max, sum of exp, target logit).
#pragma once
#include <cstdint>

#include "comm/comm.h"
#include "core/memory.h"

namespace loom::parallel::tp {

// Rows per rank of a vocabulary of padded size Vp split over tp ranks (ceil; the last shard may
// end in extra padding rows).
int64_t vocab_shard_rows(int64_t Vp, int tp);

// out f32 [N, C] = wte_shard[tokens[n] - v0] for tokens of this shard, 0 for the others (the
// forward of the embedding before the reduction over the group). tokens i32 [N] in [0, V), else
// loom::Error naming the position.
void vocab_embedding_forward(float* out, const int32_t* tokens, const float* wte_shard, int64_t N, int64_t C,
                             int64_t v0, int64_t Vs, int64_t V);
// dwte_shard f32 [Vs, C] += dout rows of the tokens of this shard (in row order: deterministic).
void vocab_embedding_backward(float* dwte_shard, const float* dout, const int32_t* tokens, int64_t N, int64_t C,
                              int64_t v0, int64_t Vs);

struct VocabCEArgs {
  int64_t N = 0;   // rows
  int64_t Vs = 0;  // columns of this shard
  int64_t v0 = 0;  // global index of the shard's first column
  int64_t V = 0;   // real vocabulary (columns >= V are padding)
  float dloss = 0; // gradient of the objective with respect to each counted row's loss
};

// Collective over g (null: one rank). losses f32 [N] = -log softmax(full logits row)[target];
// targets i32 [N] in [-1, V) (-1: ignored, loss 0, gradient 0). With dlogits (f32 [N, Vs], may
// alias logits) also writes dloss * (softmax - onehot) for this shard's columns (0 in padding).
// scratch: f32 [3N] from the caller (the reduced statistics).
void vocab_cross_entropy(comm::Comm* g, float* losses, float* dlogits, const float* logits, const int32_t* targets,
                         float* scratch, const VocabCEArgs& a);

}  // namespace loom::parallel::tp

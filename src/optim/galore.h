// GaLore (Zhao et al. 2024, "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank
// Projection"): AdamW whose moments for the matrices of the transformer blocks live in a low-rank
// subspace of their gradients.
//
// For a block matrix W [m, n] (the attention and MLP linears, "h.<i>.*" of two dimensions; not the
// embeddings or an untied head; a Llama block's fused c_attn and c_fc as the matrices Hugging Face
// keeps apart, q, k, v and gate, up, each on its own, as the reference implementation projects
// LlamaForCausalLM's modules) and rank r < min(m, n): every `galore_update_every` optimizer steps
// from the first, the step's gradient G gives a projector from its SVD G = U S V^T:
//   m <  n: P = U[:, :r]   [m, r]   (left),  R = P^T G  [r, n]
//   m >= n: Q = V^T[:r, :] [r, n]   (right), R = G Q^T  [m, r]
// (the reference implementation's choice of side). Adam runs on R (both moments of R's shape,
// kept across refreshes as the reference implementation keeps them), and the normalized step
// N = m_hat / (sqrt(v_hat) + eps) goes back to W's space, scaled by `galore_scale`:
//   W = W (1 - lr wd) - lr * scale * (P N  or  N Q)
// (decoupled weight decay first, in torch.optim.AdamW's order; clipping scales G before R is
// formed). The state per such matrix is 2 r max(m, n) moment elements and r min(m, n) projector
// elements instead of AdamW's 2 m n. Every other parameter takes the element-wise AdamW of
// optim/sharded_adamw.h. The singular vectors are the top eigenvectors of G's Gram matrix on its
// smaller side, in double (LAPACK's dsyrk and dsyevr, from OpenBLAS).
//
// GaLore needs each matrix whole on the rank that updates it: it runs over the whole flat buffer
// of ZeRO stage 0, not under tensor parallelism or ZeRO 1-3, where a rank holds pieces of
// matrices. The data-parallel ranks, which all hold the same reduced gradient, share a refresh:
// each projector is computed by one of them and broadcast (refresh_projectors).
#pragma once
#include <cstdint>
#include <array>
#include <functional>
#include <string>
#include <vector>

#include "core/memory.h"
#include "core/tensor.h"
#include "optim/flat_optimizer.h"

namespace loom::optim {

// One matrix GaLore treats on its own: a parameter, or one of the row blocks a fused one stacks.
struct GaLorePart {
  std::string label;       // "" (the whole parameter), or its row block's ("q", "k", "v", "gate", "up")
  int64_t row0 = 0, rows = 0;
  bool low_rank = false;   // projected (else plain AdamW on the block: rank not below its smaller side)
  bool left = false;       // P [m, r] on the left (m < n); else Q [r, n] on the right
  Shape moments;           // projected: [r, n] or [m, r]; else [rows, n]
  Shape projector;         // [m, r] or [r, n] (projected only)
};
// How GaLore treats a parameter of this name and logical shape at `rank`, stacking `row_blocks`.
struct GaLoreShapes {
  bool low_rank = false;          // some matrix of it projected (its state is then per part)
  std::vector<GaLorePart> parts;  // low_rank: its matrices in row order
};
GaLoreShapes galore_shapes(const std::string& name, const Shape& shape, int64_t rank,
                           const std::vector<std::pair<std::string, int64_t>>& row_blocks = {});
// A part's checkpoint tensor: `kind` ("galore_m/", "adam_v/", ...) + the parameter's name, and
// "[label]" for a row block ("galore_m/h.0.attn.c_attn.weight[q]").
std::string galore_state_name(const std::string& kind, const std::string& param, const GaLorePart& part);
// A part's state tensors in the checkpoint, in the order of GaLore::PartState's exp_avg,
// exp_avg_sq and projector: "galore_m/", "galore_v/", "galore_p/" names when projected, else
// "adam_m/", "adam_v/" and "" (no projector).
std::array<std::string, 3> galore_part_tensors(const std::string& param, const GaLorePart& part);

// The top-r singular vectors of G [m, n] (row-major f32), in double, largest first: left:
// U[:, :r] into out [m, r]; else V^T[:r, :] into out [r, n] (row-major). They are the top
// eigenvectors of G G^T [m, m] (left) or G^T G [n, n] (LAPACK dsyrk + dsyevr; 5x faster than
// dgesdd at GPT-2's shapes). Scratch from `pool` (tag workspace), freed on return. Throws naming
// `what` when LAPACK fails.
void top_singular_vectors(const float* G, int64_t m, int64_t n, int64_t r, bool left, float* out, MemoryPool& pool,
                          const std::string& what);

class GaLore final : public FlatOptimizer {
 public:
  // segments: the logical parameter elements of the flat buffer (sorted, disjoint); [begin, end)
  // must hold every projected segment whole. State (tag optimizer) from state_pool; the
  // projected gradient and step (tag workspace, kept) and each SVD's scratch (freed) from work_pool.
  GaLore(std::vector<FlatSegment> segments, int64_t begin, int64_t end, const AdamWConfig& cfg,
         MemoryPool& state_pool, MemoryPool& work_pool);

  // Refreshes the projectors first when the step is due one (unless refresh_projectors did: alone,
  // as refresh_projectors(grad_shard, 0, 1, no-op)).
  StepStats step(float* param_shard, const float* grad_shard, double global_norm, double lr = -1.0) override;
  int64_t state_bytes() const override;

  // Whether the next step takes new projectors.
  bool refresh_due() const { return t_ % cfg_.galore_update_every == 0; }
  // The next step's projectors over `ranks` holders of the same reduced gradient: this one
  // computes those of the projected matrices i with i % ranks == rank, and share(projector,
  // owner) makes every holder's copy the owner's (a broadcast). One computation per matrix, so
  // the holders keep identical weights even where their LAPACK would round differently.
  void refresh_projectors(const float* grad_shard, int rank, int ranks,
                          const std::function<void(Tensor& projector, int owner)>& share);

  // One per segments() entry, in its order.
  struct PartState {
    Tensor exp_avg, exp_avg_sq;  // f32 part.moments
    Tensor projector;            // f32 part.projector (projected only)
  };
  struct State {
    GaLoreShapes shapes;
    Tensor exp_avg, exp_avg_sq;   // f32 [seg length] (not low_rank)
    std::vector<PartState> parts;  // one per shapes.parts (low_rank)
  };
  std::vector<State>& states() { return states_; }
  const std::vector<State>& states() const { return states_; }
  int64_t refreshes() const { return refreshes_; }  // SVDs taken so far by this object

 private:
  std::vector<State> states_;
  MemoryPool& work_pool_;
  Tensor work_r_, work_d_;  // the projected gradient and Adam's step, f32 [largest moments]
  int64_t refreshes_ = 0;
  int64_t refreshed_for_ = 0;  // the step whose projectors refresh_projectors took (0: none)
};

}  // namespace loom::optim

// Activation recomputation (checkpointing) over the chain's transformer blocks: which blocks keep
// their saved activations from forward to backward, and which are run forward again in backward
// from a kept input (Chen et al. 2016, "Training deep nets with sublinear memory cost").
//
// A plan is a set of disjoint recomputed segments [first, last] of the L blocks. In forward a
// block of a segment drops what it saved as soon as the next block has read its output, except
// the segment's last block, whose output is the next part's input; in backward the segment's
// blocks run forward again from the segment's input (the output before it, kept), then backward,
// and each is freed after its backward. Every other block keeps everything (none). The results
// are bit-identical to not recomputing: the same kernels on the same values.
//
// Peak saved-activation bytes of a plan (what the pools reach; plan_peak computes it): with A the
// embedding's and the head's bytes, F_l block l's (saved_activations), o_l its output's,
//   A + sum over kept blocks of F_l + max over segments s of (sum over segments t before s of
//   o_last(t) + sum over blocks of s of F_l)
// reached in the backward of the segment s that maximises it (segments are recomputed from the
// last one back; those already done are freed). A pipeline stage holds n micro-batches at once
// (ChainMemory::in_flight, the schedule's bound for the rank): the other n - 1 each keep their
// share, A + the kept blocks' F_l + every segment's last output, so the peak is
//   n (A + sum over kept blocks of F_l) + (n - 1) sum over segments t of o_last(t)
//     + max over segments s of (sum over segments t before s of o_last(t) + sum over blocks of s of F_l)
// and under a split backward (ChainMemory::split_backward), with q of the n micro-batches past
// their input-gradient pass (each holding every recomputed block's F_l until its weight pass),
//   n (A + sum over kept blocks of F_l) + (n - q) sum over segments t of o_last(t)
//     + q sum over recomputed blocks of F_l
// at the largest over the schedule's (n, q) pairs.
//
// Policies (memory.recompute): none; full (every block a segment of its own: each keeps only its
// input, Megatron-LM's full recomputation with one layer per group); every-k (segments of k =
// memory.recompute_every blocks, Megatron's "uniform" method); sqrt (k = ceil(sqrt(L)), Chen's
// sqrt(n) segments); optimal (the plan of least recompute time whose peak fits
// memory.activation_budget, solved exactly by a dynamic program; see plan_recompute); selective
// (Korthikanti et al. 2022: no segments; every block keeps all but the attention's output and
// log-sum-exps, which backward computes again from the saved q, k, v: loom's attention kernels
// keep no T x T matrix, so this is the part of the attention a block can drop).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace loom::model {

enum class Recompute : uint8_t { none, full, every_k, sqrt, optimal, selective };
std::string_view recompute_name(Recompute r);
// The policy of that name, or nullopt.
std::optional<Recompute> recompute_parse(std::string_view name);
// Throws naming `field` and the choices.
Recompute recompute_from_name(std::string_view name, const std::string& field);

struct RecomputePlan {
  int64_t blocks = 0;                                   // L
  std::vector<std::pair<int64_t, int64_t>> segments;    // [first, last] block indices, in order
  bool selective = false;  // every block computes its attention output again in backward
  bool recomputed(int64_t l) const;
  // The segment holding block l (its index in segments), or -1.
  int segment_of(int64_t l) const;
  int64_t recomputed_blocks() const;
  // "h.0-h.3, h.4-h.7" or "none".
  std::string describe() const;
};

// What the planner knows of the chain at one micro-batch shape, in bytes (from the blocks'
// declarations) and relative forward cost: per transformer block its saved bytes, its output's
// bytes and its forward cost; and the embedding's plus the head's saved bytes.
struct ChainMemory {
  std::vector<double> full, out, forward;
  double fixed = 0;
  double in_flight = 1;  // micro-batches held at once (a pipeline stage's; 1 for a whole model)
  // A split backward (zero bubble) recomputes a segment in its input-gradient pass and keeps it
  // for the deferred weight gradients: a micro-batch past its input-gradient pass then holds every
  // recomputed block's F at once, not one segment's, until its weight pass.
  bool split_backward = false;
  // Under a split backward, the (micro-batches in flight, micro-batches of them past their
  // input-gradient pass) pairs at which the stage's holdings can peak, read off its schedule
  // (ZB-H1 delays rank r's weight passes by r micro-batches); empty: (in_flight, 1).
  std::vector<std::pair<double, double>> split_peaks;
};

// The (in flight, past the input-gradient pass) pairs of ChainMemory::split_peaks, or its default.
std::vector<std::pair<double, double>> split_peaks(const ChainMemory& c);

// The plan of `policy` for the chain (`every` is every-k's k; `budget` the optimal policy's bytes).
// optimal: the least recompute cost (sum of the recomputed blocks' forward cost) whose plan_peak
// is at most budget; among those the smallest peak. Throws when even recomputing every block as
// well as possible does not fit, naming the budget and the least peak possible.
RecomputePlan plan_recompute(Recompute policy, const ChainMemory& c, int64_t every = 2, double budget = 0);
double plan_peak(const RecomputePlan& p, const ChainMemory& c);
// What one micro-batch keeps from its forward to its backward under the plan: A, the kept blocks'
// F_l and every segment's last output (each of the n - 1 others in flight at the peak).
double plan_kept(const RecomputePlan& p, const ChainMemory& c);
double plan_cost(const RecomputePlan& p, const ChainMemory& c);
// Of a chain of identical blocks (as the optimal policy solves), every plan some budget and some
// holding of micro-batches can need: recomputing nothing, and for each count R of recomputed
// blocks and S of segments the segmentation of least peak (two plans of the same R and S differ
// in that alone: what a micro-batch keeps and the recompute are the same), in order of R, then S.
// The joint plan of interleaved chunks (pipeline/executor.cpp) chooses among them.
std::vector<RecomputePlan> recompute_candidates(const ChainMemory& c);

}  // namespace loom::model

// The planner: for a model on a cluster, each layout's per-device memory by tag and step time
// (compute, recomputation, exposed communication, pipeline bubble), and a search over layouts.
//
// Memory per device (bytes). Model state of the parameters a device holds, P (its tensor-parallel
// part of its pipeline stage's layers, plus the embedding or head its stage carries), by
// precision: `mixed` as ZeRO and Megatron-LM account it (16-bit weights and gradients, 12 bytes of
// f32 master weights and Adam moments per parameter), `f32` as loom's CPU trainer holds it (f32
// weights, gradients and moments: 4 + 4 + 8), `device` as loom's device runs hold it (the same and
// a bf16 compute copy of the weights: 4 + 2 + 4 + 8; under ZeRO-3 bf16 copies of the two gathered
// blocks instead). Offload (Layout::offload) moves the optimizer state to the host, which also
// keeps an f32 gradient staging copy and, in loom's pools, an f32 master copy of what the rank
// updates (Estimate::host_memory; a layout fits when both fit). ZeRO 1 divides the optimizer state by dp, 2 the
// gradients too, 3 the weights too. Activations of one micro-batch and layer follow Korthikanti et
// al. 2022 for 16-bit training (s b h (34 + 5 a s / h), with tensor parallelism
// s b h (10 + 24 / t + 5 a s / (h t)), with sequence parallelism s b h (34 + 5 a s / h) / t; selective
// recomputation drops the 5 a s / h term; full recomputation keeps the layer's input, 2 s b h, /t
// under sp) and, for f32 and device, loom's own declarations (the blocks' saved tensors,
// model/blocks.h, in f32 or bf16 with their row statistics in f32); a
// pipeline stage holds them for the micro-batches its schedule keeps in flight (the schedule's own
// instruction lists, simulated by the checker; in loom's pools each chunk at its own size, at the
// largest sum along the rank's list), plus the logits on the last stage. For f32 and
// device the model also counts what loom's pools hold beside them (the backward scratch, ZeRO-3's gather
// buffers, ZeRO-2/3's bucket arena, ring attention's blocks) and, for a pipeline, the fullest rank
// as the executor lays it out (stages cut by cost, each rank's simulated in-flight micro-batches);
// bench/plan_truth.sh compares it with measured runs, and tests/cli/plan_device_truth_cli_test.cpp
// the device model with runs on the emulated device. Not in device's figures: the backend's own
// scratch (on CUDA its BLAS handles' workspaces, 32 MiB each, and cuDNN's). Key and value heads
// are one a rank where tp exceeds them (replicated). On a shared host (the cpu cluster) the
// node's ranks divide its calibrated rates.
//
// Time per step. Each micro-batch's forward and backward (2x) of a stage's layers: the matrix
// products at the device's calibrated rate, the element-wise kernels (norms, residual adds,
// activation functions, dropout, and without flash attention the scores' softmax, mask and
// dropout) at its memory bandwidth; full recomputation adding a forward, selective the attention
// core's; tensor
// parallelism's all-reduces (2 per layer forward, 2 backward; all-gather plus reduce-scatter of
// the same volume under sp) on the link its group spans; the pipeline's point-to-point transfers;
// the schedule's makespan from the real instruction lists (checker's simulation with these
// durations); data parallelism's collectives as loom's DataParallel runs them (rings over the
// shard: ZeRO-0 all-reduces the gradients once a step, ZeRO-1 reduce-scatters them once and
// gathers the updated weights, ZeRO-2 reduce-scatters every micro-batch's and gathers the weights
// once, ZeRO-3 reduce-scatters every micro-batch's and gathers the weights for each micro-batch's
// forward and backward), exposed whole in a pipeline, on a shared host and in loom's device runs
// (precision device: no overlap yet), otherwise hidden behind the backward (ZeRO-3's gathers the
// forward and backward) they accompany except what it cannot cover, the updated weights' gather
// never; offloaded, the gradients' way to the
// host and the updated weights' way back over the host link and the host's update at its share
// of the host's memory bandwidth instead of the device's optimizer pass; a pipeline's tied embedding, whose
// gradient its first and last stages exchange and add after the flush (f32; under ZeRO 2/3 what
// the other shards own of it gathered over data parallelism first); and the optimizer's pass over
// its state at memory bandwidth.
//
// The calibrated cpu cluster (f32) costs loom's own kernels as `loom calibrate` timed them: a
// layer's linears at the rate its grid gives for the layer's tokens and per-device width, and
// LayerNorm, GELU, the residual adds, attention, the fused cross-entropy and AdamW at their
// measured cost per call and per unit; and it scales that sum, for a layer's forward and backward
// and the head's, by what loom's own blocks took against the same sum when `loom calibrate` ran
// them (Device::blocks: a two-layer GPT at the layout's tokens and per-device width, as many ranks
// at once as the layout computes with, interpolated between the calibrated points), so what the
// kernels cost one after another over a step's buffers and beside other ranks counts too (with
// more ranks than cores: the blocks of as many ranks as cores). The pipeline's stages are cut as
// the executor cuts them (balance_chain over the blocks' declared costs), each rank's chunks with
// their own durations.
// Its ranks share the host: up to `cores` ranks compute at once, each with its share; a pipeline's
// schedule runs as an event simulation in which each rank runs on one of the cores as the OS
// runs threads (pipeline::simulate: wake-ups, a shared core, the load balancing, as `loom
// calibrate` measured them), and with more ranks than cores every synchronisation on the busiest
// rank's path costs the wait `loom calibrate` measured for ranks beyond the cores
// (Cluster::crowded_sync; in a pipeline a stage's per-micro-batch waits count for 1 / pp, the
// other stages computing on the cores it leaves). The collectives' sums and copies are work on the
// same cores: with more ranks than cores, the data-parallel reduction and the optimizer's passes
// take ranks / cores times a rank's time, the tied embedding's exchange (2 x dp x tp x cp ranks
// at once) its share of that.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "model/recompute.h"
#include "parallel/pipeline/checker.h"
#include "parallel/pipeline/schedule.h"
#include "plan/cluster.h"
#include "plan/model.h"

namespace loom::plan {

// mixed: as ZeRO and Megatron-LM account 16-bit training (the published tables); f32: loom's CPU
// runs, as its pools hold them; device: loom's device runs (train.device cuda or emu, bf16), as
// their pools hold them: f32 master weights, gradients and moments, a bf16 compute copy of the
// weights, bf16 activations with f32 row statistics.
enum class Precision : uint8_t { mixed, f32, device };
std::string_view precision_name(Precision p);
// "mixed", "f32" or "device"; throws naming `where` otherwise.
Precision parse_precision(const std::string& s, const std::string& where);

struct Layout {
  int dp = 1, tp = 1, pp = 1, v = 1, cp = 1;
  bool sp = false;
  int64_t mbs = 1;  // micro-batch size (sequences)
  parallel::pipeline::Kind schedule = parallel::pipeline::Kind::one_f_one_b;
  model::Recompute recompute = model::Recompute::none;  // none, selective or full
  int zero = 0;
  // The optimizer's state and update in host memory (ZeRO-Offload; loom's parallel.offload): the
  // device keeps its weights, compute copies and gradients; the host the optimizer state, an f32
  // master copy (loom's pools; mixed's optimizer state holds its masters) and an f32 gradient
  // staging copy of what the rank updates.
  bool offload = false;
  int64_t devices() const { return int64_t(dp) * tp * pp * cp; }
  // "dp=8,tp=8,pp=4,v=2,cp=1,sp=1,mbs=1,schedule=interleaved,recompute=selective,zero=1,offload=1"
  // (offload only when set)
  std::string str() const;
};
// Parses Layout::str()'s form (any subset of the keys; the rest default). Errors name `where`
// and the key.
Layout parse_layout(const std::string& s, const std::string& where = "--layout");

struct Job {
  ModelSpec model;
  Cluster cluster;
  int devices = 1;
  int64_t global_batch = 1;  // sequences per step
  Precision precision = Precision::mixed;
  // Fused (flash) attention: the attention scores are neither stored nor passed through memory
  // (false: as Megatron-LM in 2021, softmax, mask and dropout over a s^2 scores per sequence).
  bool flash_attention = true;
};

struct Estimate {
  Layout layout;
  int64_t micro_batches = 1;              // per pipeline and step
  std::map<std::string, double> memory;   // bytes per device by tag: params, grads, optimizer, activations
  double memory_total = 0;
  std::map<std::string, double> host_memory;  // offload: host bytes per device by tag (optimizer, params, grads)
  double host_memory_total = 0;
  bool host_fits = true;  // the host memory within the device's share of the node's (where known)
  bool fits = false;
  bool valid = true;  // false: the layout cannot run the model at all (why_not says why); nothing estimated
  std::string why_not;                    // "" when it fits (or the layout is valid)
  double step_s = 0;
  double compute_s = 0, recompute_s = 0;  // the busiest stage's compute over the step
  double tp_comm_s = 0, pp_comm_s = 0;    // inside the pipeline's makespan
  double bubble_s = 0;                    // makespan - the busiest stage's busy time
  double dp_exposed_s = 0, dp_comm_s = 0, optimizer_s = 0;
  double sync_s = 0;  // on a shared host with more ranks than cores: the waits for unscheduled peers
  double tied_s = 0;  // a pipeline's tied embedding: its first and last stages' gradient exchange
  double tokens_per_s = 0;
  double model_tflops = 0;     // model FLOPs per device per second (3 forwards' worth), TFLOP/s
  double hardware_tflops = 0;  // with what recomputation runs again (Megatron-LM's figure)
  double mfu = 0;              // model FLOPs over the device's peak
  double peak_in_flight = 0;   // micro-batch chunks the busiest stage keeps
  // What the simulation runs the schedule's lists with (loom simulate draws it): the costs the
  // schedule is generated for (one chunk of the busiest rank, free transfers), and each rank's
  // chunks' seconds of one micro-batch's forward and backward (and zero bubble's halves), the
  // transfer between stages and, on a shared host, how many ranks compute at once at full speed.
  parallel::pipeline::OpCosts order_costs;
  parallel::pipeline::RankCosts rank_costs;
};

// Model-state bytes per device of `params` parameters under ZeRO stage `zero` over `shards`
// data-parallel ranks, by tag, on the device (with `offload`, the optimizer's are still counted
// here, as the bytes the host then holds; a device computing in a 16-bit dtype keeps only its
// compute copy of the weights).
struct ModelState {
  double params = 0, grads = 0, optimizer = 0;
  double total() const { return params + grads + optimizer; }
};
ModelState model_state(double params, Precision precision, int zero, int shards, bool offload = false);

// The estimate of one layout (invalid ones come back with fits = false and why_not). With
// `simulate`, the pipeline's makespan and in-flight count come from the schedule's instruction
// lists; without, from the closed forms (for searching).
Estimate estimate(const Job& job, const Layout& layout, bool simulate = true);

struct SearchOptions {
  int top = 5;
  // Fix an axis (0: search it).
  int tp = 0, pp = 0, cp = 0;
  int64_t mbs = 0;
  int zero = -1;
  int sp = -1;  // -1: both, 0: off, 1: on (where tp > 1)
  // Schedules, recompute policies and ZeRO stages the search tries.
  std::vector<parallel::pipeline::Kind> schedules{parallel::pipeline::Kind::one_f_one_b,
                                                  parallel::pipeline::Kind::interleaved,
                                                  parallel::pipeline::Kind::zb_h1};
  std::vector<model::Recompute> recomputes{model::Recompute::none, model::Recompute::selective,
                                           model::Recompute::full};
  std::vector<int> zeros{0, 1, 2, 3};
  // Also try each layout that does not fit with its optimizer offloaded to host memory (never on a
  // shared host, whose host memory is the devices').
  bool offload = true;
};

// A layout fits a device when its predicted memory is at most this share of the device's memory
// (the rest is the margin for what the model does not count: allocator slack, libraries).
constexpr double kUsableMemory = 0.9;

struct SearchResult {
  std::vector<Estimate> best;  // fastest first, each simulated
  int64_t considered = 0, fitting = 0;
  // Of the valid layouts, fitting or not, the one needing least memory per device (closed form):
  // what a limit must allow (kUsableMemory of it) for anything to fit. Empty when none is valid.
  std::optional<Estimate> least;
  double seconds = 0;
};

SearchResult search(const Job& job, const SearchOptions& opt = {});

// Why the first estimate beats each of the others, in words.
std::string explain(const std::vector<Estimate>& ranked);
// A table of estimates (one per line).
std::string format_table(const Job& job, const std::vector<Estimate>& e);
// {"step_time_s", "tokens_per_s", "tflops_per_gpu", "hardware_tflops_per_gpu", "mfu",
//  "memory_bytes_per_gpu": {tag: bytes}, "fits", ...} of one estimate.
std::string to_json(const Estimate& e);

}  // namespace loom::plan

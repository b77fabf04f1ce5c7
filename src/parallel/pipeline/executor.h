// Runs pipeline schedules (schedule.h) on the GPT chain cut into stages: rank r of the pipeline
// communicator owns virtual stages r, r + p, ... (contiguous ranges of chain elements: 0 =
// embedding, 1..n_layer = transformer blocks, n_layer + 1 = head), splits its data-parallel
// replica's batch into m micro-batches, scales each micro-batch loss by 1 / m so gradients
// accumulate to the gradient of the mean, and sends activations and gradients point-to-point
// (one tag on the pipeline communicator, any Comm backend). Sends are non-blocking (Comm::isend):
// a rank posts its activation or gradient and goes on computing, and waits for its sends before
// their buffers go and before the optimizer step; receives block. The schedule is generated for
// the model's op costs (op_costs) and this way of sending. Each micro-batch in flight
// keeps its own saved activations (chain blocks that share the stage's parameters), released
// when its backward ends, so the activation pool peaks at the checker's in-flight bound; the
// attention kernel's scratch is one buffer per rank, shared by every chunk and micro-batch (one
// computes at a time), taken at the first step for its largest call. ZB-H1's
// backward is split: backward_input runs the blocks' input-gradient part (what the previous stage
// waits for) and keeps the linear layers' output gradients (workspace tag); backward_weight runs
// the deferred weight GEMMs in micro-batch order, so gradients equal 1F1B's bit for bit.
//
// Tied embeddings across stages: the last stage keeps its own copy of wte for lm_head (same
// initialisation); after the backward the first and last stages add their wte gradients
// (Megatron's embedding group), so both copies take the same update.
//
// Composition: data parallelism through a dp communicator (gradients averaged after the
// pipeline flush). Tensor, sequence and context parallelism through tp / cp groups: the chunks'
// blocks then hold this rank's parts of their parameters (model/parallel.h), and the tensors
// passed between stages are this rank's rows of the residual stream (B T / cp, or its sp share),
// sent to the same (tp, cp) coordinate of the next stage: the pipeline communicator joins
// exactly those ranks.
//
// Data parallelism is parallel::DataParallel over each stage's blocks (every chunk's, in chain
// order; a last stage's wte copy belongs to its head) and the stage's dp x cp group (groups.dp_cp,
// needed when both are > 1: the cp ranks hold partial sums of the gradients, the dp replicas
// average because each micro-batch's loss is scaled by 1 / (m dp)), with every ZeRO stage and
// offload: the executor runs its hooks around each block's forward and backward, so under ZeRO-3
// a block's parameters are gathered just before it runs (every micro-batch, and again for its
// backward) and under ZeRO 2/3 its gradient bucket is reduce-scattered after every micro-batch's
// backward of the chunk (under zero bubble after its weight pass; the norms' gradients its input
// pass writes stay whole for the step and are reduced at its end); stages 0/1 reduce after the
// last micro-batch's. After the flush the
// first and last stages add their reduced wte gradients (DataParallel::add_peer_gradient: piece by
// piece, each gathered over the group under ZeRO 2/3, where the two stages' shards cover
// different parts of wte), the sp-partial gradients are summed over tp on each rank's optimizer
// range, and the norm is summed over dp x cp, tp and pp.
//
// Driving it from a trainer: one PipelineExecutor per rank, built from the pp (and dp)
// sub-communicators of the mesh; each step call takes the replica's batch and returns the mean
// loss on every rank; parameters() are this rank's (for checkpoints), trace() the timeline of
// the last step.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "model/config.h"
#include "model/param.h"
#include "model/parallel.h"
#include "model/recompute.h"
#include "optim/adamw.h"
#include "parallel/data/data_parallel.h"
#include "parallel/pipeline/checker.h"
#include "parallel/pipeline/draw.h"
#include "parallel/pipeline/schedule.h"

namespace loom::parallel::pipeline {

// Declared relative cost of each chain element at sequence length T (forward FLOPs per token):
// [n_layer + 2] for embedding, blocks, head.
std::vector<double> chain_costs(const model::GPTConfig& cfg, int64_t T);
// Relative cost of a transformer block's forward, backward and zb's two backward halves at
// sequence length T, from their FLOPs per token (forward = 1): the forward is 24 C^2 of matmuls
// plus 4 T C of attention; the input-gradient half repeats the matmuls and does the attention
// backward (8 T C); the weight half is the matmuls' weight gradients (24 C^2). The executor
// generates its schedule for these costs.
OpCosts op_costs(const model::GPTConfig& cfg, int64_t T);
// Contiguous cut of n elements with `costs` into `parts` non-empty ranges minimising the
// largest range cost: parts + 1 boundaries, 0 first and n last.
std::vector<int64_t> balance_chain(const std::vector<double>& costs, int parts);
// Checks user boundaries (field names the config entry in errors).
void validate_cuts(const std::vector<int64_t>& cuts, int64_t n_elements, int parts, const std::string& field);

struct ExecutorOptions {
  ScheduleSpec schedule;            // p must equal the pipeline communicator's size
  std::vector<int64_t> cuts;        // p * v + 1 chain boundaries; empty: balanced by chain_costs
  optim::AdamWConfig adamw;
  uint64_t seed = 1337;             // initialisation, as the single-device model's
  int tp = 1, cp = 1;               // tensor and context parallel sizes composed with pp
  bool sp = false;                  // sequence parallelism within tp
  // Data parallelism over the dp (x cp) group of each stage (parallel::DataParallel): ZeRO stage
  // 0-3, optimizer offload to the host pool, gradient bucket size and ZeRO-3's prefetch.
  int zero_stage = 0;
  bool offload = false;
  int64_t bucket_bytes = 25 << 20;
  bool prefetch = true;
  int64_t seq_len = 0;              // the run's sequence length, for the schedule's op costs and the
                                    // balanced cuts (0: the model's block_size)
  // Activation recomputation of each chunk's transformer blocks (model/recompute.h: none, full,
  // every_k with recompute_every, sqrt, selective, optimal). optimal plans each chunk for
  // activation_budget (saved-activation bytes per rank) at micro-batches of micro_batch sequences
  // of seq_len, counting the micro-batches the schedule keeps in flight on the rank (with several
  // chunks a rank, jointly: the least recompute over the chunks' plans whose walk along the rank's
  // list of instructions fits); a budget no plan fits is refused naming memory.activation_budget.
  model::Recompute recompute = model::Recompute::none;
  int64_t recompute_every = 2;
  int64_t activation_budget = 0;
  int64_t micro_batch = 0;
  DType matmul = DType::f32;  // the CPU backend's matmul inputs (BackendOptions::matmul)
  // The rank's device backend (not owned; it must outlive the executor), whose memory and compute
  // dtype the stage then uses, its transfers over a device communicator split from the pipeline's
  // (always staged through host memory: the sends are posted without waiting), the groups' tp a
  // device communicator with tp_host its host one; null: a CPU backend over the pool.
  Backend* backend = nullptr;
  // Refuses unsupported combinations with an error naming the field.
  void validate() const;
};

struct StepResult {
  float loss = 0;          // mean over the global batch (every rank)
  double grad_norm = 0;    // global, before clipping
  bool skipped = false;    // not finite: no update (every rank)
};

// One compute of the last step on this rank, in seconds since the step began; cpu: the CPU time
// of the rank's own thread over it (all of the compute's work when the rank runs one thread).
struct TraceEvent {
  Op op;
  int mb, chunk;
  double start, end;
  double cpu = 0;
};

class PipelineExecutor {
 public:
  // pp: this rank's pipeline communicator (rank = stage); dp: data-parallel communicator or
  // nullptr. Both must outlive the executor. Parameters come from `pool` (tags params, grads).
  // groups: the tensor and context parallel groups of this rank (their sizes must equal opt.tp
  // and opt.cp).
  // host_pool: where offloaded optimizer state lives (required with opt.offload).
  PipelineExecutor(const model::GPTConfig& cfg, const ExecutorOptions& opt, comm::Comm& pp, comm::Comm* dp,
                   MemoryPool& pool, model::ParallelGroups groups = {}, MemoryPool* host_pool = nullptr);
  ~PipelineExecutor();
  PipelineExecutor(const PipelineExecutor&) = delete;
  PipelineExecutor& operator=(const PipelineExecutor&) = delete;

  // tokens, targets: i32 [B, T] of this replica (same on every pipeline rank), B divisible by m.
  // Runs this rank's instruction list and the optimizer step with learning rate lr (< 0: the
  // configured one).
  StepResult step(const Tensor& tokens, const Tensor& targets, double lr = -1.0);

  // Validation: the loss of each of the m micro-batches of (tokens, targets) (as in step), without
  // a backward or an update: the schedule's forwards, sends and receives only, each micro-batch's
  // activations released where its backward would run. Averaged over the dp replicas; every rank
  // gets all m.
  std::vector<double> evaluate(const Tensor& tokens, const Tensor& targets);

  // Sampling: the logits of `position` of `context` (i32 [1, T], the same on every rank of the
  // pipeline; under cp, T divisible by 2 cp), run forward through the stages as one micro-batch;
  // every rank gets the whole padded row (from the cp rank holding the position, the head's
  // vocabulary columns gathered over tp).
  std::vector<float> last_logits(const Tensor& context, int64_t position);
  // This rank's stage's parallel layout (tp, cp, sp groups).
  const model::ChainParallel& parallel() const;

  const Schedule& schedule() const { return sch_; }
  const CheckResult& checked() const { return checked_; }
  const std::vector<int64_t>& cuts() const { return cuts_; }
  // This rank's parameters (a last-stage copy of a tied wte included, flagged by is_copy), each
  // with where it lies in its full tensor (Parameter::shard).
  std::vector<model::Parameter*> parameters() const;
  bool is_copy(const model::Parameter* p) const;
  // The stage's data parallelism (its flat layout, shards and optimizer state: checkpoints read
  // and write through it), over parameters() in the same order.
  parallel::DataParallel& data_parallel() const;
  const std::vector<TraceEvent>& trace() const { return trace_; }
  // Most micro-batch chunks whose activations were held at once during the last step.
  int peak_in_flight() const { return peak_slots_; }
  // Under the optimal recompute policy: this rank's transformer blocks, how many of them are
  // recomputed, and the saved-activation peak the plan allows for (0 under other policies).
  int64_t recomputed_blocks() const { return recomputed_; }
  int64_t planned_blocks() const { return blocks_; }
  double planned_activation_peak() const { return planned_peak_; }
  // Saved-activation bytes of one micro-batch on chunk c between its forward and backward
  // (declared by the blocks, plus the received input; a recomputed segment keeps only its last
  // output).
  int64_t activation_bytes_per_micro_batch(int chunk, int64_t b, int64_t T) const;

 private:
  // Checks the batch and sizes the workspaces for its micro-batch shape (shape: for micro-batches
  // of b sequences of T tokens).
  void prepare(const Tensor& tokens, const Tensor& targets);
  void shape(int64_t b, int64_t T);

  struct Impl;
  std::unique_ptr<Impl> impl_;
  Schedule sch_;
  CheckResult checked_;
  std::vector<int64_t> cuts_;
  std::vector<TraceEvent> trace_;
  int peak_slots_ = 0;
  int64_t recomputed_ = 0, blocks_ = 0;
  double planned_peak_ = 0;
};

// Chrome trace (chrome://tracing, Perfetto) of per-rank timelines: one process, one thread per
// rank, a complete event per compute (its args: micro-batch, chunk and cpu_ms, the rank thread's
// CPU time in it: below the event's duration where the OS ran another thread on its core). Throws
// naming the path when it cannot be written.
void write_chrome_trace(const std::string& path, const std::vector<std::vector<TraceEvent>>& ranks);
// Measured timeline for draw_png.
Timeline trace_timeline(const std::string& title, const std::vector<std::vector<TraceEvent>>& ranks);
// Idle fraction of each rank over the span of all ranks' events: 1 - busy / span.
std::vector<double> idle_fractions(const std::vector<std::vector<TraceEvent>>& ranks);
// The CPU time of the calling thread, in seconds: the clock of TraceEvent::cpu. It does not
// advance while the thread sleeps or waits for a core.
double thread_cpu_seconds();
// Each rank's compute durations in list order, as replay (checker.h) takes them: the events' CPU
// time.
std::vector<std::vector<double>> compute_seconds(const std::vector<std::vector<TraceEvent>>& ranks);

}  // namespace loom::parallel::pipeline

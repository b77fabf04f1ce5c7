// Data parallelism over a `dp` communicator, with gradient buckets reduced while backward runs
// and ZeRO stages 0-3 plus optimizer offload.
//
// Flat layout (flat_layout.h). The chain's parameters, in chain order (GPT::parameters() order for a model),
// are laid end to end in one f32 flat buffer, each at its padded allocation size (alloc_numel,
// vocabulary padding rows included) rounded up to 16 elements; the flat length N_pad is then
// rounded up to a multiple of 16 * dp. Rank r owns the shard [r S, (r + 1) S), S = N_pad / dp.
//
// Buckets are runs of whole chain blocks taken in backward order (head, h.L-1, ..., h.0,
// embedding), closed once they reach `bucket_bytes`: each is a contiguous flat range. A bucket's
// reduction is handed to this rank's communication thread (its own communicator, split from the
// dp one) as soon as the last block writing into it has finished its backward, so it overlaps
// the backward of the earlier blocks. Stage 0 all-reduces a bucket; stages 1-3 reduce-scatter it
// (a rank reads the reduced gradients of its own shard only: at stage 1 in place in its whole
// gradient buffer, whose other elements keep its local sums, at stages 2/3 into its shard).
//
// Per rank, with P_N = 4 N_pad bytes, P_S = 4 S bytes (f32 everywhere; loom keeps no low-precision
// copies), peak bytes by pool tag during training steps (the tests check these exactly):
//   stage 0: params P_N,            grads P_N,                 optimizer 2 P_N
//   stage 1: params P_N,            grads P_N,                 optimizer 2 P_S
//   stage 2: params P_N,            grads P_S + 4 G (+ 4 I),   optimizer 2 P_S
//   stage 3: params P_S + 8 U,      grads P_S + 4 G (+ 4 I),   optimizer 2 P_S
//            (P_S + 4 U without prefetch: DataParallelOptions::prefetch = false)
// where G = bucket_peak_elements() (the arena the buckets live in, see below), I =
// input_pass_elements() (under a split backward only: DataChain::input_pass) and
// U = max over chain blocks of the flat elements the block gathers (its own parameters, plus wte
// for a tied head, each with its alignment to 16 elements): one all-gather per contiguous range,
// into one of two buffers of U elements: while a block computes from one, the next block's
// gather (the next in forward order during forward, the previous during backward) runs on the
// communication thread into the other (FSDP's forward and backward prefetch). A block whose
// gathered weights are still in a buffer from the same step (the head, from forward to backward)
// is not gathered again; a block asked for out of that order (recomputation, evaluation) is
// gathered there and then. Stage 2/3 bucket buffers are allocated when the first block writing
// into the bucket starts its backward and freed when a later bucket is allocated once its
// reduction has finished, keeping at most the newest launched bucket alive; a backward's last
// reductions are waited for only where a later backward needs their place in the arena (or at
// the step), so a pipeline stage passes its gradient on without waiting for its replicas. A tied
// head's part of wte's gradient has a bucket of its own (stages 2/3; reduce-scattered after the head, and the
// embedding's part after the embedding, both adding into the shard), so the embedding's bucket is
// not held through the whole backward. Each bucket has a fixed place in one arena of G elements:
// the policy is replayed over one backward for each bucket's lifetime, and the buckets are placed
// largest first at the lowest offset no bucket alive with them uses, so G is a function of the
// bucket layout only, never of timing (for GPT-2 it is the two largest blocks' buckets); the
// arena is allocated at the first backward and reused by every one after.
// Under GaLore (AdamWConfig::galore_rank > 0, optim/galore.h; stage 0 only) the optimizer tag
// holds, instead of 2 P_N: 8 numel bytes per parameter it keeps in plain AdamW (no padding) and
// 4 r (2 max(m, n) + min(m, n)) bytes per projected block matrix [m, n].
// With offload the optimizer moments (2 P_opt), an f32 master copy of the updated parameters
// (P_opt) and a gradient staging copy (P_opt) live in the host pool instead (tags optimizer,
// params, grads), P_opt = P_N for stage 0 and P_S otherwise; the update runs there and the
// updated shard is copied back. On the CPU the "device" and host pools are both host memory, but
// accounted apart as on a GPU.
//
// Equality with one device: every rank computes the mean loss over its own samples with
// dloss_scale / dp, so the sum over ranks of the gradients is the gradient of the global-batch
// mean when every rank holds the same number of samples (the trainer requires batch_size
// divisible by dp * grad_accum). Gradient clipping uses the norm over all shards (sums of squares
// in double, added in rank order). Reductions follow the comm contract, so threads and mpi give
// bit-identical results.
//
// The chain it works on (DataChain): a whole model::GPT's (embedding, blocks, head), or a pipeline
// stage's chunks of it (parallel/pipeline/executor.h), whose caller runs the hooks around each
// block. A backward runs over one contiguous range of the chain's blocks at a time, from its last
// block to its first: the whole chain for a model, a chunk for a pipeline stage, whose micro-
// batches' backwards interleave with other work. Buckets never cross such a range; under ZeRO 2/3 a
// range's reductions may still run after its backward ends: the next backward that needs a bucket's
// place in the arena waits for it there (acquire_bucket), the step for all. A pipeline's last stage
// holds a copy of a tied wte as a parameter of its head (DataChain::owned); the two stages' reduced
// gradients of it are added by add_peer_gradient.
//
// On a device (the chain's backend a GPU's): the same buffers in its memory, moved and summed by
// its ops, the collectives over device communicators (Backend::buffer_comm) run on the compute
// thread in the model's stream order (no overlap with backward there yet), the norm's sums of
// squares by Backend::sum_squares, AdamW by Backend::plan_adamw, and the compute copies the ops
// read refreshed after every update (declared parameters get theirs here; under ZeRO-3 a
// gathered block's are converted into two more buffers of U elements in the compute dtype, so no
// compute copy is kept whole: in a 16-bit compute dtype the params tag holds 2 N_pad bytes more
// than the formulas above for stages 0-2 and 4 U more for stage 3, the tests check these too).
// Offloaded in a 16-bit compute dtype, the host's f32 master copy is the only one (ZeRO-Offload's
// split): the device's flat buffer is in the compute dtype and is the compute copies themselves,
// the update's result is rounded on the host and uploaded into it, stages 1-2 gather it in that
// dtype, and ZeRO-3 gathers the compute-dtype shards straight into the two compute buffers; the
// params tag then holds 2 N_pad bytes (stages 0-2) or 2 S + 4 U (stage 3), and whatever
// reads the weights (checkpoints, download_params, gather_full_state, first_nonfinite) reads the
// host's masters. Under ZeRO 2/3 the reduced gradients' shard is the host's too: each bucket's
// reduced part is added into the host's gradient copy (through a staging buffer of at most 2^22
// elements, tag workspace) as it is reduced, so the grads tag of the device holds the arena alone
// (4 G (+ 4 I)), and the step's partial sums over tp, norm and update run on the host.
// GaLore runs on the CPU backend only (refused by name). add_peer_gradient's link must then take the device's
// memory too (a device communicator).
//
// Composed with tensor / sequence / context parallelism (a model::GPT over tp and cp groups): the
// communicator is then the dp x cp group of one tp rank (the cp ranks hold partial sums of the
// gradients of the same replica, which the reduction adds; the model is this tp rank's part, laid
// out and sharded like a whole one), norm_group the tp group (the norm adds every tp rank's sum of
// squares; a parameter whole on every tp rank counts on tp rank 0 only, in_norm), and the
// gradients that sequence parallelism leaves as partial sums over tp (Parameter::shard.sp_partial)
// are summed over norm_group after the data-parallel reduction, on each rank's optimizer range.
// Every tp rank has the same layout, so those ranges line up.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/backend.h"
#include "core/memory.h"
#include "core/tensor.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "optim/galore.h"
#include "optim/sharded_adamw.h"
#include "parallel/data/flat_layout.h"
#include "parallel/data/trace.h"

namespace loom::parallel {

// The blocks data parallelism takes over, in chain order, with the parameters each owns (placed in
// the flat layout in this order: every parameter belongs to exactly one block).
struct DataChain {
  std::vector<model::ChainBlock*> blocks;
  std::vector<std::vector<model::Parameter*>> owned;  // per block
  // The first block of each range a backward runs over (ascending; {0} for a whole model).
  std::vector<int> range_starts = {0};
  // wte, owned by block 0 and also read (and its gradient written) by the last block, a tied head
  // (null: none).
  model::Parameter* tied = nullptr;
  // Under a split backward (zero bubble): the parameters whose gradients a block's input pass
  // writes (ChainBlock::input_pass_parameters), apart in time from its weight pass. Under ZeRO 2/3
  // they keep a whole gradient of their own for the step (a few norms' worth), reduced at its end,
  // instead of a bucket held from one pass to the other.
  std::vector<model::Parameter*> input_pass;
  // The backend the chain computes on: the flat buffers, buckets and optimizer state are in its
  // memory and its ops move and update them (under offload the optimizer is on a CPU backend over
  // the host pool).
  Backend* backend = nullptr;
  uint64_t seed = 0;  // deferred parameters are drawn from it (Parameter::initialise_part)
  static DataChain of(model::GPT& gpt);
};

struct DataParallelOptions {
  int zero = 0;                       // ZeRO stage 0-3
  bool offload = false;               // optimizer state and update in host_pool
  MemoryPool* host_pool = nullptr;    // required with offload
  int64_t bucket_bytes = 25 << 20;    // gradient bucket size (at least one chain block each)
  bool overlap = true;                // reductions on the communication thread during backward
  bool prefetch = true;               // stage 3: the next block's gather during the current one
  Trace* trace = nullptr;             // events of this rank (nullptr: none)
  // Model parallelism (see above): the tp group of this rank (null: none), and per parameter in
  // the chain's order (GPT::parameters() for a model) whether it counts in the norm here (empty: all).
  comm::Comm* norm_group = nullptr;
  // On a device: a communicator over norm_group's ranks that takes its memory (the model's own tp
  // group, model::ParallelGroups::tp), for the gradients' partial sums; null: one split from
  // norm_group here.
  comm::Comm* norm_buffers = nullptr;
  std::vector<bool> in_norm;
  // The pipeline's communicator (null: none): the norm's sums of squares and the decision to skip
  // a step are also over it (after norm_group).
  comm::Comm* stage_group = nullptr;
};

struct GradBucket {
  int64_t begin = 0, end = 0;      // flat range
  std::vector<int> blocks;         // owning chain blocks, in backward order
  int last_writer = 0;             // chain block whose backward completes the bucket
};

// Timings of communication, in seconds, accumulated since the last reset_comm_stats().
struct CommStats {
  double reduce_busy_s = 0;   // the communication thread inside gradient reductions
  double reduce_wait_s = 0;   // compute thread blocked on reductions (the exposed part)
  double gather_s = 0;        // ZeRO-3 parameter gathers and post-step all-gathers (not overlapped)
  int64_t reductions = 0;
  double hidden_s() const { return reduce_busy_s > reduce_wait_s ? reduce_busy_s - reduce_wait_s : 0.0; }
};

class DataParallel final : public model::ChainHooks {
 public:
  // Takes over the model's parameters and gradients (their tensors become views of the flat
  // buffers, or are detached where sharded); the model's current values are the starting point
  // (identical on every rank), or, for a model with deferred parameters
  // (ModelLayout::defer_parameters), the values drawn from its seed for just what this rank keeps. Collective over `dp` (the communication thread's communicator is
  // split from it). `gpt` and `dp` must outlive this object.
  DataParallel(model::GPT& gpt, comm::Comm& dp, const optim::AdamWConfig& adam, const DataParallelOptions& opt);
  // Over any chain (a pipeline stage's): the caller runs the ChainHooks around each block's
  // forward and backward, with the block's index in chain.blocks.
  DataParallel(DataChain chain, comm::Comm& dp, const optim::AdamWConfig& adam, const DataParallelOptions& opt);
  ~DataParallel() override;
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  // Before the first micro-batch of a step.
  void zero_grad();
  // Whether the next backward is the last micro-batch of the step: stages 0/1 reduce only then
  // (earlier micro-batches accumulate locally); stages 2/3 reduce every micro-batch into the
  // gradient shard.
  void set_last_micro(bool last) { last_micro_ = last; }
  // Waits for the reductions, clips by the global norm and updates; the parameters are then
  // identical on every rank (stages 0-2) or in every shard (stage 3). With `skip` (every rank
  // passes the same), or when the gradient norm is not finite on any rank of the group or of
  // norm_group, nothing is updated on any of them (StepStats::skipped).
  optim::StepStats step(double lr, bool skip = false);
  // The first non-finite element, in flat order, of this rank's parameters (what it holds: all of
  // them, or its shard under ZeRO-3; with the masters on the host, the masters of its optimizer
  // range, so the first over the group's ranks is the first of all) or of its reduced gradients (its optimizer range) after a
  // step: the parameter's index in the chain's order (layout()), -1 when every element is finite.
  int first_nonfinite(bool gradients) const;
  // Testing aid: the next step's reduced gradient gets a NaN on this rank (its first element);
  // this rank's first parameter element becomes NaN now.
  void poison_gradients() { poison_ = true; }
  void poison_parameters();

  // Waits for the step's gradient reductions (step() does it too): this rank's reduced gradients
  // are then final.
  void finish_reductions();
  // Collective with `peer` over `link` (the other end holds a DataParallel over a group of the
  // same size with a parameter of the same tensor as `param` here, in its own layout):
  // after finish_reductions, adds the peer's reduced gradient of it into this rank's, so both get
  // the same bits (a + b == b + a). A pipeline's tied wte: its first and last stages. Under ZeRO
  // 1-3 each side holds only its shard's reduced gradients, laid out differently on the two sides: the tensor goes
  // over in pieces of at most bucket_bytes, each gathered over the group first.
  void add_peer_gradient(const model::Parameter* param, comm::Comm& link, int peer);
  // Sum of x over the ranks, in double, added in rank order (bit-identical on every rank).
  double sum_over_ranks(double x);

  // The replica's whole flat state on every rank, collective, to inspect (the tests compare it
  // with one device; checkpoints use local_state and never gather): flat f32 [N_pad] copies of
  // the parameters and of both moments (tag workspace, from the model's pool; the moments from
  // the host pool under offload, and so are the parameters with the masters there); at stage 0 the
  // live buffers themselves (read them before the next step). Under GaLore (stage 0 only) the
  // moments are undefined: they are galore()'s.
  struct FullState {
    Tensor params, exp_avg, exp_avg_sq;
  };
  FullState gather_full_state();
  // The replica's parameters, flat f32 [N_pad], into host memory at `host` (collective over the
  // group under ZeRO-3: gathered in pieces of the larger of bucket_bytes and 64 KiB through one buffer of the
  // backend's memory, so a device holds no whole copy; otherwise this rank's own, no collective;
  // with the masters on the host, from them: collective over the group at stages 1-3).
  void download_params(float* host);
  // What this rank holds, as flat ranges of the layout (for checkpoints, which each rank writes
  // and reads in place): the parameters [params_begin, params_end) at `params` (all of them, or
  // the shard under ZeRO-3; with the masters on the host, those of its optimizer range) and both
  // moments [opt_begin, opt_end) (all, or the shard under ZeRO 1-3); [shard_begin, shard_end) is
  // this rank's shard, inside both, the part it writes.
  struct LocalState {
    int64_t params_begin = 0, params_end = 0, opt_begin = 0, opt_end = 0, shard_begin = 0, shard_end = 0;
    float* params = nullptr;
    float* exp_avg = nullptr;     // (null under GaLore: its state is galore()'s)
    float* exp_avg_sq = nullptr;
  };
  LocalState local_state();
  // local_state() in host memory: on the CPU the same; on a device host copies of the buffers
  // (kept here until the next call; the moments are host memory already under offload). After
  // writing into them (a checkpoint read), put_host_state() puts them back, before state_loaded.
  LocalState host_state();
  void put_host_state();
  // The optimizer: AdamW over this rank's optimizer range, or GaLore (AdamWConfig::galore_rank > 0,
  // stage 0; null otherwise) over the whole flat buffer, its state per parameter.
  optim::ShardedAdamW* adam() { return dynamic_cast<optim::ShardedAdamW*>(opt_.get()); }
  optim::GaLore* galore() { return dynamic_cast<optim::GaLore*>(opt_.get()); }
  int rank() const { return rank_; }
  int ranks() const { return world_; }
  // After a checkpoint was read into local_state()'s buffers: the optimizer's step count, and the
  // offloaded master copy refreshed from the parameters.
  void state_loaded(int64_t optimizer_steps);
  // The logical part of parameter i in a flat tensor: f32 with the parameter's spec shape.
  Tensor param_view(const Tensor& flat, size_t i) const;

  const std::vector<FlatParam>& layout() const { return lay_.params; }
  const std::vector<GradBucket>& buckets() const { return buckets_; }
  int64_t flat_elements() const { return n_pad_; }  // N_pad
  int64_t shard_elements() const { return shard_; } // S
  int64_t bucket_peak_elements() const { return bucket_peak_; }  // G (stages 2/3)
  int64_t max_block_use_elements() const { return max_use_; }    // U (stage 3)
  int64_t optimizer_steps() const { return opt_->steps_taken(); }
  const CommStats& comm_stats() const { return stats_; }
  void reset_comm_stats() { stats_ = {}; }
  int zero() const { return o_.zero; }
  // Whether the f32 master weights live in the host pool alone (offload on a device computing in
  // another dtype): the model's parameters then have compute copies and no values on the device.
  bool masters_on_host() const { return host_master_; }

  // Zero bubble's split backward, instead of before_backward: around a block's input-gradient pass
  // (ZeRO-3: its weights gathered, then released; it writes only DataChain::input_pass's
  // gradients), and before its weight pass (its buckets acquired; after_backward ends the pass).
  void before_input_backward(int64_t i);
  void after_input_backward(int64_t i);
  void before_weight_backward(int64_t i);
  // Elements of the input-pass gradients kept whole under ZeRO 2/3 (0 otherwise).
  int64_t input_pass_elements() const { return input_grads_.defined() ? input_grads_.numel() : 0; }

  // ChainHooks.
  void before_forward(int64_t i) override;
  void after_forward(int64_t i) override;
  void before_backward(int64_t i) override;
  void after_backward(int64_t i) override;

 private:
  class Worker;
  struct LiveBucket {
    Tensor buf;            // f32 [end - begin] (stages 2/3)
    bool acquired = false;
    bool launched = false;
    bool freed = true;
    int64_t ticket = -1;
  };
  void acquire_bucket(size_t b);
  void launch_bucket(size_t b);
  void free_bucket(size_t b);
  void gather_block(int64_t c, const char* phase, bool backward);
  void begin_weight_read(int64_t c, bool backward);
  void end_weight_read(int64_t c, const char* what);
  void release_block(int64_t c);
  void point_grads(size_t b);
  // The reduced gradients of this rank's optimizer range (into grads_, or host_grads_ with
  // host_grad_shard_) and its parameters' (into params_): storage this object owns.
  float* grad_shard() const;
  float* param_shard() const;
  std::vector<int64_t> shard_counts(int64_t begin, int64_t end) const;

  bool range_start(int64_t c) const;
  int64_t range_end(int64_t c) const;  // one past the last block of c's range

  model::GPT* gpt_ = nullptr;  // the model whose hooks this is (null: the caller runs them)
  DataChain chain_;
  comm::Comm& comm_;
  DataParallelOptions o_;
  int rank_ = 0, world_ = 1;
  FlatLayout lay_;
  std::vector<GradBucket> buckets_;
  std::vector<LiveBucket> live_;
  std::vector<std::vector<int>> uses_;     // chain block -> parameter indices it reads and writes
  std::vector<std::vector<int>> writes_;   // chain block -> bucket indices it writes
  std::vector<std::vector<std::pair<int64_t, int64_t>>> runs_;  // chain block -> flat ranges it reads
  std::vector<int> acquire_order_;         // bucket indices in the order acquired this backward
  int64_t n_pad_ = 0, shard_ = 0, bucket_peak_ = 0, max_use_ = 0;
  std::vector<int64_t> bucket_offset_;  // stage 2/3: each bucket's place in the arena
  Tensor bucket_arena_;                 // f32 [G], tag grads (stages 2/3)
  Tensor params_;       // f32 [N_pad] (stages 0-2) or [S] (stage 3), tag params (host_master_: compute dtype)
  Tensor grads_;        // f32 [N_pad] (stages 0/1) or [S] (stages 2/3), tag grads
  // Stage 3: two buffers of U elements (tag params); which block each holds (-1: none, or stale),
  // the one the running block uses, and the gather in flight into the other.
  Tensor block_buf_[2];   // (none with host_master_: the shards are gathered into the compute copies)
  Tensor block_cbuf_[2];  // their compute copies (a device computing in another dtype: 2 U of it)
  int64_t held_[2] = {-1, -1};
  int cur_buf_ = 0;
  int64_t prefetch_block_ = -1, prefetch_ticket_ = -1;
  int prefetch_buf_ = 0;
  void gather_into(int64_t c, int buf, comm::Comm& comm);
  Tensor host_params_, host_grads_;  // f32 [P_opt] in the host pool (offload)
  // Offload on a device computing in another dtype than f32: host_params_ are the only f32 master
  // weights, params_ holds their compute copies (the model's compute tensors point into it).
  bool host_master_ = false;
  // The updated master weights of this rank's optimizer range into params_ (from host_params_,
  // converted where params_ is in the compute dtype), and, at stages 1-2, every rank's updated
  // shard of params_ gathered over the group.
  void upload_masters();
  void gather_updated();
  // ... and under ZeRO 2/3 the reduced gradients of its shard too (host_grads_ accumulates them;
  // the device keeps no gradient shard, only the buckets' arena), their tp partial sums over host
  // groups (norm_group, and splits of it for replicated key/value heads, by size).
  bool host_grad_shard_ = false;
  std::map<int, std::unique_ptr<comm::Comm>> host_shared_;
  // The reduced gradients from element `at` of this rank's optimizer range (grad_shard()) += n
  // f32 of the backend's memory at src (into the host's copy with host_grad_shard_).
  void add_reduced(int64_t at, const float* src, int64_t n);
  std::vector<float> staged_params_, staged_m_, staged_v_;  // host_state()'s copies (a device's)
  Backend* be_ = nullptr;               // the chain's
  std::unique_ptr<Backend> host_be_;    // offload: a CPU backend over the host pool
  // The collectives on the backend's memory: comm_ and norm_group themselves on the CPU, device
  // communicators split from them on a GPU (Backend::buffer_comm); comm_ keeps the scalars.
  std::unique_ptr<comm::Comm> own_norm_buf_;
  comm::Comm* buf_ = nullptr;
  comm::Comm* norm_buf_ = nullptr;
  bool device_ = false;  // the chain's memory is a device's
  // a += b over n f32 in the backend's memory (a gradient sum).
  void add_into(float* a, const float* b, int64_t n);
  // An f32 copy within the backend's memory.
  void copy_f32(float* dst, const float* src, int64_t n);
  // The compute copies the ops read, from the master weights (nothing in f32).
  void refresh_compute();
  // ZeRO 2/3 under a split backward: the input-pass parameters' whole gradients (tag grads), at
  // their offsets in it, and whether they still need their reduction this step.
  Tensor input_grads_;
  std::vector<std::pair<const FlatParam*, int64_t>> input_slots_;
  std::vector<char> keep_whole_;  // per layout parameter: one of input_slots_ (empty: none)
  bool input_pending_ = false;
  void reduce_input_pass();
  std::unique_ptr<optim::FlatOptimizer> opt_;
  std::unique_ptr<Worker> worker_;
  bool last_micro_ = true;
  bool poison_ = false;
  CommStats stats_;
  Trace::Clock::time_point block_t0_;
};

}  // namespace loom::parallel

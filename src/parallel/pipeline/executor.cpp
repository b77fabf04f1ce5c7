#include "parallel/pipeline/executor.h"
#include "parallel/pipeline/joint_plan.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <fstream>
#include <limits>
#include <map>
#include <tuple>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/file.h"
#include "model/blocks.h"
#include "model/param_specs.h"
#include "model/parallel.h"
#include "parallel/data/flat_layout.h"
#include "parallel/data/data_parallel.h"

namespace loom::parallel::pipeline {

std::vector<double> chain_costs(const model::GPTConfig& cfg, int64_t T) {
  const double C = double(cfg.n_embd), V = double(cfg.padded_vocab()), t = double(T);
  // A block's matmuls per token: c_attn, attn.c_proj, c_fc and mlp.c_proj (24 C^2 for GPT-2).
  const double matmul = 2.0 * double(cfg.qkv_rows() * cfg.n_embd + cfg.n_embd * cfg.n_embd +
                                     cfg.fc_rows() * cfg.n_embd + cfg.n_embd * cfg.ffn());
  std::vector<double> c;
  c.push_back(C);                                    // embedding: a gather and an add
  for (int64_t l = 0; l < cfg.n_layer; ++l) c.push_back(matmul + 4.0 * t * C);  // matmuls + attention
  c.push_back(2.0 * C * V + 5.0 * V);                // lm_head and the softmax
  return c;
}

OpCosts op_costs(const model::GPTConfig& cfg, int64_t T) {
  const double C = double(cfg.n_embd), t = double(T);
  const double matmul = 2.0 * double(cfg.qkv_rows() * cfg.n_embd + cfg.n_embd * cfg.n_embd +
                                     cfg.fc_rows() * cfg.n_embd + cfg.n_embd * cfg.ffn()),
               forward = matmul + 4.0 * t * C;
  OpCosts c;
  c.forward = 1.0;
  c.backward_input = (matmul + 8.0 * t * C) / forward;
  c.backward_weight = matmul / forward;
  c.backward = c.backward_input + c.backward_weight;
  return c;
}

std::vector<int64_t> balance_chain(const std::vector<double>& costs, int parts) {
  const int64_t n = int64_t(costs.size());
  LOOM_CHECK(parts >= 1 && parts <= n, "pipeline: cannot cut a chain of {} elements into {} non-empty stages", n,
             parts);
  std::vector<double> pre(size_t(n + 1), 0.0);
  for (int64_t i = 0; i < n; ++i) pre[size_t(i + 1)] = pre[size_t(i)] + costs[size_t(i)];
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][i]: the smallest largest-part cost of the first i elements in k parts.
  std::vector<std::vector<double>> best(size_t(parts + 1), std::vector<double>(size_t(n + 1), inf));
  std::vector<std::vector<int64_t>> arg(size_t(parts + 1), std::vector<int64_t>(size_t(n + 1), 0));
  best[0][0] = 0;
  for (int k = 1; k <= parts; ++k)
    for (int64_t i = k; i <= n; ++i)
      for (int64_t j = k - 1; j < i; ++j) {
        const double c = std::max(best[size_t(k - 1)][size_t(j)], pre[size_t(i)] - pre[size_t(j)]);
        if (c < best[size_t(k)][size_t(i)]) {
          best[size_t(k)][size_t(i)] = c;
          arg[size_t(k)][size_t(i)] = j;
        }
      }
  std::vector<int64_t> cuts(size_t(parts + 1));
  cuts[size_t(parts)] = n;
  for (int k = parts; k >= 1; --k) cuts[size_t(k - 1)] = arg[size_t(k)][size_t(cuts[size_t(k)])];
  return cuts;
}

void validate_cuts(const std::vector<int64_t>& cuts, int64_t n, int parts, const std::string& field) {
  LOOM_CHECK(int64_t(cuts.size()) == parts + 1, "{}: expected {} chain boundaries (stages + 1), got {}", field,
             parts + 1, cuts.size());
  LOOM_CHECK(cuts.front() == 0 && cuts.back() == n, "{}: boundaries must start at 0 and end at {} (chain elements)",
             field, n);
  for (size_t i = 1; i < cuts.size(); ++i)
    LOOM_CHECK(cuts[i] > cuts[i - 1], "{}: boundaries must increase strictly (entry {} is {} after {})", field, i,
               cuts[i], cuts[i - 1]);
}

void ExecutorOptions::validate() const {
  schedule.validate();
  LOOM_CHECK(tp >= 1 && cp >= 1, "pipeline executor: tp = {} and cp = {} must be >= 1", tp, cp);
  LOOM_CHECK(zero_stage >= 0 && zero_stage <= 3, "pipeline executor: zero_stage = {} is not 0-3", zero_stage);
  LOOM_CHECK(bucket_bytes > 0, "pipeline executor: bucket_bytes = {} must be positive", bucket_bytes);
  adamw.validate();
}

namespace {

using Clock = std::chrono::steady_clock;

// One micro-batch's copy of a chunk: blocks that share the chunk's parameters but hold their own
// saved activations, the received input and output gradient.
struct Slot {
  std::vector<std::unique_ptr<model::ChainBlock>> blocks;
  // Stage boundary tensors hold `rows` rows of C: b T, or this rank's share under sp / cp.
  Tensor input;    // [rows, C] in the compute dtype (tag activations), chunks after the first virtual stage
  Tensor grad_in;  // [rows, C] (tag comm) gradient of the chunk's output
  const void* output = nullptr;  // [rows, C] the last block's out (chunks without the head)
  bool backward_done = false;
};

struct Chunk {
  int vs = 0;
  int64_t first = 0, last = 0;  // chain elements [first, last)
  // The recompute plan of the chunk's transformer blocks, the first of which is chain element b0:
  // the segment holding element e, and a segment's first and last elements.
  model::RecomputePlan plan;
  int64_t b0 = 0;
  int segment_of(int64_t e) const { return plan.segment_of(e - b0); }
  int64_t segment_first(int s) const { return b0 + plan.segments[size_t(s)].first; }
  int64_t segment_last(int s) const { return b0 + plan.segments[size_t(s)].second; }
  std::vector<std::unique_ptr<Slot>> all;
  std::vector<Slot*> free;
  std::map<int, Slot*> active;  // by micro-batch
  // The blocks holding the chunk's parameters (its first slot's), in chain order.
  std::vector<model::ChainBlock*> primary() const {
    std::vector<model::ChainBlock*> out;
    for (const auto& b : all[0]->blocks) out.push_back(b.get());
    return out;
  }
};

}  // namespace

struct PipelineExecutor::Impl {
  model::GPTConfig cfg;
  ExecutorOptions opt;
  comm::Comm& pp;
  comm::Comm* dp;
  model::ParallelGroups groups;
  MemoryPool& pool;
  int rank = 0;
  int64_t rows = 0;       // rows of a stage-boundary tensor for the current micro-batch shape
  model::Parameter* tied = nullptr;  // this rank's wte (or copy) that ties across first and last stage
  // The rank's backend over its pool: the chain blocks' ops, and their attention scratch (tag
  // workspace) which, like the backward scratch below, is one per rank: only one micro-batch
  // computes at a time, so every chunk and every micro-batch replica of it shares it.
  std::unique_ptr<Backend> own_be;  // the CPU's (a device's is the caller's: ExecutorOptions::backend)
  Backend* be = nullptr;
  DType dt = DType::f32;            // the backend's compute dtype: activations and their gradients
  // Activations and their gradients between stages over the pipeline: pp itself on the CPU, a
  // device communicator split from it on a GPU (Backend::buffer_comm); pp keeps the scalars.
  std::unique_ptr<comm::Comm> pp_dev;
  comm::Comm* pbuf = nullptr;
  // The tp / sp / cp layout of every chunk's blocks, and the buffers they share (one compute at a
  // time on this rank).
  std::shared_ptr<model::ChainParallel> par;
  std::vector<Chunk> chunks;
  std::vector<model::Parameter*> params;  // primaries, in chain order, then the wte copy
  std::unique_ptr<model::Parameter> wte_copy;
  model::Parameter* wte = nullptr;  // the wte this rank's head ties to
  // Data parallelism over this stage's blocks (every chunk's first slot, in chain order): the
  // reduction over dp (x cp), ZeRO 0-3, offload, and the step. base[c]: chunk c's first block's
  // index in it.
  std::unique_ptr<comm::Comm> self;  // a group of this rank alone, where there are no replicas
  std::unique_ptr<parallel::DataParallel> dpar;
  std::vector<int64_t> base;
  Tensor ws_dres, ws_bufC, ws_buf4C;  // f32 [rows, C], [N, C], [N, 4C / tp] (tag workspace; N = b T / cp)
  std::map<std::pair<int, int>, Tensor> grad_out;  // (mb, chunk) -> f32 [b, T, C] (tag comm) to send
  // Sends in flight: transfers are non-blocking on the sender's side, so a rank goes on computing
  // while its activation or gradient waits for the receiver. Each keeps its buffer (the gradient's
  // tensor; an activation lives in its slot until the slot's backward, by which time the next
  // stage has received it) and is waited for before that buffer goes or at the optimizer step.
  struct InFlight {
    Tensor buffer;  // a gradient's (empty for activations); declared first so it outlives `send`
    std::unique_ptr<comm::PendingSend> send;
  };
  std::map<std::tuple<int, int, int>, InFlight> in_flight;  // (0 act / 1 grad, mb, chunk)
  int64_t b = 0, T = 0;
  int active_slots = 0, peak_slots = 0;
  std::vector<double> losses;  // per micro-batch (last stage)
  bool evaluating = false;     // evaluate(): forwards only (no fused loss gradient)

  Impl(const model::GPTConfig& c, const ExecutorOptions& o, comm::Comm& p, comm::Comm* d, model::ParallelGroups g,
       MemoryPool& pl)
      : cfg(c), opt(o), pp(p), dp(d), groups(g), pool(pl),
        own_be(o.backend ? nullptr : make_backend(pl.device(), {.pool = &pl, .matmul = o.matmul})),
        be(o.backend ? o.backend : own_be.get()), dt(be->compute_dtype()),
        par(std::make_shared<model::ChainParallel>(*be, g, o.sp)) {
    pbuf = &pp;
    if (be->device() != Device::cpu) {  // (collective over pp; the sends are posted without waiting: staged)
      pp_dev = be->buffer_comm(pp.split(0, pp.rank()), /*staged=*/true);
      pbuf = pp_dev.get();
    }
  }

  std::unique_ptr<model::ChainBlock> make_block(int64_t e) {
    // Declared only: data parallelism places the parameters (its shard of them under ZeRO-3).
    const model::BlockOptions bo{.parallel = par, .defer_parameters = true};
    if (e == 0) return std::make_unique<model::Embedding>(cfg, *be, bo);
    if (e <= cfg.n_layer) return std::make_unique<model::TransformerBlock>(cfg, e - 1, *be, bo);
    return std::make_unique<model::Head>(cfg, wte, *be, bo);
  }

  Slot* acquire(Chunk& ch, int mb) {
    auto it = ch.active.find(mb);
    if (it != ch.active.end()) return it->second;
    if (ch.free.empty()) {
      auto s = std::make_unique<Slot>();
      // Replicas over the chunk's parameters (the first slot's), with activations of their own.
      for (int64_t e = ch.first; e < ch.last; ++e) s->blocks.push_back(ch.all[0]->blocks[size_t(e - ch.first)]->replica());
      ch.free.push_back(s.get());
      ch.all.push_back(std::move(s));
    }
    Slot* s = ch.free.back();
    ch.free.pop_back();
    ch.active[mb] = s;
    s->backward_done = false;
    peak_slots = std::max(peak_slots, ++active_slots);
    return s;
  }

  void finish_send(int kind, int mb, int c) {
    auto it = in_flight.find({kind, mb, c});
    if (it == in_flight.end()) return;
    it->second.send->wait();
    in_flight.erase(it);
  }
  // Drops the sends that completed (their gradient buffers go back to the pool).
  void reap_sends() {
    for (auto it = in_flight.begin(); it != in_flight.end();) {
      if (it->second.send->done()) {
        it->second.send->wait();
        it = in_flight.erase(it);
      } else {
        ++it;
      }
    }
  }
  void finish_sends() {
    for (auto& [key, f] : in_flight) f.send->wait();
    in_flight.clear();
  }

  void release(Chunk& ch, int mb) {
    finish_send(0, mb, int(&ch - chunks.data()));
    Slot* s = ch.active.at(mb);
    for (auto& blk : s->blocks) blk->release_activations();
    s->input = Tensor();
    s->grad_in = Tensor();
    s->output = nullptr;
    ch.active.erase(mb);
    ch.free.push_back(s);
    --active_slots;
  }

  Slot& slot_of(const Chunk& ch, int mb, const char* what) {
    auto it = ch.active.find(mb);
    LOOM_CHECK(it != ch.active.end(), "pipeline executor: rank {}: {} of micro-batch {} on virtual stage {} has no "
               "forward state", rank, what, mb, ch.vs);
    return *it->second;
  }

  void forward(int mb, int c, const Tensor& tokens, const Tensor& targets) {
    Chunk& ch = chunks[size_t(c)];
    Slot& s = *acquire(ch, mb);
    const void* x = nullptr;
    if (ch.first > 0) {
      LOOM_CHECK(s.input.defined(), "pipeline executor: rank {}: forward of micro-batch {} before its input arrived",
                 rank, mb);
      x = s.input.raw();
    }
    const float dscale = loss_scale();
    for (int64_t e = ch.first; e < ch.last; ++e) {
      model::ChainBlock* blk = s.blocks[size_t(e - ch.first)].get();
      const int64_t k = local(c, e);
      dpar->before_forward(k);
      if (e == 0) {
        auto* emb = static_cast<model::Embedding*>(blk);
        emb->forward(tokens.i32() + mb * b * T, b, T);
        x = emb->out().raw();
      } else if (e <= cfg.n_layer) {
        auto* tb = static_cast<model::TransformerBlock*>(blk);
        tb->forward(x, b, T);
        x = tb->out().raw();
        // A recomputed segment keeps only its input and its last block's output.
        const int sg = ch.segment_of(e);
        if (sg >= 0) {
          tb->drop_saved();
          if (e > ch.segment_first(sg)) s.blocks[size_t(e - 1 - ch.first)]->release_activations();
        }
      } else {
        auto* head = static_cast<model::Head*>(blk);
        losses[size_t(mb)] = head->forward(x, targets.defined() ? targets.i32() + mb * b * T : nullptr, b, T,
                                           /*fuse_backward=*/!evaluating, dscale);
        x = nullptr;
      }
      dpar->after_forward(k);
    }
    s.output = x;
  }

  // Full backward of (mb, chunk), or with `input_only` its input-gradient part (backward_input):
  // the weight GEMMs are deferred to backward_weight.
  void backward(int mb, int c, bool input_only = false) {
    Chunk& ch = chunks[size_t(c)];
    Slot& s = slot_of(ch, mb, "backward");
    const int64_t n = rows * cfg.n_embd;
    if (ch.last <= cfg.n_layer + 1)  // no head: the output gradient came from the next stage
      LOOM_CHECK(s.grad_in.defined(), "pipeline executor: rank {}: backward of micro-batch {} before its output "
                 "gradient arrived", rank, mb);
    model::BackwardScratch ws{ws_dres.raw(), ws_bufC.raw(), ws_buf4C.raw()};
    if (ch.last <= cfg.n_layer + 1)
      be->copy({.dst = ws.dres, .dst_dtype = dt, .src = s.grad_in.raw(), .src_dtype = dt, .n = n});
    const float dscale = loss_scale();
    // Stages 0/1 reduce after the step's last micro-batch (its weight gradients, under zero
    // bubble), 2/3 every micro-batch.
    dpar->set_last_micro(mb + 1 == opt.schedule.micro_batches);
    auto input_of = [&](int64_t e) -> const void* {  // the element's input
      const size_t k = size_t(e - ch.first);
      if (k > 0) {
        model::ChainBlock* prev = s.blocks[k - 1].get();
        return e - 1 == 0 ? static_cast<model::Embedding*>(prev)->out().raw()
                          : static_cast<model::TransformerBlock*>(prev)->out().raw();
      }
      return e > 0 ? s.input.raw() : nullptr;
    };
    for (int64_t e = ch.last - 1; e >= ch.first; --e) {
      const size_t k = size_t(e - ch.first);
      const int sg = ch.segment_of(e);
      if (sg >= 0 && e == ch.segment_last(sg))  // the segment runs forward again first
        for (int64_t m = ch.segment_first(sg); m <= e; ++m) {
          dpar->before_forward(local(c, m));
          static_cast<model::TransformerBlock*>(s.blocks[size_t(m - ch.first)].get())->forward(input_of(m), b, T);
          dpar->after_forward(local(c, m));
        }
      const void* x_in = input_of(e);
      model::ChainBlock* blk = s.blocks[k].get();
      // (The split backward's input pass writes only the norms' gradients, which data parallelism
      // keeps whole for the step; its weight pass below completes the buckets.)
      if (input_only) dpar->before_input_backward(local(c, e));
      else dpar->before_backward(local(c, e));
      if (input_only) {
        if (e == 0) static_cast<model::Embedding*>(blk)->backward_input(ws.dres);
        else if (e <= cfg.n_layer) static_cast<model::TransformerBlock*>(blk)->backward_input(x_in, ws);
        else static_cast<model::Head*>(blk)->backward_input(x_in, ws, dscale);
      } else {
        if (e == 0) static_cast<model::Embedding*>(blk)->backward(ws.dres);
        else if (e <= cfg.n_layer) static_cast<model::TransformerBlock*>(blk)->backward(x_in, ws);
        else static_cast<model::Head*>(blk)->backward(x_in, ws, dscale);
        if (sg >= 0) blk->release_activations();  // (the split backward keeps them for backward_weight)
        dpar->after_backward(local(c, e));
      }
      if (input_only) dpar->after_input_backward(local(c, e));
    }
    s.grad_in = Tensor();  // consumed
    if (ch.first > 0) {
      Tensor g = be->empty({rows, cfg.n_embd}, dt, MemTag::comm);
      be->copy({.dst = g.raw(), .dst_dtype = dt, .src = ws.dres, .src_dtype = dt, .n = n});
      grad_out[{mb, c}] = std::move(g);
    }
    s.backward_done = true;
  }

  // The deferred weight gradients of (mb, chunk), in the fused backward's block order (last
  // element first), so every parameter's gradient gets the same additions in the same order.
  void backward_weight(int mb, int c) {
    Chunk& ch = chunks[size_t(c)];
    Slot& s = slot_of(ch, mb, "backward_weight");
    LOOM_CHECK(s.backward_done, "pipeline executor: rank {}: weight gradient of micro-batch {} before its input "
               "gradient", rank, mb);
    dpar->set_last_micro(mb + 1 == opt.schedule.micro_batches);
    for (int64_t e = ch.last - 1; e >= ch.first; --e) {
      model::ChainBlock* blk = s.blocks[size_t(e - ch.first)].get();
      dpar->before_weight_backward(local(c, e));
      if (e == 0) static_cast<model::Embedding*>(blk)->backward_weight();
      else if (e <= cfg.n_layer) static_cast<model::TransformerBlock*>(blk)->backward_weight();
      else static_cast<model::Head*>(blk)->backward_weight();
      dpar->after_backward(local(c, e));
    }
  }

  void send_act(int mb, int c, int peer) {
    Slot& s = slot_of(chunks[size_t(c)], mb, "send of the activation");
    LOOM_CHECK(s.output != nullptr, "pipeline executor: rank {}: send of micro-batch {} before its forward", rank, mb);
    in_flight[{0, mb, c}] = {Tensor(), pbuf->isend(s.output, rows * cfg.n_embd, dt, peer, 0)};
  }

  void recv_act(int mb, int c, int peer) {
    Slot* s = acquire(chunks[size_t(c)], mb);
    s->input = be->empty({rows, cfg.n_embd}, dt, MemTag::activations);
    pbuf->recv(s->input.raw(), s->input.numel(), dt, peer, 0);
  }

  void send_grad(int mb, int c, int peer) {
    auto it = grad_out.find({mb, c});
    LOOM_CHECK(it != grad_out.end(), "pipeline executor: rank {}: send of the gradient of micro-batch {} before its "
               "backward", rank, mb);
    auto send = pbuf->isend(it->second.raw(), it->second.numel(), dt, peer, 0);
    in_flight[{1, mb, c}] = {std::move(it->second), std::move(send)};
    grad_out.erase(it);
  }

  void recv_grad(int mb, int c, int peer) {
    Slot& s = slot_of(chunks[size_t(c)], mb, "receive of the output gradient");
    s.grad_in = be->empty({rows, cfg.n_embd}, dt, MemTag::comm);
    pbuf->recv(s.grad_in.raw(), s.grad_in.numel(), dt, peer, 0);
  }

  // The data-parallel reduction's group: dp x cp (the cp ranks of a stage hold partial sums of
  // its gradients), dp, cp, or none.
  comm::Comm* replica_group() const {
    const bool has_dp = dp && dp->size() > 1, has_cp = groups.cp && groups.cp->size() > 1;
    if (has_dp && has_cp) {
      LOOM_CHECK(groups.dp_cp && groups.dp_cp->size() == dp->size() * groups.cp->size(),
                 "pipeline executor: dp = {} with cp = {} needs groups.dp_cp, the dp x cp group", dp->size(),
                 groups.cp->size());
      return groups.dp_cp;
    }
    return has_cp ? par->cp_host_group() : has_dp ? dp : nullptr;
  }

  // What the chunk's blocks save per micro-batch of [b, T], the received input (chunks after the
  // first) among what stays outside the transformer blocks.
  model::ChainMemory chunk_memory(const Chunk& ch, int64_t b, int64_t T) const {
    model::ChainMemory cm = model::chain_memory(ch.primary(), b, T);
    if (ch.first > 0) cm.fixed += double(par->own_rows(b, T) * cfg.n_embd * int64_t(dtype_size(dt)));
    return cm;
  }

  // Chain element e of chunk c: its block's index in the stage's data-parallel chain.
  int64_t local(int c, int64_t e) const { return base[size_t(c)] + (e - chunks[size_t(c)].first); }
  // Each micro-batch's loss gradient: the mean over the m micro-batches, and over the dp replicas
  // (the data-parallel reduction sums).
  float loss_scale() const { return 1.0f / float(opt.schedule.micro_batches * (dp ? dp->size() : 1)); }

  // Data parallelism over this stage's chunks, each a range its backwards run over; the wte copy
  // belongs to the head. A wte copy and, under tp, a parameter whole on every tp rank count in the
  // norm on tp rank 0 only (the copy nowhere).
  void make_data_parallel(const ExecutorOptions& o, MemoryPool* host_pool) {
    parallel::DataChain dc;
    for (Chunk& ch : chunks) {
      base.push_back(int64_t(dc.blocks.size()));
      dc.range_starts.push_back(int(dc.blocks.size()));
      for (model::ChainBlock* blk : ch.primary()) {
        dc.blocks.push_back(blk);
        dc.owned.push_back(blk->parameters());
        if (o.schedule.kind == Kind::zb_h1)
          for (model::Parameter* prm : blk->input_pass_parameters()) dc.input_pass.push_back(prm);
      }
    }
    dc.range_starts.erase(dc.range_starts.begin());  // ({0} by default)
    if (wte_copy) dc.owned.back().push_back(wte_copy.get());
    // A rank holding both the embedding and the tied head (a pipeline of one stage) ties them as
    // a whole model does.
    if (!wte_copy && cfg.tied_embeddings && chunks.front().first == 0 && chunks.back().last == cfg.n_layer + 2)
      dc.tied = wte;
    dc.backend = be;
    dc.seed = o.seed;
    for (const auto& ow : dc.owned) params.insert(params.end(), ow.begin(), ow.end());
    comm::Comm* group = replica_group();
    if (!group) {
      self = pp.split(pp.rank(), 0);  // collective over the pipeline
      group = self.get();
    }
    parallel::DataParallelOptions d;
    d.zero = group->size() > 1 ? o.zero_stage : 0;
    d.offload = o.offload;
    d.host_pool = host_pool;
    d.bucket_bytes = o.bucket_bytes;
    d.prefetch = o.prefetch;
    d.norm_group = par->tp_host_group();  // (its scalars in host memory)
    if (be->device() != Device::cpu) d.norm_buffers = par->tp_group();  // (its device buffers')
    d.stage_group = &pp;
    const int tpr = groups.tp ? groups.tp->rank() : 0;
    for (model::Parameter* prm : params) d.in_norm.push_back(prm != wte_copy.get() && (prm->shard.split || tpr == 0));
    dpar = std::make_unique<parallel::DataParallel>(std::move(dc), *group, o.adamw, d);
  }

  StepResult optimizer_step(double lr) {
    StepResult res;
    // Tied embeddings: the first and last stages add their reduced wte gradients (a + b == b + a,
    // so both copies get bit-identical sums). Under tp the two hold the same vocabulary rows.
    if (tied) dpar->add_peer_gradient(tied, *pbuf, rank == 0 ? pp.size() - 1 : 0);
    // The norm adds this rank's counted sums over dp (x cp), tp and the pipeline.
    const optim::StepStats st = dpar->step(lr < 0 ? opt.adamw.lr : lr);
    res.grad_norm = st.grad_norm;
    res.skipped = st.skipped;
    return res;
  }
};

PipelineExecutor::PipelineExecutor(const model::GPTConfig& cfg, const ExecutorOptions& opt, comm::Comm& pp,
                                   comm::Comm* dp, MemoryPool& pool, model::ParallelGroups groups,
                                   MemoryPool* host_pool)
    : impl_(std::make_unique<Impl>(cfg, opt, pp, dp, groups, pool)) {
  opt.validate();
  cfg.validate("pipeline executor model config");
  LOOM_CHECK(pp.size() == opt.schedule.stages, "pipeline executor: schedule.stages = {} but the pipeline "
             "communicator has {} ranks", opt.schedule.stages, pp.size());
  const int tp_size = groups.tp ? groups.tp->size() : 1, cp_size = groups.cp ? groups.cp->size() : 1;
  LOOM_CHECK(tp_size == opt.tp && cp_size == opt.cp, "pipeline executor: tp = {} and cp = {} but the groups have {} "
             "and {} ranks", opt.tp, opt.cp, tp_size, cp_size);
  LOOM_CHECK(!opt.offload || host_pool, "pipeline executor: offload needs a host pool");
  Impl& I = *impl_;
  I.rank = pp.rank();
  I.par->check(cfg, "model config '" + cfg.name + "'");
  LOOM_CHECK(opt.seq_len >= 0 && opt.seq_len <= cfg.block_size, "pipeline executor: seq_len = {} outside [0, "
             "block_size = {}]", opt.seq_len, cfg.block_size);
  const int64_t T = opt.seq_len > 0 ? opt.seq_len : cfg.block_size;
  const OpCosts costs = op_costs(cfg, T);
  sch_ = generate(opt.schedule, costs);
  checked_ = check_or_throw(sch_, costs);
  const int p = sch_.p(), v = sch_.v(), V = p * v;
  const int64_t n = cfg.n_layer + 2;
  if (opt.cuts.empty()) {
    LOOM_CHECK(n >= V, "pipeline executor: {} virtual stages but the chain has only {} elements (n_layer + 2)", V, n);
    cuts_ = balance_chain(chain_costs(cfg, T), V);
  } else {
    validate_cuts(opt.cuts, n, V, "pipeline cuts");
    cuts_ = opt.cuts;
  }
  // The wte a head on this rank ties to: the embedding's when this rank owns it, else a copy.
  const bool owns_embedding = I.rank == sch_.rank_of(0);
  const bool owns_head = I.rank == sch_.rank_of(V - 1);
  for (int c = 0; c < v; ++c) {
    Chunk ch;
    ch.vs = sch_.virtual_stage(I.rank, c);
    ch.first = cuts_[size_t(ch.vs)];
    ch.last = cuts_[size_t(ch.vs + 1)];
    I.chunks.push_back(std::move(ch));
  }
  if (cfg.tied_embeddings && owns_head && !owns_embedding) {
    // The same vocabulary rows as pipeline rank 0's wte at this tp rank, drawn from the same seed
    // (by data parallelism, with the stage's other parameters).
    I.wte_copy = std::make_unique<model::Parameter>(model::Embedding::wte_param(cfg, *I.par));
    I.wte_copy->shard.tied_copy = true;
    I.wte = I.wte_copy.get();
  }
  for (Chunk& ch : I.chunks) {
    auto s = std::make_unique<Slot>();
    for (int64_t e = ch.first; e < ch.last; ++e) {
      auto blk = I.make_block(e);
      if (e == 0) I.wte = &static_cast<model::Embedding*>(blk.get())->wte();
      s->blocks.push_back(std::move(blk));
    }
    ch.free.push_back(s.get());
    ch.all.push_back(std::move(s));
  }
  // Each chunk's recomputed segments over its transformer blocks (a selective plan marks the
  // blocks instead; their micro-batch replicas copy the mark). optimal: the least recompute that
  // keeps this rank's saved activations within opt.activation_budget with the micro-batches the
  // schedule keeps in flight here (model/recompute.h), from the blocks' declarations at the
  // micro-batch [micro_batch, T].
  const bool optimal = opt.recompute == model::Recompute::optimal;
  if (optimal) {
    LOOM_CHECK(opt.activation_budget > 0, "memory.activation_budget: the optimal recompute policy needs a budget "
               "(bytes per rank)");
    LOOM_CHECK(opt.micro_batch > 0, "pipeline executor: the optimal recompute policy needs the micro-batch size");
  }
  const double in_flight = double(std::max(1, checked_.ranks[size_t(I.rank)].peak_in_flight));
  std::vector<model::ChainMemory> mems;
  std::vector<std::string> unplanned;  // why a chunk's own plan for every micro-batch in flight failed
  for (Chunk& ch : I.chunks) {
    const int64_t b0 = std::max<int64_t>(ch.first, 1), b1 = std::min<int64_t>(ch.last, cfg.n_layer + 1);
    model::ChainMemory cm;
    if (optimal) {  // (with the received input among what stays outside the blocks)
      cm = I.chunk_memory(ch, opt.micro_batch, T);
      cm.in_flight = in_flight;
      cm.split_backward = sch_.split_backward();
      if (cm.split_backward)
        for (const auto& [n, q] : split_peaks_of(sch_.ranks[size_t(I.rank)])) cm.split_peaks.push_back({n, q});
    } else {  // (the other policies need the number of blocks only)
      cm.full.assign(size_t(std::max<int64_t>(b1 - b0, 0)), 1.0);
      cm.out.assign(cm.full.size(), 1.0);
      cm.forward.assign(cm.full.size(), 1.0);
    }
    ch.b0 = b0;
    mems.push_back(cm);
    // (With several chunks a chunk whose plan alone cannot hold every micro-batch in flight as its
    // own may still fit jointly: the options below.)
    if (optimal && I.chunks.size() > 1) {
      try {
        ch.plan = model::plan_recompute(opt.recompute, cm, opt.recompute_every, double(opt.activation_budget));
      } catch (const Error& e) {
        ch.plan = model::RecomputePlan{};
        unplanned.push_back(e.what());
      }
    } else {
      ch.plan = model::plan_recompute(opt.recompute, cm, opt.recompute_every, double(opt.activation_budget));
    }
  }
  if (optimal) {
    // With one chunk per rank its plan's own peak is the rank's. With several (interleaved), each
    // chunk's plan alone keeps every micro-batch in flight within the budget as if they were all
    // its own; what the rank holds is each chunk's micro-batches along the schedule's list: the
    // joint plan (joint_plan.h) weighs every plan of each chunk that may be needed. (Offering each
    // chunk only its least-recompute plans for 1 .. in_flight micro-batches of its own had missed
    // lopsided combinations: one block more recomputed than needed at some budgets.)
    const double budget = double(opt.activation_budget);
    std::vector<std::optional<model::RecomputePlan>> own;
    for (const Chunk& ch : I.chunks) {
      const size_t k = size_t(&ch - I.chunks.data());
      if (I.chunks.size() == 1 || ch.plan.blocks > 0 || mems[k].full.empty()) own.push_back(ch.plan);
      else own.push_back(std::nullopt);
    }
    const JointRecompute joint = plan_joint_recompute(mems, own, sch_.ranks[size_t(I.rank)], budget, I.rank,
                                                      unplanned.empty() ? std::string("no plan") : unplanned.back());
    planned_peak_ = joint.peak;
    for (size_t k = 0; k < I.chunks.size(); ++k) {
      I.chunks[k].plan = joint.plans[k];
      recomputed_ += I.chunks[k].plan.recomputed_blocks();
      blocks_ += int64_t(mems[k].full.size());
    }
    LOOM_CHECK(planned_peak_ <= budget,
               "memory.activation_budget: {} per rank, but pipeline rank {} keeps up to {:.0f} micro-batches of its "
               "chunks in flight and needs {} of saved activations with the plans of its chunks that need the least{} "
               "({} of {} blocks recomputed); a larger budget, fewer micro-batches (train.grad_accum) or another "
               "schedule fits",
               format_bytes(int64_t(opt.activation_budget)), I.rank, in_flight, format_bytes(int64_t(planned_peak_)),
               joint.exhaustive ? "" : " that a search of their combinations found (too many to try every one)",
               recomputed_, blocks_);
  }
  for (Chunk& ch : I.chunks)
    if (ch.plan.selective)
      for (int64_t e = ch.b0; e < std::min<int64_t>(ch.last, cfg.n_layer + 1); ++e)
        static_cast<model::TransformerBlock*>(ch.all[0]->blocks[size_t(e - ch.first)].get())->set_selective(true);
  if (cfg.tied_embeddings && p > 1 && owns_embedding != owns_head) I.tied = I.wte;
  I.make_data_parallel(opt, host_pool);
}

PipelineExecutor::~PipelineExecutor() = default;

std::vector<model::Parameter*> PipelineExecutor::parameters() const { return impl_->params; }
bool PipelineExecutor::is_copy(const model::Parameter* p) const { return p != nullptr && p == impl_->wte_copy.get(); }
parallel::DataParallel& PipelineExecutor::data_parallel() const { return *impl_->dpar; }

int64_t PipelineExecutor::activation_bytes_per_micro_batch(int chunk, int64_t b, int64_t T) const {
  const Chunk& ch = impl_->chunks.at(size_t(chunk));
  return int64_t(model::plan_kept(ch.plan, impl_->chunk_memory(ch, b, T)));
}

void PipelineExecutor::prepare(const Tensor& tokens, const Tensor& targets) {
  Impl& I = *impl_;
  const int m = sch_.m();
  LOOM_CHECK(tokens.defined() && tokens.dim() == 2 && tokens.dtype() == DType::i32,
             "pipeline executor: tokens must be i32 [B, T]");
  LOOM_CHECK(targets.defined() && targets.shape() == tokens.shape() && targets.dtype() == DType::i32,
             "pipeline executor: targets must be i32 of the tokens' shape");
  const int64_t B = tokens.size(0), T = tokens.size(1);
  LOOM_CHECK(B % m == 0, "pipeline executor: batch size {} is not divisible by micro_batches = {}", B, m);
  LOOM_CHECK(T >= 1 && T <= I.cfg.block_size, "pipeline executor: sequence length {} outside [1, block_size = {}]", T,
             I.cfg.block_size);
  if (I.opt.cp > 1)
    LOOM_CHECK(T % (2 * I.opt.cp) == 0, "pipeline executor: sequence length {} is not divisible by 2 x cp = {}", T,
               2 * I.opt.cp);
  shape(B / m, T);
}

void PipelineExecutor::shape(int64_t b, int64_t T) {
  Impl& I = *impl_;
  const int64_t C = I.cfg.n_embd;
  I.rows = I.par->own_rows(b, T);
  if (b != I.b || T != I.T) {
    I.b = b;
    I.T = T;
    const int64_t N = I.par->rows(b, T);
    I.ws_dres = Tensor();
    I.ws_bufC = Tensor();
    I.ws_buf4C = Tensor();
    I.ws_dres = I.be->empty({I.rows, C}, I.dt, MemTag::workspace);
    I.ws_bufC = I.be->empty({N, C}, I.dt, MemTag::workspace);
    I.ws_buf4C = I.be->empty({N, model::wide_columns(I.cfg, I.opt.tp)}, I.dt, MemTag::workspace);
    // The attention scratch for this shape's largest call, the same for every block: sized once
    // from this rank's first transformer block (under cp the ring prepares its chunk pairs').
    for (Chunk& ch : I.chunks) {
      if (I.opt.cp > 1) break;
      const int64_t e = std::max<int64_t>(ch.first, 1);
      if (e >= std::min<int64_t>(ch.last, I.cfg.n_layer + 1)) continue;
      I.be->prepare_attention(I.dt, static_cast<const model::TransformerBlock*>(
                                              ch.all[0]->blocks[size_t(e - ch.first)].get())->attention_shape(b, T));
      break;
    }
  }
}

std::vector<double> PipelineExecutor::evaluate(const Tensor& tokens, const Tensor& targets) {
  Impl& I = *impl_;
  const int m = sch_.m();
  prepare(tokens, targets);
  I.losses.assign(size_t(m), 0.0);
  I.evaluating = true;
  for (const Instr& in : sch_.ranks[size_t(I.rank)]) {
    if (!I.in_flight.empty()) I.reap_sends();
    switch (in.op) {
      case Op::forward: I.forward(in.mb, in.chunk, tokens, targets); break;
      case Op::send_act: I.send_act(in.mb, in.chunk, in.peer); break;
      case Op::recv_act: I.recv_act(in.mb, in.chunk, in.peer); break;
      case Op::backward:
      case Op::backward_weight: I.release(I.chunks[size_t(in.chunk)], in.mb); break;
      default: break;  // no gradients, no update
    }
  }
  I.finish_sends();
  I.evaluating = false;
  // The losses live on the head's rank; every pipeline rank gets them, averaged over replicas.
  std::vector<float> l(I.losses.begin(), I.losses.end());
  I.pp.broadcast(l.data(), m, DType::f32, sch_.rank_of(sch_.num_virtual_stages() - 1));
  if (I.dp && I.dp->size() > 1) {
    I.dp->all_reduce(l.data(), m, DType::f32);
    for (float& x : l) x /= float(I.dp->size());
  }
  return std::vector<double>(l.begin(), l.end());
}

const model::ChainParallel& PipelineExecutor::parallel() const { return *impl_->par; }

std::vector<float> PipelineExecutor::last_logits(const Tensor& context, int64_t position) {
  Impl& I = *impl_;
  LOOM_CHECK(context.defined() && context.dim() == 2 && context.size(0) == 1 && context.dtype() == DType::i32,
             "pipeline executor: a context is i32 [1, T]");
  const int64_t T = context.size(1);
  LOOM_CHECK(T >= 1 && T <= I.cfg.block_size, "pipeline executor: context of {} tokens outside [1, block_size = {}]", T,
             I.cfg.block_size);
  LOOM_CHECK(position >= 0 && position < T, "pipeline executor: position {} outside the context of {}", position, T);
  if (I.opt.cp > 1)
    LOOM_CHECK(T % (2 * I.opt.cp) == 0, "pipeline executor: a context of {} tokens is not divisible by 2 x cp = {}", T,
               2 * I.opt.cp);
  shape(1, T);
  I.evaluating = true;
  // The context as one micro-batch, through the virtual stages in order: each receives the
  // previous stage's output, runs forward, and sends its own on.
  const int V = sch_.num_virtual_stages();
  for (int vs = 0; vs < V; ++vs) {
    if (sch_.rank_of(vs) != I.rank) continue;
    const int c = sch_.chunk_of(vs);
    if (vs > 0) I.recv_act(0, c, sch_.rank_of(vs - 1));
    I.forward(0, c, context, Tensor());
    if (vs + 1 < V) I.send_act(0, c, sch_.rank_of(vs + 1));
  }
  I.finish_sends();
  // The head's stage holds the logits: the row of `position` there (from its cp and tp ranks),
  // then to every stage.
  const int head_rank = sch_.rank_of(V - 1);
  std::vector<float> row(static_cast<size_t>(I.par->vocab_rows(I.cfg) * I.opt.tp));
  if (I.rank == head_rank) {
    Chunk& last = I.chunks[size_t(sch_.chunk_of(V - 1))];
    const auto* head = static_cast<const model::Head*>(I.slot_of(last, 0, "logits").blocks.back().get());
    const Tensor& lg = head->logits();
    if (lg.device() == Device::cpu && lg.dtype() == DType::f32) {
      row = I.par->logits_row(lg.f32(), T, position, I.cfg);
    } else {  // (a device's: looked at on the host)
      std::vector<float> host(size_t(lg.numel()));
      I.be->download(host.data(), lg.raw(), lg.dtype(), lg.numel());
      row = I.par->logits_row(host.data(), T, position, I.cfg);
    }
  }
  I.pp.broadcast(row.data(), int64_t(row.size()), DType::f32, head_rank);
  for (Chunk& ch : I.chunks)
    if (ch.active.count(0)) I.release(ch, 0);
  I.evaluating = false;
  return row;
}

StepResult PipelineExecutor::step(const Tensor& tokens, const Tensor& targets, double lr) {
  Impl& I = *impl_;
  const int m = sch_.m();
  prepare(tokens, targets);
  I.dpar->zero_grad();
  I.losses.assign(size_t(m), 0.0);
  I.peak_slots = 0;
  trace_.clear();
  I.pp.barrier();  // one time origin for the whole pipeline's trace
  const auto t0 = Clock::now();
  auto secs = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  StepResult res;
  for (const Instr& in : sch_.ranks[size_t(I.rank)]) {
    if (!I.in_flight.empty()) I.reap_sends();
    const bool compute = is_compute(in.op);  // only computes are traced: sends and receives read no clock
    const double start = compute ? secs() : 0, cpu0 = compute ? thread_cpu_seconds() : 0;
    switch (in.op) {
      case Op::forward: I.forward(in.mb, in.chunk, tokens, targets); break;
      case Op::backward:
        I.backward(in.mb, in.chunk);
        I.release(I.chunks[size_t(in.chunk)], in.mb);
        break;
      // Zero bubble: backward_input computes the gradient the previous stage waits for and keeps
      // the linear layers' output gradients; backward_weight turns them into weight gradients and
      // frees the micro-batch's activations.
      case Op::backward_input: I.backward(in.mb, in.chunk, /*input_only=*/true); break;
      case Op::backward_weight:
        I.backward_weight(in.mb, in.chunk);
        I.release(I.chunks[size_t(in.chunk)], in.mb);
        break;
      case Op::send_act: I.send_act(in.mb, in.chunk, in.peer); break;
      case Op::recv_act: I.recv_act(in.mb, in.chunk, in.peer); break;
      case Op::send_grad: I.send_grad(in.mb, in.chunk, in.peer); break;
      case Op::recv_grad: I.recv_grad(in.mb, in.chunk, in.peer); break;
      case Op::optimizer_step: {
        I.finish_sends();
        StepResult r = I.optimizer_step(lr);
        res.grad_norm = r.grad_norm;
        res.skipped = r.skipped;
        break;
      }
    }
    if (compute) {
      // A device's ops are only enqueued when the call returns: the time is the work's once the
      // queue has drained (the staged send that usually follows waits for it anyway).
      if (I.be->device() != Device::cpu) I.be->synchronize();
      trace_.push_back({in.op, in.mb, in.chunk, start, secs(), thread_cpu_seconds() - cpu0});
    }
  }
  peak_slots_ = I.peak_slots;
  // The loss lives on the head's rank: mean over micro-batches, shared with the pipeline and
  // averaged over data-parallel replicas.
  float loss = 0;
  if (I.rank == sch_.rank_of(sch_.num_virtual_stages() - 1)) {
    double sum = 0;
    for (double l : I.losses) sum += l;
    loss = float(sum / m);
  }
  I.pp.broadcast(&loss, 1, DType::f32, sch_.rank_of(sch_.num_virtual_stages() - 1));
  if (I.dp && I.dp->size() > 1) {
    I.dp->all_reduce(&loss, 1, DType::f32);
    loss /= float(I.dp->size());
  }
  res.loss = loss;
  return res;
}

void write_chrome_trace(const std::string& path, const std::vector<std::vector<TraceEvent>>& ranks) {
  nlohmann::json ev = nlohmann::json::array();
  for (size_t r = 0; r < ranks.size(); ++r) {
    ev.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", r}, {"args", {{"name", fmt::format("rank {}", r)}}}});
    for (const TraceEvent& e : ranks[r])
      ev.push_back({{"name", fmt::format("{}{}", op_name(e.op), e.mb)},
                    {"cat", std::string(op_name(e.op))},
                    {"ph", "X"},
                    {"pid", 0},
                    {"tid", r},
                    {"ts", e.start * 1e6},
                    {"dur", (e.end - e.start) * 1e6},
                    {"args", {{"mb", e.mb}, {"chunk", e.chunk}, {"cpu_ms", e.cpu * 1e3}}}});
  }
  write_file_atomically(path, nlohmann::json{{"traceEvents", ev}, {"displayTimeUnit", "ms"}}.dump(), {.make_parent = true});
}

Timeline trace_timeline(const std::string& title, const std::vector<std::vector<TraceEvent>>& ranks) {
  Timeline tl;
  tl.title = title;
  double t0 = std::numeric_limits<double>::infinity();
  for (auto& r : ranks)
    for (auto& e : r) t0 = std::min(t0, e.start);
  tl.rows.resize(ranks.size());
  for (size_t r = 0; r < ranks.size(); ++r)
    for (auto& e : ranks[r]) tl.rows[r].push_back({e.start - t0, e.end - t0, e.op, e.mb, e.chunk});
  return tl;
}

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

std::vector<std::vector<double>> compute_seconds(const std::vector<std::vector<TraceEvent>>& ranks) {
  std::vector<std::vector<double>> out;
  for (auto& r : ranks) {
    out.emplace_back();
    for (auto& e : r) out.back().push_back(e.cpu);
  }
  return out;
}

std::vector<double> idle_fractions(const std::vector<std::vector<TraceEvent>>& ranks) {
  double t0 = std::numeric_limits<double>::infinity(), t1 = -t0;
  for (auto& r : ranks)
    for (auto& e : r) {
      t0 = std::min(t0, e.start);
      t1 = std::max(t1, e.end);
    }
  std::vector<double> out;
  for (auto& r : ranks) {
    double busy = 0;
    for (auto& e : r) busy += e.end - e.start;
    out.push_back(t1 > t0 ? 1.0 - busy / (t1 - t0) : 0.0);
  }
  return out;
}

}  // namespace loom::parallel::pipeline

#include "train/trainer.h"
#include "core/threads.h"
#include "core/file.h"
#include "train/engine.h"
#include "train/run_util.h"
#include "train/stop.h"

#include <omp.h>
#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "comm/threads.h"
#include "core/error.h"
#include "data/loader.h"
#include "data/tokenizer.h"
#include "kernels/cpu/matmul.h"
#include "kernels/emu/backend.h"
#include "model/gpt.h"
#include "model/param_specs.h"
#include "optim/adamw.h"
#include "parallel/data/data_parallel.h"
#include "parallel/data/trace.h"
#include "parallel/mesh.h"
#include "parallel/pipeline/executor.h"
#include "parallel/pipeline/stage_layers.h"
#include "train/checkpoint.h"
#include "train/checkpoint_io.h"
#include "train/safetensors.h"
#include "train/schedule.h"

namespace fs = std::filesystem;

namespace loom::train {

namespace {

namespace pipe = parallel::pipeline;
using parallel::sum_over_ranks;

// The checkpoint slices of `kind` ("param/", "adam_m/", "adam_v/") of p's local elements [lb, le),
// which lie at data.
void add_slices(std::vector<Slice>& out, const char* kind, const model::Parameter& p, int64_t lb, int64_t le,
                const float* data) {
  const std::string name = kind + p.global().name;
  // (A replicated key/value head is written by the first rank holding it.)
  p.for_each_global(
      lb, le, [&](int64_t g, int64_t n, int64_t local) { out.push_back({name, g, n, data + (local - lb)}); },
      /*owned_only=*/true);
}

// The inverse: p's local elements [lb, le) of `kind` from the checkpoint into data (the padding
// zeroed).
void read_slices(CheckpointReader& ckpt, const char* kind, const model::Parameter& p, int64_t lb, int64_t le,
                 float* data) {
  std::fill(data, data + (le - lb), 0.0f);
  const std::string name = kind + p.global().name;
  p.for_each_global(lb, le, [&](int64_t g, int64_t n, int64_t local) { ckpt.read(name, g, n, data + (local - lb)); });
}

// With a pruned input embedding (GPTConfig::kept_tokens) whose checkpoint tensor is the whole
// vocabulary's (the fine-tune's starting point): p's local elements [lb, le) of `kind` are the
// rows of its kept tokens there.
void read_kept_rows(CheckpointReader& ckpt, const char* kind, const model::Parameter& p, int64_t lb, int64_t le,
                    float* data, const std::vector<int32_t>& kept) {
  const std::string name = kind + p.global().name;
  const Shape full = ckpt.shape(name);
  const int64_t C = p.spec.shape[1];
  LOOM_CHECK(full.size() == 2 && full[1] == C && full[0] > kept.back(),
             "{}: tensor '{}' has shape {}, which holds no row {} of width {}", ckpt.path(), name,
             shape_str(full), kept.back(), C);
  for (int64_t g = lb; g < le;) {
    const int64_t row = g / C, col = g % C, n = std::min(le - g, C - col);
    ckpt.read(name, int64_t(kept[size_t(row)]) * C + col, n, data + (g - lb));
    g += n;
  }
}

// Before a pruned fine-tune loads checkpoint `ckpt` (every rank): one of the whole vocabulary's
// wte (its start), whose table the lead writes to train.out_dir/pruned_rows.safetensors, where
// export and generation take the rows the run does not train (the rank holds the table while it
// writes it, once); or one of the same pruned run, whose kept tokens must be this run's.
void prepare_pruned_embedding(CheckpointReader& r, const std::string& ckpt, const model::GPTConfig& mc,
                              const TrainConfig& cfg, bool lead, MemoryPool& pool) {
  const std::vector<int32_t>& kept = *mc.kept_tokens;
  const std::string rows_path = model::pruned_rows_path(cfg.out_dir);
  if (r.has("vocab/kept")) {
    std::vector<float> theirs(size_t(shape_numel(r.shape("vocab/kept"))));
    r.read("vocab/kept", 0, int64_t(theirs.size()), theirs.data());
    if (theirs.size() != kept.size() || !std::equal(kept.begin(), kept.end(), theirs.begin(),
                                                    [](int32_t a, float b) { return float(a) == b; }))
      throw Error(fmt::format("{}: its pruned input embedding keeps {} tokens, but data.dir {} uses {} others "
                              "(model.prune_embedding keeps the tokens of the run's data: resume on the data the run "
                              "was pruned for)",
                              ckpt, theirs.size(), cfg.data_dir, kept.size()));
    LOOM_CHECK(fs::exists(rows_path),
               "{}: missing: the input embedding's rows this pruned run does not train (written when it started); "
               "export and generation need them",
               rows_path);
    if (lead) model::verify_pruned_rows(rows_path, {mc.vocab_size, mc.n_embd});
    return;
  }
  const Shape full = r.shape("param/wte.weight");
  LOOM_CHECK(full == (Shape{mc.vocab_size, mc.n_embd}), "{}: param/wte.weight has shape {}, expected [{}, {}]", ckpt,
             shape_str(full), mc.vocab_size, mc.n_embd);
  if (!lead) return;
  Tensor table = Tensor::empty(full, DType::f32, MemTag::workspace, pool);
  r.read_into("param/wte.weight", table);
  model::write_pruned_rows(rows_path, table, ckpt);
}

// Every full tensor of a checkpoint of model mc: each parameter's value and moments (under GaLore
// a projected matrix's moments and projector), in GPT::parameters() order, so every layout writes
// the same list.
std::vector<TensorInfo> checkpoint_tensors(const model::GPTConfig& mc, const optim::AdamWConfig& oc) {
  std::vector<TensorInfo> out;
  if (mc.kept_tokens) out.push_back({"vocab/kept", {mc.input_rows()}});  // the pruned embedding's token ids
  for (const model::ParamSpec& s : model::gpt_param_specs(mc)) {
    out.push_back({"param/" + s.name, s.shape});
    const optim::GaLoreShapes g = optim::galore_shapes(s.name, s.shape, oc.galore_rank, s.row_blocks);
    if (g.low_rank) {
      for (const optim::GaLorePart& part : g.parts) {
        const auto names = optim::galore_part_tensors(s.name, part);
        out.push_back({names[0], part.moments});
        out.push_back({names[1], part.moments});
        if (part.low_rank) out.push_back({names[2], part.projector});
      }
    } else {
      out.push_back({"adam_m/" + s.name, s.shape});
      out.push_back({"adam_v/" + s.name, s.shape});
    }
  }
  return out;
}

// Collective over w: ", on rank R" with R the lowest rank for which `found` (ranks may hold
// replicated copies: the lowest that holds a non-finite one); empty with one rank.
std::string on_lowest_rank(comm::Comm& w, bool found) {
  if (w.size() == 1) return "";
  const int r = parallel::min_over_ranks(w, found ? w.rank() : w.size());
  return r < w.size() ? fmt::format(", on rank {}", r) : "";
}

// GaLore's state per parameter of a DataParallel's layout (null where it has none: AdamW).
std::vector<optim::GaLore::State*> galore_states(parallel::DataParallel& ddp) {
  std::vector<optim::GaLore::State*> out(ddp.layout().size(), nullptr);
  optim::GaLore* g = ddp.galore();
  if (!g) return out;
  for (size_t k = 0; k < g->states().size(); ++k) {
    const optim::FlatSegment& seg = g->segments()[k];  // (stage 0: the range is the whole buffer)
    const auto f = std::find_if(ddp.layout().begin(), ddp.layout().end(),
                                [&](const parallel::FlatParam& x) { return x.offset == seg.begin; });
    LOOM_CHECK(f != ddp.layout().end() && seg.end - seg.begin == f->numel,
               "galore: state of '{}' does not match a parameter of the layout", seg.name);
    out[size_t(f - ddp.layout().begin())] = &g->states()[k];
  }
  return out;
}

// A rank's part of a checkpoint from its data parallelism: its shard of the dp (x cp) group's flat
// layout, parameters and both moments (the ZeRO shard; under ZeRO-0, where every rank holds
// everything, the same split shares the writing); `skip` says which parameters another rank
// writes (a tensor whole on every tp rank: tp rank 0's; a pipeline's wte copy: the first stage's).
CheckpointPart data_parallel_part(parallel::DataParallel& ddp,
                                  const std::function<bool(const model::Parameter&)>& skip) {
  CheckpointPart out;
  out.optimizer_steps = ddp.optimizer_steps();
  const parallel::DataParallel::LocalState st = ddp.host_state();
  const std::vector<optim::GaLore::State*> galore = galore_states(ddp);
  const int64_t b = st.shard_begin, e = st.shard_end;
  for (size_t i = 0; i < ddp.layout().size(); ++i) {
    const parallel::FlatParam& f = ddp.layout()[i];
    const model::Parameter& p = *f.param;
    if (skip(p)) continue;
    const optim::GaLore::State* g = galore[i];
    if (g && g->shapes.low_rank) {
      // Every rank of the group holds it all (ZeRO stage 0): each writes its share of the elements.
      for (size_t j = 0; j < g->parts.size(); ++j) {
        const optim::GaLore::PartState& ps = g->parts[j];
        const auto names = optim::galore_part_tensors(p.global().name, g->shapes.parts[j]);
        const Tensor* tensors[3] = {&ps.exp_avg, &ps.exp_avg_sq, &ps.projector};
        for (int k = 0; k < 3; ++k) {
          if (names[size_t(k)].empty()) continue;
          const int64_t n = tensors[k]->numel(), r = ddp.rank(), w = ddp.ranks();
          const int64_t g0 = n * r / w, g1 = n * (r + 1) / w;
          if (g1 > g0) out.slices.push_back({names[size_t(k)], g0, g1 - g0, tensors[k]->f32() + g0});
        }
      }
    }
    const int64_t lo = std::max(b, f.offset), hi = std::min(e, f.offset + f.numel);
    if (lo >= hi) continue;
    const int64_t lb = lo - f.offset, le = hi - f.offset;
    add_slices(out.slices, "param/", p, lb, le, st.params + (lo - st.params_begin));
    if (g && g->shapes.low_rank) continue;
    add_slices(out.slices, "adam_m/", p, lb, le, g ? g->exp_avg.f32() + lb : st.exp_avg + (lo - st.opt_begin));
    add_slices(out.slices, "adam_v/", p, lb, le, g ? g->exp_avg_sq.f32() + lb : st.exp_avg_sq + (lo - st.opt_begin));
  }
  return out;
}

// The inverse: each rank reads what it holds, the parameters (all, or its ZeRO-3 shard) and its
// moments, by each parameter's global name (a pipeline's wte copy reads wte: both always take the
// same update, so their moments are wte's too).
// A pruned input embedding (mc.kept_tokens) reads its rows from a checkpoint of the whole
// vocabulary (the fine-tune's start) or of the same kept tokens (the trainer checks which).
void load_data_parallel(parallel::DataParallel& ddp, CheckpointReader& ckpt, int64_t optimizer_steps,
                        const model::GPTConfig& mc) {
  const parallel::DataParallel::LocalState st = ddp.host_state();
  const bool widen = mc.kept_tokens && ckpt.shape("param/wte.weight")[0] != mc.input_rows();
  auto read_part = [&](const char* kind, const model::Parameter& p, int64_t lb, int64_t le, float* data) {
    if (widen && !p.shard.tied_copy && p.global().name == "wte.weight") read_kept_rows(ckpt, kind, p, lb, le, data, *mc.kept_tokens);
    else read_slices(ckpt, kind, p, lb, le, data);
  };
  auto read = [&](const char* kind, int64_t b, int64_t e, float* base) {
    for (const parallel::FlatParam& f : ddp.layout()) {
      const int64_t lo = std::max(b, f.offset), hi = std::min(e, f.offset + f.numel);
      if (lo < hi) read_part(kind, *f.param, lo - f.offset, hi - f.offset, base + (lo - b));
    }
  };
  read("param/", st.params_begin, st.params_end, st.params);
  if (!ddp.galore()) {
    read("adam_m/", st.opt_begin, st.opt_end, st.exp_avg);
    read("adam_v/", st.opt_begin, st.opt_end, st.exp_avg_sq);
  } else {
    // A checkpoint at optimizer step 0 (`loom convert`'s, or another optimizer's before its first
    // step) has no GaLore state: it starts from zero, as a fresh run does (check_resume_checkpoint
    // refuses a later one).
    const std::vector<optim::GaLore::State*> galore = galore_states(ddp);
    for (size_t i = 0; i < ddp.layout().size(); ++i) {
      optim::GaLore::State* g = galore[i];
      if (!g) continue;
      const model::Parameter& p = *ddp.layout()[i].param;
      if (!g->shapes.low_rank) {
        for (const auto& [kind, t] : {std::pair<const char*, Tensor*>{"adam_m/", &g->exp_avg}, {"adam_v/", &g->exp_avg_sq}}) {
          if (!ckpt.has(kind + p.global().name)) t->zero_();
          else read_part(kind, p, 0, p.spec.numel(), t->f32());
        }
        continue;
      }
      for (size_t j = 0; j < g->parts.size(); ++j) {
        optim::GaLore::PartState& ps = g->parts[j];
        const auto names = optim::galore_part_tensors(p.global().name, g->shapes.parts[j]);
        Tensor* tensors[3] = {&ps.exp_avg, &ps.exp_avg_sq, &ps.projector};
        for (int k = 0; k < 3; ++k) {
          if (names[size_t(k)].empty()) continue;
          if (!ckpt.has(names[size_t(k)])) tensors[k]->zero_();
          else ckpt.read_into(names[size_t(k)], *tensors[k]);
        }
      }
    }
  }
  ddp.put_host_state();
  ddp.state_loaded(optimizer_steps);
}

// The CPU's engines (the loop runs whatever train/engine.h's interface offers), on the CPU or,
// given a device (make_mesh_engine), on its backend: the pool is then the device's, the batches'
// token ids in host memory, the MFU against the device's GEMM rate.
class CpuEngine : public Engine {
 public:
  CpuEngine(MemoryPool& pool, MemoryPool* host, DType matmul, DeviceMesh dev, parallel::MeshComms& comms)
      : pool_(dev.backend ? dev.backend->pool() : pool), host_(host), matmul_(matmul), dev_(std::move(dev)),
        tp_buffers_(device_group(comms["tp"])), cp_buffers_(device_group(comms["cp"])) {}
  // With bf16 matmuls the MFU is against the bf16 GEMM rate, measured now (f32: the larger of now
  // and the host's calibration).
  double gemm_peak(comm::Comm& world) override {
    if (dev_.backend) return job_gemm_peak(world, dev_.gemm_peak);
    if (matmul_ == DType::bf16)
      return job_gemm_peak(world, [] { return cpu::measure_bf16_gemm_peak_gflops(1024, 0.3) * 1e9; }, &peak_source_);
    return job_gemm_peak(world, {}, &peak_source_);
  }
  std::string peak_name() const override {
    if (dev_.backend) return dev_.peak_name + (world_size_ > 1 ? " (all ranks)" : "");
    return fmt::format("{}GEMM peak ({})", matmul_ == DType::bf16 ? "bf16 " : "", peak_source_);
  }
  MemoryPool& pool() override { return pool_; }
  MemoryPool* host_pool() override { return host_; }

 protected:
  // Where the batches' token ids are: the model's pool on the CPU, host memory for a device.
  MemoryPool& io_pool() { return dev_.backend ? *host_ : pool_; }
  // "cuda:0 NVIDIA ... | " before a device's description.
  std::string device_prefix() const { return dev_.backend ? dev_.device + " | " : ""; }
  // The model's groups over the mesh: on a device, tp and cp are communicators that take its memory
  // (tp_host and cp_host the host ones, for scalars).
  model::ParallelGroups groups(parallel::MeshComms& comms) const {
    return {.tp = tp_buffers_ ? tp_buffers_.get() : &comms["tp"],
            .cp = cp_buffers_ ? cp_buffers_.get() : &comms["cp"],
            .dp_cp = &comms.get({"dp", "cp"}),
            .tp_host = &comms["tp"],
            .cp_host = &comms["cp"]};
  }
  MemoryPool& pool_;
  MemoryPool* host_;
  DType matmul_;
  std::string peak_source_;
  DeviceMesh dev_;      // a device's (make_mesh_engine); empty on the CPU
  int world_size_ = 1;  // (set by the engine)

 private:
  // On a device, a communicator over `group`'s ranks whose collectives take the device's memory
  // (Backend::buffer_comm), where the group has several ranks; else null (the host group serves).
  std::unique_ptr<comm::Comm> device_group(comm::Comm& group) const {
    if (!dev_.backend || group.size() <= 1) return nullptr;
    return dev_.backend->buffer_comm(group.split(0, group.rank()), false);
  }
  std::unique_ptr<comm::Comm> tp_buffers_, cp_buffers_;  // a device's tp and cp groups for its memory
};

// Data parallelism over dp (ZeRO 0-3, offload, buckets reduced during backward), composed with
// tensor / sequence / context parallelism: model::GPT over this rank's tp and cp groups, and
// parallel::DataParallel over the dp x cp group (the cp ranks of a replica hold partial sums of
// its gradients, which the reduction adds; each rank scales its loss by 1 / dp, so the dp replicas
// average), with the gradient norm summed over tp.
// On a device (make_mesh_engine): the same over the device's backend, the tp group's collectives
// on a device communicator (Backend::buffer_comm), the tokens in host memory, samples drawn on a
// CPU copy of the rank's part of the model over the same host groups.
class ChainEngine : public CpuEngine {
 public:
  ChainEngine(const TrainConfig& cfg, const model::GPTConfig& mc, const optim::AdamWConfig& oc,
              parallel::MeshComms& comms, data::Loader& train, MemoryPool& pool, MemoryPool& host_pool, bool trace,
              DeviceMesh dev = {})
      : CpuEngine(pool, &host_pool, cfg.cpu_matmul(), std::move(dev), comms), cfg_(cfg), mc_(comms), train_(train),
        dp_(comms["dp"]), tp_(comms["tp"]), trace_(comms.world().rank(), trace),
        own_be_(dev_.backend ? nullptr : make_backend(Device::cpu, {.pool = &pool, .matmul = cfg.cpu_matmul()})),
        model_(mc, backend(), cfg.seed, {.groups = groups(comms), .sp = cfg.sp, .defer_parameters = true}),
        ddp_(model_, comms.get({"dp", "cp"}), oc, options(cfg, comms, host_pool, trace_, model_)) {
    world_size_ = comms.world().size();
    local_ = cfg.batch_size / dp_.size();
    mb_ = local_ / cfg.grad_accum;
    x_ = Tensor::empty({mb_, cfg.seq_len}, DType::i32, MemTag::workspace, io_pool());
    y_ = Tensor::empty({mb_, cfg.seq_len}, DType::i32, MemTag::workspace, io_pool());
    plan_recompute_for_run();
  }

  Backend& backend() const { return dev_.backend ? *dev_.backend : *own_be_; }

  // memory.recompute at the micro-batch shape, from the blocks' declarations; a plan over
  // memory.activation_budget is refused naming the fields.
  void plan_recompute_for_run() {
    const model::ChainMemory c = model_.chain_memory(mb_, cfg_.seq_len);
    const model::Recompute policy = model::recompute_from_name(cfg_.recompute, "memory.recompute");
    const model::RecomputePlan plan =
        model::plan_recompute(policy, c, cfg_.recompute_every, double(cfg_.activation_budget));
    const double without = model::plan_peak(model::RecomputePlan{int64_t(c.full.size()), {}, false}, c);
    model_.set_recompute(plan);
    const double peak = double(model_.activation_peak_bytes(mb_, cfg_.seq_len));
    // The rest of a step's need, before its first allocation: the activations' declared peak and
    // the backward and attention workspace on top of what the pool already holds.
    if (pool_.limit() > 0) {
      const int64_t held = pool_.total_current();
      const int64_t ws = model_.workspace_bytes(mb_, cfg_.seq_len, omp_get_max_threads());
      if (held + int64_t(peak) + ws > pool_.limit())
        throw Error(fmt::format("train.memory_limit: {} per rank, but this rank needs {}: it holds {} (parameters, "
                                "gradients, optimizer state) and a step at the micro-batch [{}, {}] adds activations {} "
                                "(memory.recompute = {}) and workspace {}; a layout that splits the model (tp, pp, "
                                "ZeRO-3), recomputation or a smaller micro-batch fits it",
                                format_bytes(pool_.limit()), format_bytes(held + int64_t(peak) + ws),
                                format_bytes(held), mb_, cfg_.seq_len, format_bytes(int64_t(peak)), cfg_.recompute,
                                format_bytes(ws)));
    }
    if (cfg_.activation_budget > 0 && peak > double(cfg_.activation_budget))
      throw Error(fmt::format("memory.activation_budget: {} per rank, but memory.recompute = {} needs {} of saved "
                              "activations at the micro-batch [{}, {}] (memory.recompute = optimal plans for the budget)",
                              format_bytes(int64_t(cfg_.activation_budget)), cfg_.recompute, format_bytes(int64_t(peak)), mb_,
                              cfg_.seq_len));
    if (policy == model::Recompute::none) return;
    const int64_t R = plan.recomputed_blocks(), L = int64_t(c.full.size());
    if (plan.selective) {
      note_ = fmt::format("recompute selective: every block computes its attention output again in backward | saved "
                          "activations per rank {} (without recomputation {})",
                          format_bytes(int64_t(peak)), format_bytes(int64_t(without)));
      return;
    }
    note_ = fmt::format("recompute {}: {} run forward again in backward ({} of {} blocks: about {:.0f}% more of their "
                        "work) | saved activations per rank {} (without recomputation {})",
                        cfg_.recompute, plan.describe(), R, L, L > 0 ? 100.0 * double(R) / (3.0 * double(L)) : 0.0,
                        format_bytes(int64_t(peak)), format_bytes(int64_t(without)));
  }

  std::vector<std::string> notes() const override {
    if (note_.empty()) return {};
    return {note_};
  }

  static parallel::DataParallelOptions options(const TrainConfig& cfg, parallel::MeshComms& comms,
                                               MemoryPool& host_pool, parallel::Trace& trace, model::GPT& model) {
    parallel::DataParallelOptions o;
    // ZeRO shards over the data-parallel group (dp x cp): over one rank there is nothing to shard,
    // and its buffers would only cost (the pipeline's stages do the same).
    o.zero = cfg.dp * cfg.cp > 1 ? int(cfg.zero) : 0;
    o.offload = cfg.offload;
    o.host_pool = &host_pool;
    o.bucket_bytes = std::max<int64_t>(1, int64_t(double(cfg.bucket_mb) * 1024 * 1024));
    o.prefetch = cfg.prefetch;
    o.trace = trace.enabled() ? &trace : nullptr;
    o.norm_group = &comms["tp"];
    if (model.parallel().tp() > 1 && model.backend().device() != Device::cpu)
      o.norm_buffers = model.parallel().tp_group();  // (the model's own device communicator)
    // A parameter whole on every tp rank counts in the norm on tp rank 0.
    for (const model::Parameter* p : model.parameters()) o.in_norm.push_back(p->shard.split || comms.coord("tp") == 0);
    return o;
  }

  StepOut step(int64_t step, float lr) override {
    const int dp = dp_.size();
    ddp_.zero_grad();
    double loss = 0;
    // Rank r of dp reads samples [r local, (r + 1) local) of every step's global batch, in
    // grad_accum micro-batches; the tp and cp ranks of a replica read the same ones.
    for (int64_t micro = 0; micro < cfg_.grad_accum; ++micro) {
      train_.train_batch(step, cfg_.batch_size, dp_.rank() * local_ + micro * mb_, mb_, x_.i32(), y_.i32());
      model::ForwardOptions fo;
      fo.fuse_backward = true;
      fo.dloss_scale = 1.0f / float(cfg_.grad_accum * dp);
      ddp_.set_last_micro(micro + 1 == cfg_.grad_accum);
      loss += model_.forward(x_, y_, fo);
      model_.backward();
    }
    StepOut out;
    out.loss = sum_over_ranks(dp_, loss / double(cfg_.grad_accum)) / double(dp);
    // A non-finite loss or gradient norm (the same on every rank) skips the update.
    const optim::StepStats st = ddp_.step(lr, !std::isfinite(out.loss));
    out.grad_norm = st.grad_norm;
    out.skipped = st.skipped;
    if (st.skipped) out.nonfinite = locate_nonfinite();
    return out;
  }

  // Collective over the world: where the first non-finite value of the step is, the same answer
  // on every rank: a weight (in parameter order), else a block's forward output (in chain order),
  // else a gradient (in parameter order); each rank looks at what it holds, and the earliest
  // finding of any rank wins.
  std::string locate_nonfinite() {
    constexpr int kStride = 1 << 20;
    int code = 3 * kStride;
    if (int i = ddp_.first_nonfinite(false); i >= 0) {
      code = i;
    } else {
      const auto chain = model_.chain();
      for (size_t c = 0; c + 1 < chain.size() && code == 3 * kStride; ++c) {
        const Tensor& out = c == 0 ? model_.embedding().out() : model_.block(int64_t(c) - 1).out();
        if (out.defined() && has_nonfinite(out)) code = kStride + int(c);
      }
      if (code == 3 * kStride)
        if (int i = ddp_.first_nonfinite(true); i >= 0) code = 2 * kStride + i;
    }
    const int mine = code;
    code = parallel::min_over_ranks(mc_.world(), code);
    const std::string on = on_lowest_rank(mc_.world(), mine == code);
    const auto& ps = model_.parameters();
    if (code < kStride) return fmt::format("the weights of {}{}", ps.at(size_t(code))->spec.name, on);
    if (code < 2 * kStride)
      return fmt::format("the forward output of {}{}", model_.chain().at(size_t(code - kStride))->name(), on);
    if (code < 3 * kStride) return fmt::format("the gradient of {}{}", ps.at(size_t(code - 2 * kStride))->spec.name, on);
    return "no weight, forward output or gradient (the loss alone)";
  }

  // Whether a block's output holds a non-finite value (a device's looked at on the host).
  bool has_nonfinite(const Tensor& t) const {
    if (t.device() == Device::cpu && t.dtype() == DType::f32) return first_nonfinite(t.f32(), t.numel()) >= 0;
    std::vector<float> host(size_t(t.numel()));
    backend().download(host.data(), t.raw(), t.dtype(), t.numel());
    return first_nonfinite(host.data(), int64_t(host.size())) >= 0;
  }

  bool poison(const std::string& kind) override {
    if (kind == "overflow") return false;  // fp16's loss scaling: the CUDA engine's
    if (kind == "nan") ddp_.poison_gradients();
    else ddp_.poison_parameters();
    return true;
  }

  // Each dp rank evaluates its share of every validation batch; the mean over dp is the mean of
  // the single-device batches.
  double evaluate(data::Loader& val, int64_t n, int64_t val_mb) override {
    const int dp = dp_.size();
    const int64_t vl = val_mb / dp, T = cfg_.seq_len;
    Tensor vx = Tensor::empty({vl, T}, DType::i32, MemTag::workspace, io_pool());
    Tensor vy = Tensor::empty({vl, T}, DType::i32, MemTag::workspace, io_pool());
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      val.val_batch(i, val_mb, dp_.rank() * vl, vl, vx.i32(), vy.i32());
      sum += model_.forward(vx, vy);
    }
    model_.release_activations();
    return sum_over_ranks(dp_, sum) / double(n * dp);
  }

  CheckpointPart checkpoint_part() override {
    model_.release_activations();  // the write's buffers take their place, not add to them
    const int tpr = tp_.rank();
    return data_parallel_part(ddp_, [tpr](const model::Parameter& p) { return !p.shard.split && tpr != 0; });
  }

  void load(CheckpointReader& ckpt, int64_t optimizer_steps) override {
    load_data_parallel(ddp_, ckpt, optimizer_steps, model_.config());
  }

  // On the model itself (collectively under ZeRO-3 and model parallelism); on a device, on a CPU
  // copy of the rank's part of it over the same groups (collectively too).
  std::vector<int32_t> sample(const std::vector<int32_t>& prompt, const SampleOptions& opt) override {
    if (!dev_.backend) return sample_recompute(model_, prompt, opt);
    if (!cpu_model_) {
      cpu_pool_ = std::make_unique<MemoryPool>(fmt::format("cpu:sample:{}", mc_.world().rank()));
      cpu_model_ = std::make_unique<model::GPT>(model_.config(), *cpu_pool_, cfg_.seed,
                                                model::ModelLayout{.groups = {&mc_["tp"], &mc_["cp"]}, .sp = cfg_.sp});
    }
    // The rank's weights: its parameters' values, or under ZeRO-3 (where each holds a shard) the
    // replica's flat parameters gathered into host memory piece by piece (collective over the
    // data-parallel group; the moments stay where they are), in layout order; with the master
    // weights in the host pool (offload), from there.
    const auto& dst = cpu_model_->parameters();
    const auto& lay = ddp_.layout();
    LOOM_CHECK(lay.size() == dst.size(), "sample: {} parameters in the layout, {} in the host model", lay.size(),
               dst.size());
    Tensor flat;
    if (cfg_.zero == 3 || ddp_.masters_on_host()) {
      flat = Tensor::empty({ddp_.flat_elements()}, DType::f32, MemTag::workspace, *cpu_pool_);
      ddp_.download_params(flat.f32());
    }
    for (size_t i = 0; i < lay.size(); ++i) {
      const model::Parameter& p = *lay[i].param;
      Tensor& to = dst[i]->value_full;
      LOOM_CHECK(p.spec.name == dst[i]->spec.name && lay[i].alloc == to.numel(),
                 "sample: parameter '{}' ({} elements) on the device, '{}' ({}) on the host", p.spec.name, lay[i].alloc,
                 dst[i]->spec.name, to.numel());
      if (flat.defined()) std::memcpy(to.f32(), flat.f32() + lay[i].offset, size_t(to.numel()) * sizeof(float));
      else backend().download(to.f32(), p.value_full.f32(), DType::f32, to.numel());
    }
    return sample_recompute(*cpu_model_, prompt, opt);
  }

  std::string describe() const override {
    const model::ChainParallel& P = model_.parallel();
    std::string s = device_prefix() + fmt::format("dp {}", dp_.size());
    if (!P.single() || P.sp()) s += fmt::format(" x tp {}{} x cp {}", P.tp(), P.sp() ? " + sp" : "", P.cp());
    return s + fmt::format(" | ZeRO {}{}", cfg_.zero, cfg_.offload ? " + offload" : "");
  }

  std::string summary(TrainResult& res) override {
    const auto& cs = ddp_.comm_stats();
    res.reduce_busy_s = cs.reduce_busy_s;
    res.reduce_exposed_s = cs.reduce_wait_s;
    res.gather_s = cs.gather_s;
    if (mc_.get({"dp", "cp"}).size() == 1) return "";
    return fmt::format("gradient reduction {:.3f} s, {:.3f} s exposed ({:.0f}% hidden behind backward) | parameter "
                       "gathers {:.3f} s",
                       cs.reduce_busy_s, cs.reduce_wait_s,
                       cs.reduce_busy_s > 0 ? 100.0 * cs.hidden_s() / cs.reduce_busy_s : 0.0, cs.gather_s);
  }

  void write_trace(comm::Comm& world, const std::string& path) override {
    const std::string json = parallel::gather_trace(world, trace_);
    if (world.rank() == 0) write_file_atomically(path, json, {.make_parent = true});
  }

 private:
  const TrainConfig& cfg_;
  parallel::MeshComms& mc_;
  data::Loader& train_;
  comm::Comm& dp_;
  comm::Comm& tp_;
  parallel::Trace trace_;
  std::unique_ptr<Backend> own_be_;         // the CPU's
  model::GPT model_;
  parallel::DataParallel ddp_;
  std::string note_;                         // the recompute plan, said at the start
  int64_t local_ = 0, mb_ = 0;
  Tensor x_, y_;  // i32 [mb, T]
  std::unique_ptr<MemoryPool> cpu_pool_;     // a device's samples: a CPU copy of the model
  std::unique_ptr<model::GPT> cpu_model_;
};

// The mesh engine on a device: the host pool it keeps beside the device's (base-from-member: made
// before the engine that takes it).
struct HostPoolOf {
  // (In the device's host memory where it has its own: DeviceMesh::host_allocator.)
  HostPoolOf(int rank, Allocator* a) : host(fmt::format("host:{}", rank), a ? a : &cpu_allocator()) {}
  MemoryPool host;
  // The device's own hook on the host pool (DeviceMesh::use_host_pool), then the device.
  DeviceMesh with_host(DeviceMesh dev) {
    if (dev.use_host_pool) dev.use_host_pool(host);
    return dev;
  }
};

class DeviceChainEngine final : private HostPoolOf, public ChainEngine {
 public:
  DeviceChainEngine(const EngineArgs& a, DeviceMesh dev)
      : HostPoolOf(a.comms.world().rank(), dev.host_allocator),
        ChainEngine(a.cfg, a.model, adamw_config(a.cfg), a.comms, a.train, host, host, !a.opt.trace_path.empty(),
                    with_host(std::move(dev))) {}
};

// Pipeline parallel (PipelineExecutor) with data parallelism through its dp communicator, and
// tensor / sequence / context parallelism inside each stage.
// On a device (make_mesh_engine): the stages on the device's backend (PipelineExecutor's
// ExecutorOptions::backend), the tp group's collectives on a device communicator, the tokens in
// host memory.
class PipelineEngine : public CpuEngine {
 public:
  PipelineEngine(const TrainConfig& cfg, const model::GPTConfig& mc, const optim::AdamWConfig& oc,
                 parallel::MeshComms& comms, data::Loader& train, MemoryPool& pool, MemoryPool& host_pool,
                 DeviceMesh dev = {})
      : CpuEngine(pool, &host_pool, cfg.cpu_matmul(), std::move(dev), comms), cfg_(cfg), mc_(comms), model_cfg_(mc),
        train_(train), pp_(comms["pp"]), dp_(comms["dp"]), tp_(comms["tp"]),
        exec_(mc, options(cfg, oc, mc.n_layer, dev_.backend.get()), comms["pp"],
              comms["dp"].size() > 1 ? &comms["dp"] : nullptr, dev_.backend ? dev_.backend->pool() : pool,
              groups(comms), &host_pool) {
    world_size_ = comms.world().size();
    local_ = cfg.batch_size / dp_.size();
    n_layer_ = mc.n_layer;
    x_ = Tensor::empty({local_, cfg.seq_len}, DType::i32, MemTag::workspace, io_pool());
    y_ = Tensor::empty({local_, cfg.seq_len}, DType::i32, MemTag::workspace, io_pool());
    if (cfg.recompute == "optimal") {
      // Every stage's plan, for the run's header (collective over the pipeline).
      const float mine[3] = {float(exec_.recomputed_blocks()), float(exec_.planned_blocks()),
                             float(exec_.planned_activation_peak() / (1 << 20))};
      std::vector<float> all(size_t(3 * pp_.size()));
      pp_.all_gather(mine, all.data(), int64_t(all.size()), DType::f32);
      note_ = fmt::format("recompute optimal for memory.activation_budget {} per rank, counting the micro-batches each "
                          "stage keeps in flight:",
                          format_bytes(int64_t(cfg.activation_budget)));
      for (int r = 0; r < pp_.size(); ++r)
        note_ += fmt::format(" stage {} recomputes {:.0f} of {:.0f} blocks (saved activations up to {:.1f} MiB){}", r,
                             all[size_t(3 * r)], all[size_t(3 * r + 1)], all[size_t(3 * r + 2)],
                             r + 1 < pp_.size() ? ";" : "");
    }
  }

  std::vector<std::string> notes() const override {
    if (note_.empty()) return {};
    return {note_};
  }

  static pipe::ExecutorOptions options(const TrainConfig& cfg, const optim::AdamWConfig& oc, int64_t n_layer,
                                       Backend* device) {
    pipe::ExecutorOptions o;
    o.backend = device;
    o.schedule.kind = pipe::parse_kind(cfg.schedule, "parallel.schedule");
    o.schedule.stages = int(cfg.pp);
    o.schedule.virtual_stages = o.schedule.kind == pipe::Kind::interleaved ? int(cfg.virtual_stages) : 1;
    o.schedule.micro_batches = int(cfg.grad_accum);
    o.tp = int(cfg.tp);
    o.cp = int(cfg.cp);
    o.sp = cfg.sp;
    o.zero_stage = int(cfg.zero);
    o.offload = cfg.offload;
    o.bucket_bytes = std::max<int64_t>(1, int64_t(double(cfg.bucket_mb) * 1024 * 1024));
    o.prefetch = cfg.prefetch;
    o.adamw = oc;
    o.seed = cfg.seed;
    o.seq_len = cfg.seq_len;
    o.recompute = model::recompute_from_name(cfg.recompute, "memory.recompute");
    o.recompute_every = cfg.recompute_every;
    o.activation_budget = int64_t(cfg.activation_budget);
    o.micro_batch = cfg.batch_size / cfg.dp / cfg.grad_accum;
    o.matmul = cfg.cpu_matmul();
    if (!cfg.stage_layers.empty())
      o.cuts = pipe::cuts_from_stage_layers(cfg.stage_layers, n_layer, "parallel.stage_layers");
    return o;
  }

  StepOut step(int64_t step, float lr) override {
    train_.train_batch(step, cfg_.batch_size, dp_.rank() * local_, local_, x_.i32(), y_.i32());
    pipe::StepResult r = exec_.step(x_, y_, lr);
    // Where this stage waited: the span of its computes less their time (the bubble, and
    // transfers not hidden behind compute).
    double busy = 0, span = 0;
    for (const pipe::TraceEvent& e : exec_.trace()) busy += e.end - e.start, span = std::max(span, e.end);
    idle_s_ += span - busy;
    span_s_ += span;
    StepOut out{double(r.loss), r.grad_norm, r.skipped, ""};
    if (r.skipped) out.nonfinite = locate_nonfinite();
    return out;
  }

  // Collective over the world: the first non-finite weight, else gradient, in the single device's
  // parameter order, the same answer on every rank (each rank looks at what it holds of its
  // stage's parameters; the stages' activations are gone after the flush, so forward outputs are
  // not looked at).
  std::string locate_nonfinite() {
    constexpr int kStride = 1 << 20;
    std::map<std::string, int> order;
    const std::vector<model::ParamSpec> specs = model::gpt_param_specs(model_cfg_);
    for (size_t i = 0; i < specs.size(); ++i) order[specs[i].name] = int(i);
    parallel::DataParallel& ddp = exec_.data_parallel();
    const auto& lay = ddp.layout();
    int code = 2 * kStride;
    if (int i = ddp.first_nonfinite(false); i >= 0) code = order.at(lay.at(size_t(i)).param->spec.name);
    else if (int g = ddp.first_nonfinite(true); g >= 0) code = kStride + order.at(lay.at(size_t(g)).param->spec.name);
    const int mine = code;
    code = parallel::min_over_ranks(mc_.world(), code);
    const std::string on = on_lowest_rank(mc_.world(), mine == code);
    if (code < kStride) return fmt::format("the weights of {}{}", specs.at(size_t(code)).name, on);
    if (code < 2 * kStride) return fmt::format("the gradient of {}{}", specs.at(size_t(code - kStride)).name, on);
    return "no weight or gradient (the loss alone)";
  }

  // On the mesh itself: groups of m validation batches go through the pipeline's forwards
  // together, micro-batch j of a group holding this replica's rows of batch i + j (a last group
  // short of m repeats its last batch, whose loss is not counted), so every batch's mean loss is
  // the single device's.
  double evaluate(data::Loader& val, int64_t n, int64_t val_mb) override {
    const int64_t m = cfg_.grad_accum, vl = val_mb / dp_.size(), T = cfg_.seq_len;
    Tensor vx = Tensor::empty({m * vl, T}, DType::i32, MemTag::workspace, io_pool());
    Tensor vy = Tensor::empty({m * vl, T}, DType::i32, MemTag::workspace, io_pool());
    double sum = 0;
    for (int64_t i = 0; i < n; i += m) {
      for (int64_t j = 0; j < m; ++j)
        val.val_batch(std::min(i + j, n - 1), val_mb, dp_.rank() * vl, vl, vx.i32() + j * vl * T,
                      vy.i32() + j * vl * T);
      const std::vector<double> l = exec_.evaluate(vx, vy);
      for (int64_t j = 0; j < m && i + j < n; ++j) sum += l[size_t(j)];
    }
    return sum / double(n);
  }

  // Each rank writes its shard of its stage's flat layout (a last stage's wte copy left to the
  // first stage).
  CheckpointPart checkpoint_part() override {
    const int tpr = tp_.rank();
    return data_parallel_part(exec_.data_parallel(), [tpr](const model::Parameter& p) {
      return p.shard.tied_copy || (!p.shard.split && tpr != 0);
    });
  }

  void load(CheckpointReader& ckpt, int64_t optimizer_steps) override {
    load_data_parallel(exec_.data_parallel(), ckpt, optimizer_steps, model_cfg_);
  }

  // Through the stages: each context forward as one micro-batch, in the sequence units of the
  // stages' cp and sp.
  std::vector<int32_t> sample(const std::vector<int32_t>& prompt, const SampleOptions& opt) override {
    auto logits = [&](const std::vector<int32_t>& ctx) {
      int64_t position = 0;
      const Tensor t = padded_context(ctx, model_cfg_.block_size, exec_.parallel().sequence_unit(), &position);
      return exec_.last_logits(t, position);
    };
    return sample_with(logits, model_cfg_.block_size, model_cfg_.vocab_size, prompt, opt);
  }

  std::string describe() const override {
    const auto& sp = exec_.schedule().spec;
    const std::string blocks = fmt::format("{}", fmt::join(pipe::stage_layers_from_cuts(exec_.cuts(), n_layer_), ","));
    return device_prefix() + fmt::format("pp {} ({}, m = {}{}, blocks {}) x dp {}{}{}", sp.stages, pipe::kind_name(sp.kind),
                       sp.micro_batches, sp.virtual_stages > 1 ? fmt::format(", v = {}", sp.virtual_stages) : "",
                       blocks, dp_.size(),
                       exec_.data_parallel().zero() > 0 || cfg_.offload
                           ? fmt::format(" (ZeRO {}{})", exec_.data_parallel().zero(), cfg_.offload ? " + offload" : "")
                           : "",
                       cfg_.tp > 1 || cfg_.cp > 1 || cfg_.sp
                           ? fmt::format(" x tp {}{} x cp {}", cfg_.tp, cfg_.sp ? " + sp" : "", cfg_.cp)
                           : "");
  }

  void write_trace(comm::Comm& world, const std::string& path) override;

  std::string summary(TrainResult& res) override {
    (void)res;
    const int r = pp_.rank();
    return fmt::format("pipeline idle {:.3f} s ({:.1f}% of the steps; the schedule's bubble {:.1f}%) on stage {}",
                       idle_s_, span_s_ > 0 ? 100.0 * idle_s_ / span_s_ : 0.0,
                       100.0 * exec_.checked().idle_fraction(r), r);
  }

  bool poison(const std::string& kind) override {
    if (kind == "overflow") return false;  // fp16's loss scaling: the CUDA engine's
    if (kind == "nan") exec_.data_parallel().poison_gradients();
    else exec_.data_parallel().poison_parameters();
    return true;
  }

 private:
  const TrainConfig& cfg_;
  parallel::MeshComms& mc_;
  model::GPTConfig model_cfg_;
  data::Loader& train_;
  comm::Comm& pp_;
  comm::Comm& dp_;
  comm::Comm& tp_;
  pipe::PipelineExecutor exec_;
  std::string note_;  // the optimal recompute plans, said at the start
  int64_t local_ = 0, n_layer_ = 0;
  double idle_s_ = 0, span_s_ = 0;  // over the run's steps: this stage's waits, and the span of its computes
  Tensor x_, y_;  // i32 [B / dp, T]
};

// Every rank's pipeline trace events on rank 0 (rank order; the others get an empty list): each
// event travels as six doubles (op, micro-batch, chunk, start, end, the rank thread's CPU seconds)
// in a gather over `world`, so it works whether the ranks are threads or processes.
std::vector<std::vector<pipe::TraceEvent>> gather_traces(comm::Comm& world, const std::vector<pipe::TraceEvent>& mine) {
  constexpr int64_t kFields = 6;
  const int n = world.size();
  std::vector<double> send;
  for (const pipe::TraceEvent& e : mine)
    for (double v : {double(int(e.op)), double(e.mb), double(e.chunk), e.start, e.end, e.cpu}) send.push_back(v);
  // Counts and values travel as pairs of u32 words (one 64-bit value each).
  int64_t my_count = int64_t(mine.size());
  std::vector<int64_t> counts(static_cast<size_t>(n));
  world.all_gather(&my_count, counts.data(), 2 * int64_t(n), DType::u32);
  std::vector<int64_t> words(static_cast<size_t>(n));
  int64_t total = 0;
  for (int r = 0; r < n; ++r) total += words[size_t(r)] = 2 * kFields * counts[size_t(r)];
  std::vector<double> all(static_cast<size_t>(total / 2));
  world.all_gather_v(send.data(), all.data(), words, DType::u32);
  std::vector<std::vector<pipe::TraceEvent>> out;
  if (world.rank() != 0) return out;
  out.resize(size_t(n));
  const double* v = all.data();
  for (int r = 0; r < n; ++r)
    for (int64_t k = 0; k < counts[size_t(r)]; ++k, v += kFields)
      out[size_t(r)].push_back({pipe::Op(int(v[0])), int(v[1]), int(v[2]), v[3], v[4], v[5]});
  return out;
}

void PipelineEngine::write_trace(comm::Comm& world, const std::string& path) {
  auto traces = gather_traces(world, exec_.trace());  // collective
  if (world.rank() == 0) pipe::write_chrome_trace(path, traces);
}

// train.device = "emu": the mesh engine on the emulated device (kernels/emu/backend.h) for every
// layout, one backend per rank in the compute dtype of train.precision (bf16 or f32).
std::unique_ptr<Engine> make_emu_engine(const EngineArgs& a) {
  const DType compute = a.cfg.run_precision() == "f32" ? DType::f32 : DType::bf16;
  DeviceMesh d;
  auto emu = std::make_unique<emu::EmuBackend>(BackendOptions{.compute = compute});
  emu::EmuBackend* be = emu.get();
  d.backend = std::move(emu);
  // Every allocation of the rank's device memory is checked against the limit before it is made.
  d.backend->pool().set_limit(int64_t(a.cfg.memory_limit), "train.memory_limit");
  d.gemm_peak = [] { return cpu::measure_gemm_peak_gflops(512, 0.1) * 1e9; };
  d.peak_name = "f32 GEMM peak (the host's)";
  d.device = fmt::format("emu ({} on an emulated device)", dtype_name(compute));
  // The widening scratch is the emulator's, not the device's: in the rank's host pool, so the
  // device's pool (and the limit on it) holds what a GPU's would.
  d.use_host_pool = [be](MemoryPool& host) { be->set_scratch_pool(host); };
  return make_mesh_engine(a, std::move(d));
}

std::map<std::string, EngineFactory>& engines() {
  static std::map<std::string, EngineFactory> m{{"emu", &make_emu_engine}};
  return m;
}

class DevicePipelineEngine final : private HostPoolOf, public PipelineEngine {
 public:
  DevicePipelineEngine(const EngineArgs& a, DeviceMesh dev)
      : HostPoolOf(a.comms.world().rank(), dev.host_allocator),
        PipelineEngine(a.cfg, a.model, adamw_config(a.cfg), a.comms, a.train, host, host, with_host(std::move(dev))) {}
};

}  // namespace

std::unique_ptr<Engine> make_mesh_engine(const EngineArgs& a, DeviceMesh device) {
  LOOM_CHECK(device.backend, "make_mesh_engine: no backend");
  if (a.cfg.pp > 1) return std::make_unique<DevicePipelineEngine>(a, std::move(device));
  return std::make_unique<DeviceChainEngine>(a, std::move(device));
}

void register_engine(const std::string& device, EngineFactory factory) { engines()[device] = factory; }
bool engine_available(const std::string& device) {
  if (device == "cpu") return true;
  if (device == "cuda" && !engines().count(device)) load_cuda_plugin();  // registers it
  return engines().count(device) > 0;
}

namespace {

// Everything one rank does; rank 0 prints and writes files. Every rank runs the same collectives
// in the same order.
TrainResult train_mesh_rank(const TrainConfig& cfg, const TrainOptions& opt, parallel::MeshComms& comms,
                            const FaultInjection& fault) {
  comm::Comm& world = comms.world();
  const int rank = world.rank(), ranks = world.size();
  const bool lead = rank == 0;
  auto say = [&](const std::string& s) {
    if (lead && !opt.quiet) std::printf("%s\n", s.c_str()), std::fflush(stdout);
  };
  // What the run does otherwise than asked (a damaged checkpoint passed over, validation that
  // cannot run): on stderr, under --quiet too.
  auto warn = [&](const std::string& s) {
    if (lead) std::fprintf(stderr, "loom: warning: %s\n", s.c_str()), std::fflush(stderr);
  };
  // (Before anything of the chosen layout is built: a failure to build it follows what was chosen.)
  if (!opt.plan_note.empty()) say(opt.plan_note);

  // Each rank verifies its share of the shards (a corpus is read once per job, not once per rank).
  RunData run_data = open_run_data(cfg, opt.config_path, data::VerifyShare{rank, ranks});
  check_ranks_agree(world, cfg, run_data,  // before any other collective
                    {{"--resume", opt.resume ? "given" : "not given"},
                     {"--overwrite", opt.overwrite ? "given" : "not given"},
                     {"--new-hparams", opt.new_hparams ? "given" : "not given"},
                     {"--trace", opt.trace_path.empty() ? "not given" : "given"}});
  const std::string vocabulary = run_data.tokenizer ? run_data.tokenizer->fingerprint() : "";
  data::Loader& train = run_data.train;
  std::unique_ptr<data::Loader>& val = run_data.val;
  const model::GPTConfig mc = run_data.model;
  if (cfg.device == "cuda") cfg.validate_cuda_vocabulary(mc, opt.config_path.empty() ? "config" : opt.config_path);

  MemoryPool pool(fmt::format("cpu:{}", rank)), host_pool(fmt::format("host:{}", rank));
  // Every allocation of the rank's model pool is checked against the limit before it is made.
  pool.set_limit(int64_t(cfg.memory_limit), "train.memory_limit");
  const optim::AdamWConfig oc = adamw_config(cfg);
  std::unique_ptr<Engine> engine;
  const std::string where = opt.config_path.empty() ? "config" : opt.config_path;
  if (cfg.device != "cpu") {
    engine_available(cfg.device);  // (loads the CUDA plugin where it is not linked in)
    auto it = engines().find(cfg.device);
    LOOM_CHECK(it != engines().end(), "{}: train.device = \"{}\": this build has no trainer for it", where, cfg.device);
    engine = it->second({cfg, opt, where, mc, comms, train});
  } else if (cfg.pp > 1) {
    engine = std::make_unique<PipelineEngine>(cfg, mc, oc, comms, train, pool, host_pool);
  } else {
    engine = std::make_unique<ChainEngine>(cfg, mc, oc, comms, train, pool, host_pool, !opt.trace_path.empty());
  }
  if (mc.kept_tokens)
    say(fmt::format("model.prune_embedding: the input embedding keeps the rows of the {} of {} tokens the data uses "
                    "({:.1f}%: {:.2f} of {:.2f} MiB of weights)",
                    mc.input_rows(), mc.vocab_size, 100.0 * double(mc.input_rows()) / double(mc.vocab_size),
                    double(mc.input_rows() * mc.n_embd * 4) / (1 << 20),
                    double(mc.padded_vocab() * mc.n_embd * 4) / (1 << 20)));
  for (const std::string& n : engine->notes()) say(n);
  if (cfg.pp > 1 && cfg.grad_accum < cfg.pp)
    say(fmt::format("parallel.pp = {} with train.grad_accum = {}: the pipeline has {} micro-batch{} for {} stages, so "
                    "its stages mostly wait for one another (train.grad_accum sets the micro-batches; several times "
                    "parallel.pp overlaps them)",
                    cfg.pp, cfg.grad_accum, cfg.grad_accum, cfg.grad_accum > 1 ? "es" : "", cfg.pp));
  if (cfg.warmup_steps >= cfg.decay_end() && cfg.steps > 0 && cfg.lr_schedule != "constant")
    say(fmt::format("optim.warmup_steps = {} is not below the decay's end ({} = {}): no decay{}", cfg.warmup_steps,
                    cfg.decay_steps > 0 ? "optim.decay_steps" : "train.steps", cfg.decay_end(),
                    cfg.warmup_steps >= cfg.steps
                        ? fmt::format(", and the rate rises the whole run without reaching optim.lr {} (update {})",
                                      cfg.lr, cfg.warmup_steps)
                        : fmt::format(": optim.lr {} after the warm-up", cfg.lr)));
  if (cfg.optimizer != "galore") {  // (GaLore's fields set for AdamW: a forgotten optim.name?)
    const TrainConfig defaults;
    std::vector<std::string> unused;
    if (cfg.galore_rank != defaults.galore_rank) unused.push_back(fmt::format("optim.galore_rank = {}", cfg.galore_rank));
    if (cfg.galore_update_every != defaults.galore_update_every)
      unused.push_back(fmt::format("optim.galore_update_every = {}", cfg.galore_update_every));
    if (cfg.galore_scale != defaults.galore_scale)
      unused.push_back(fmt::format("optim.galore_scale = {}", cfg.galore_scale));
    if (!unused.empty())
      warn(fmt::format("{} set, but optim.name = {}: {} only with optim.name = galore", fmt::join(unused, ", "),
                       cfg.optimizer, unused.size() > 1 ? "they apply" : "it applies"));
  }
  LrSchedule sched{cfg.lr, cfg.final_lr(), cfg.warmup_steps, cfg.decay_end(), cfg.lr_schedule};

  TrainResult res;
  fs::path out_dir(cfg.out_dir);
  if (lead) {
    std::error_code ec;
    fs::create_directories(out_dir, ec);
    if (ec)
      throw Error(fmt::format("{}: train.out_dir = {}: cannot create: {}", opt.config_path.empty() ? "config" : opt.config_path,
                              cfg.out_dir, ec.message()));
  }
  // The writing rank holds the run directory for the whole run (a second run into it is refused).
  std::unique_ptr<RunDirLock> dir_lock = lead ? std::make_unique<RunDirLock>(out_dir.string()) : nullptr;
  // --overwrite: the old run goes under the lock, once the data, the config and every rank's flags
  // have been accepted (a run refused before this point changes nothing).
  if (lead && opt.overwrite) remove_run(cfg.out_dir);
  const std::string metrics_path = (out_dir / "metrics.jsonl").string();
  int64_t start_step = 0, start_updates = 0;  // steps done, and updates made (skipped steps make none)
  bool pruned_start = false;  // a pruned embedding's starting point was read
  if (opt.resume) {
    // Every rank reads just the elements it holds, from whichever ranks' files hold them: like
    // Megatron, this assumes train.out_dir is on a filesystem every rank sees. Rank 0's step is
    // broadcast so a rank that found another checkpoint (or none) is an error, not a silent
    // divergence.
    std::vector<std::string> notes;
    const std::string ckpt = resume_checkpoint(cfg.out_dir, &notes, &world);  // collective
    for (const std::string& n : notes) warn("resume: " + n);
    CheckpointMeta meta;
    if (!ckpt.empty()) {
      meta = read_checkpoint_meta(ckpt);
      check_resume_checkpoint(ckpt, meta, cfg, mc, vocabulary);
      // The schedule, AdamW's settings and the batch's shape as the checkpoint's run had them
      // (Megatron-LM's check of its scheduler), unless --new-hparams (a converted checkpoint has
      // no run's config).
      if (!meta.config_toml.empty()) {
        const std::string manifest = (fs::path(ckpt) / "manifest.json").string();
        const std::vector<std::string> changed =
            changed_on_resume(cfg, meta.config_toml, manifest, meta.optimizer_steps, meta.step);
        if (!changed.empty() && !opt.new_hparams)
          throw Error(fmt::format(
              "{}: this run would train otherwise than the run it resumes: {}. --resume continues that run: give its "
              "values (to train on past its decay at its final rate, --optim.decay_steps at its decay's last step), "
              "or pass --new-hparams to change them from step {} (nothing was changed)",
              manifest, fmt::join(changed, "; "), meta.step));
        for (const std::string& c : changed) warn(fmt::format("resume: --new-hparams: from step {}, {}", meta.step, c));
      }
    }
    int64_t step0 = ckpt.empty() ? -1 : meta.step;
    const int64_t mine = step0;
    world.broadcast(&step0, 2, DType::u32, 0);
    LOOM_CHECK(step0 == mine,
               "resume: rank {} found {} in {} but rank 0 {} (train.out_dir must be on a filesystem every rank "
               "shares)",
               rank, mine < 0 ? "no checkpoint" : fmt::format("the checkpoint of step {}", mine), cfg.out_dir,
               step0 < 0 ? "none" : fmt::format("the one of step {}", step0));
    if (ckpt.empty()) {
      // (Said on stderr: a mistyped train.out_dir starts a whole new run.)
      warn(fmt::format("resume: no checkpoint in {}, starting from step 0", cfg.out_dir));
    } else {
      CheckpointReader reader(ckpt, /*verify=*/false);  // verified whole by resume_checkpoint
      if (mc.kept_tokens) prepare_pruned_embedding(reader, ckpt, mc, cfg, lead, pool), pruned_start = true;
      engine->load(reader, meta.optimizer_steps);
      if (meta.loss_scale > 0) engine->load_loss_scale(meta.loss_scale, meta.loss_scale_clean);
      start_step = meta.step;
      start_updates = meta.optimizer_steps;
      // The resumed steps draw the samples after those the run drew (its steps at its batch in an
      // older checkpoint), so a changed train.batch_size neither replays nor skips any.
      const int64_t consumed = meta.consumed_samples >= 0 ? meta.consumed_samples
                               : meta.config_toml.empty()
                                   ? meta.step * cfg.batch_size
                                   : meta.step * checkpoint_batch_size(meta.config_toml,
                                                                       (fs::path(ckpt) / "manifest.json").string());
      train.resume_at(start_step, cfg.batch_size, consumed);
      if (lead) truncate_metrics(metrics_path, start_step);
      say(fmt::format("resumed from {} (step {})", ckpt, start_step));
      if (start_step == cfg.steps)
        warn(fmt::format("resume: {} is at train.steps = {} already: no step to train (raise train.steps, with "
                         "--optim.decay_steps {} to keep the schedule)",
                         ckpt, cfg.steps, cfg.decay_end()));
    }
  }
  if (mc.kept_tokens && !pruned_start)
    throw Error(fmt::format("{}: model.prune_embedding fine-tunes a checkpoint: put one in train.out_dir {} (`loom "
                            "convert`, or a run's) and pass --resume (with --new-hparams where the fine-tune's "
                            "schedule or batch differs from that run's)",
                            where, cfg.out_dir));
  if (lead && start_step == 0 && fs::exists(metrics_path)) fs::remove(metrics_path);
  world.barrier();  // rank 0 has prepared the output directory

  std::unique_ptr<data::Tokenizer> tok = lead ? std::move(run_data.tokenizer) : nullptr;

  // Validation: train.eval_batches batches of train.batch_size sequences, the first of the split
  // (fewer where it is shorter), each evaluated as train.grad_accum micro-batches of val_mb: the
  // same sequences for any grad_accum and any layout. (A split shorter than one batch has nothing
  // to evaluate.)
  const int64_t T = cfg.seq_len, val_mb = cfg.batch_size / cfg.grad_accum;
  const int64_t val_n = val ? std::min(cfg.eval_batches, val->val_batches(cfg.batch_size)) : 0;
  const bool has_val = val_n > 0;
  int64_t num_parameters = 0;
  for (const model::ParamSpec& s : model::gpt_param_specs(mc)) num_parameters += s.numel();
  const std::string precision = cfg.run_precision();
  const int threads = omp_get_max_threads();
  say(fmt::format("model {} | {:.2f}M parameters | {} ({}, {} rank{}) | {} thread{} per rank | precision {}{}",
                  mc.str(), double(num_parameters) / 1e6, engine->describe(), world.backend(), ranks,
                  ranks == 1 ? "" : "s", threads, threads == 1 ? "" : "s", precision,
                  cfg.device == "cpu" && precision == "bf16" ? " (matmuls; f32 accumulation)" : ""));
  const double peak = engine->gemm_peak(world);
  res.last_val_loss = NAN;
  const UnigramBaseline unigram = lead ? unigram_loss(train, val.get(), mc.vocab_size) : UnigramBaseline{NAN};
  res.unigram_val_loss = unigram.loss;
  const bool unigram_sampled =
      unigram.counted < train.total_tokens() || (val && unigram.scored < val->total_tokens());
  // Validation asked for that cannot run: said in the data line, and as a warning under --quiet.
  const std::string no_val =
      has_val || cfg.eval_every == 0 ? ""
      : val ? fmt::format("less than one validation batch of {} sequences: no validation, train.eval_every = {} unused",
                          cfg.batch_size, cfg.eval_every)
            : fmt::format("no val_*.bin: no validation, train.eval_every = {} unused", cfg.eval_every);
  const std::string no_val_note =
      !no_val.empty() ? " (" + no_val + ")"
      : has_val && cfg.eval_every > 0
          ? fmt::format(" (validation: its first {} x {} sequences{})", val_n, cfg.batch_size,
                        val_n < cfg.eval_batches ? fmt::format(", all it holds of train.eval_batches = {}", cfg.eval_batches)
                                                 : "")
          : "";
  say(fmt::format("data {} | train {} tokens{} | unigram baseline loss {:.4f}{} | {} {}", cfg.data_dir,
                  train.total_tokens(),
                  val ? fmt::format(", val {} tokens{}", val->total_tokens(), no_val_note) : no_val_note,
                  res.unigram_val_loss,
                  unigram_sampled ? fmt::format(" (of {:.3g}M tokens spread over each split)", double(kUnigramTokens) / 1e6)
                                  : "",
                  engine->peak_name(),
                  peak >= 1e12 ? fmt::format("{:.1f} TFLOP/s", peak / 1e12) : fmt::format("{:.1f} GFLOP/s", peak / 1e9)));
  if (opt.quiet && !no_val.empty()) warn(cfg.data_dir + ": " + no_val);

  RunLog log(cfg, metrics_path, start_step, lead, opt.quiet, mc.flops_per_token(T), peak, res.unigram_val_loss);

  auto evaluate = [&]() -> double {
    if (!val) return NAN;
    if (val_n == 0) return NAN;
    return engine->evaluate(*val, val_n * cfg.grad_accum, val_mb);
  };
  // Collective: every rank samples from rank 0's prompt on the mesh itself (its model::GPT under
  // data, tensor, sequence and context parallelism; a pipeline's stages): no rank assembles the
  // weights.
  auto sample = [&](int64_t step) -> std::string {
    if (cfg.sample_tokens == 0) return "";
    const std::vector<int32_t> prompt = shared_sample_prompt(world, cfg, tok.get(), train, val.get());
    SampleOptions so = sample_options(cfg, step);
    so.allowed = mc.kept_tokens;  // a pruned embedding reads back its kept tokens only
    so.vocab_limit = int64_t(train.vocab_size());  // (what the data's tokenizer decodes)
    return sample_as_text(prompt, engine->sample(prompt, so), tok.get());
  };
  // Collective: every rank writes its part and no rank starts the next step before the checkpoint
  // is committed (or every rank has learnt that it was not), so a rank that fails in that step
  // cannot cut the write short and lose the checkpoint.
  const std::vector<TensorInfo> ckpt_tensors = checkpoint_tensors(mc, oc);
  auto checkpoint = [&](int64_t step) {
    const auto t0 = std::chrono::steady_clock::now();
    CheckpointPart part = engine->checkpoint_part();
    if (rank == 0 && mc.kept_tokens) {
      part.storage.emplace_back(mc.kept_tokens->begin(), mc.kept_tokens->end());  // ids < 2^24: exact in f32
      part.slices.push_back({"vocab/kept", 0, mc.input_rows(), part.storage.back().data()});
    }
    CheckpointMeta cm =
        checkpoint_meta(cfg, mc, step, part.optimizer_steps, vocabulary, train.consumed(step, cfg.batch_size));
    cm.loss_scale = part.loss_scale;
    cm.loss_scale_clean = part.loss_scale_clean;
    save_checkpoint(world, out_dir.string(), cm, ckpt_tensors, part.slices, cfg.keep_checkpoints);
    ++res.checkpoints;
    res.last_checkpoint_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };

  MemoryPool& peaks = engine->pool();
  MemoryPool* host_peaks = engine->host_pool();
  peaks.reset_peaks();
  if (host_peaks) host_peaks->reset_peaks();
  RunHooks hooks;
  hooks.step = [&](int64_t step, float lr) { return engine->step(step, lr); };
  hooks.poison = [&](const std::string& kind) {
    LOOM_CHECK(engine->poison(kind), "LOOM_FAULT_INJECT kind={}: the {} engine has no such aid{}", kind,
               engine->describe(),
               kind == "overflow" ? " (an f16 overflow needs the loss scaling of train.precision fp16 on CUDA)" : "");
  };
  hooks.evaluate = evaluate;
  hooks.sample = sample;
  hooks.checkpoint = checkpoint;
  hooks.stop = [&]() { return agree_stop(world, cfg.time_limit_min, opt.started); };
  run_steps(cfg, log, sched, fault, rank, ranks, start_step, start_updates, has_val, hooks, res);
  for (int t = 0; t < kNumMemTags; ++t) {
    res.peak_bytes[size_t(t)] = peaks.peak(MemTag(t));
    res.host_peak_bytes[size_t(t)] = host_peaks ? host_peaks->peak(MemTag(t)) : 0;
  }
  // Every rank's peaks by tag (a collective): printed by rank 0 when the mesh has several ranks,
  // and written to OUT_DIR/memory.json with each rank's mesh coordinates, so a layout's split of
  // the memory can be checked rank by rank (the planner's predictions are compared against it).
  constexpr int kFields = 2 * kNumMemTags + 1;  // device pool peaks by tag, host pool's, total peak
  std::vector<uint64_t> mine(kFields), all(size_t(kFields) * size_t(ranks));
  for (int t = 0; t < kNumMemTags; ++t) {
    mine[size_t(t)] = uint64_t(res.peak_bytes[size_t(t)]);
    mine[size_t(kNumMemTags + t)] = uint64_t(res.host_peak_bytes[size_t(t)]);
  }
  mine[size_t(2 * kNumMemTags)] = uint64_t(peaks.total_peak());
  world.all_gather(mine.data(), all.data(), 2 * int64_t(all.size()), DType::u32);  // 64-bit values as 32-bit pairs
  if (lead) {
    nlohmann::json j;
    j["ranks"] = nlohmann::json::array();
    for (int r = 0; r < ranks; ++r) {
      const uint64_t* v = all.data() + size_t(r) * kFields;
      nlohmann::json peak, host, coords;
      std::string tags;
      for (int t = 0; t < kNumMemTags; ++t) {
        const std::string name(mem_tag_name(MemTag(t)));
        peak[name] = v[t];
        if (v[kNumMemTags + t] > 0) host[name] = v[kNumMemTags + t];
        tags += fmt::format("{} {} | ", name, format_bytes(int64_t(v[t])));
      }
      for (const char* d : {"pp", "dp", "cp", "tp"}) coords[d] = comms.mesh().coord(r, d);
      nlohmann::json row{{"rank", r}, {"coords", coords}, {"peak_bytes", peak}, {"all_tags_peak_bytes", v[2 * kNumMemTags]}};
      if (!host.empty()) row["host_peak_bytes"] = host;
      j["ranks"].push_back(row);
      if (ranks > 1)
        say(fmt::format("memory of rank {} (pp {} dp {} cp {} tp {}, peak): {}all tags {}", r, coords["pp"].get<int>(),
                        coords["dp"].get<int>(), coords["cp"].get<int>(), coords["tp"].get<int>(), tags,
                        format_bytes(int64_t(v[2 * kNumMemTags]))));
    }
    write_file_atomically((out_dir / "memory.json").string(), j.dump(1) + "\n");
  }
  const std::string comm_line = engine->summary(res);
  // Beside the pool's accounting, what the process really held: its peak resident set (every rank
  // of the process when ranks are threads).
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const int64_t rss = int64_t(usage.ru_maxrss) * 1024;
  say(fmt::format("memory of rank 0 (peak): params {} | grads {} | optimizer {}{} | activations {} | all tags {} | "
                  "process peak RSS {} ({}){}",
                  format_bytes(res.peak_bytes[size_t(MemTag::params)]), format_bytes(res.peak_bytes[size_t(MemTag::grads)]),
                  format_bytes(res.peak_bytes[size_t(MemTag::optimizer)]),
                  cfg.offload ? fmt::format(" (host: optimizer {})", format_bytes(res.host_peak_bytes[size_t(MemTag::optimizer)])) : "",
                  format_bytes(res.peak_bytes[size_t(MemTag::activations)]), format_bytes(peaks.total_peak()),
                  format_bytes(rss), cfg.comm == "threads" && ranks > 1 ? fmt::format("all {} ranks", ranks) : "rank 0",
                  comm_line.empty() ? "" : " | " + comm_line));
  if (res.checkpoints > 0) {
    int64_t bytes = 0;
    for (const TensorInfo& t : ckpt_tensors) bytes += shape_numel(t.shape) * int64_t(sizeof(float));
    say(fmt::format("checkpoints: {} written{}, the last ({}) in {:.2f} s", res.checkpoints,
                    ranks > 1 ? fmt::format(" by {} ranks in parallel", ranks) : "", format_bytes(bytes),
                    res.last_checkpoint_s));
  }
  if (res.stopped != 0) {
    // Said under --quiet too. No end-of-run sample: a stop asked for by a signal may have little
    // time left.
    const int64_t latest = res.stop_checkpoint >= 0 ? res.stop_checkpoint : start_step > 0 ? start_step : -1;
    warn(fmt::format("{}: stopped after step {} of {}{}", stop_reason_name(res.stopped), res.steps_done, cfg.steps,
                     latest < 0 ? ", before any checkpoint: nothing to resume from"
                     : latest == res.steps_done
                         ? fmt::format(", with its checkpoint; go on with --resume")
                         : fmt::format(" (its last steps were not finite: no checkpoint of them); --resume goes on "
                                       "from step {}",
                                       latest)));
  } else {
    res.last_sample = sample(cfg.steps);
    if (!res.last_sample.empty()) say(fmt::format("--- sample ---\n{}\n---", res.last_sample));
  }
  log.finish((out_dir / "loss.png").string(),
             fmt::format("loom: {} on {}{}", mc.name, cfg.data_dir, cfg.device == "cpu" ? "" : " (" + cfg.device + ")"));
  if (!opt.trace_path.empty()) {  // after loss.png: a trace that cannot be written loses nothing else
    engine->write_trace(world, opt.trace_path);  // collective
    say(fmt::format("wrote trace {} (every rank)", opt.trace_path));
  }
  return res;
}

// train_mesh_rank over the mesh of cfg on `world`. on_fail(rank, what) runs before the communicators
// are destroyed when the rank throws (threads: the world is marked failed; mpi: the job is aborted
// naming the rank), so no other rank waits for the communicator's timeout; what else the rank
// held is only memory. `rank` is this one, or for a RankError the rank it names.
TrainResult train_rank(const TrainConfig& cfg, const TrainOptions& opt, comm::Comm& world, const FaultInjection& fault,
                       const std::function<void(int, const std::string&)>& on_fail) {
  std::unique_ptr<parallel::MeshComms> comms;
  try {
    comms = std::make_unique<parallel::MeshComms>(
        parallel::Mesh::standard(int(cfg.pp), int(cfg.dp), int(cfg.cp), int(cfg.tp)), world);
    return train_mesh_rank(cfg, opt, *comms, fault);
  } catch (const std::exception& e) {
    const auto* found = dynamic_cast<const RankError*>(&e);
    on_fail(found ? found->rank() : world.rank(), e.what());
    throw;
  }
}

}  // namespace

TrainResult run_training(const TrainConfig& cfg, const TrainOptions& options) {
  TrainOptions opt = options;
  if (opt.started == std::chrono::steady_clock::time_point{}) opt.started = std::chrono::steady_clock::now();
  // Signals stop the run between two steps, with a checkpoint (train/stop.h), for its whole life.
  const StopSignals stop_signals;
  const std::string where = opt.config_path.empty() ? "config" : opt.config_path;
  LOOM_CHECK(cfg.device == "cpu" || cfg.device == "cuda" || cfg.device == "emu",
             "{}: train.device: '{}' is not cpu, cuda or emu", where,
             cfg.device);
  if (cfg.device == "cuda") {
    cfg.validate_cuda(where);  // throws naming the field, and in a build without CUDA
    if (!engine_available("cuda")) {
      std::string why = "it was linked without loom's CUDA trainer";
      load_cuda_plugin(&why);
      throw Error(fmt::format("{}: train.device = \"cuda\": this program has no CUDA trainer: {}", where, why));
    }
    LOOM_CHECK(opt.trace_path.empty(), "--trace: train.device = \"cuda\" writes no trace");
  }
  if (cfg.cp > 1 && cfg.seq_len % (2 * cfg.cp) != 0)
    throw Error(fmt::format("{}: data.seq_len = {} must be divisible by 2 x parallel.cp = {} (each rank takes two "
                            "chunks of every sequence)",
                            cfg.origin({"data.seq_len", "parallel.cp"}, where), cfg.seq_len, 2 * cfg.cp));
  if (cfg.tp > 1 && cfg.n_head > 0 && cfg.n_head % cfg.tp != 0)
    throw Error(fmt::format("{}: model.n_head = {} is not divisible by parallel.tp = {}",
                            cfg.origin({"model.n_head", "parallel.tp"}, where), cfg.n_head, cfg.tp));
  // The outputs a run writes are checked before it starts, the trace's too, which it writes at its
  // end: a run of hours must not end in "cannot write" (each file is still written whole or not at
  // all, core/file.h). Nothing is created yet: a run refused later leaves no folder behind.
  {
    std::error_code ec;
    if (fs::exists(cfg.out_dir, ec) && !fs::is_directory(cfg.out_dir, ec))
      throw Error(fmt::format("{}: train.out_dir = {}: exists and is not a directory", where, cfg.out_dir));
    try {
      check_output_path((fs::path(cfg.out_dir) / "metrics.jsonl").string());
    } catch (const Error& e) {
      throw Error(fmt::format("{}: train.out_dir = {}: {}", where, cfg.out_dir, e.what()));
    }
    if (!opt.trace_path.empty()) check_output_path(opt.trace_path, "--trace");
  }
  const int world = int(cfg.pp * cfg.dp * cfg.cp * cfg.tp);
  const comm::CommOptions co = comm_options(cfg);
  const FaultInjection fault = FaultInjection::from_env(world);
  if (cfg.comm == "mpi" || cfg.comm == "nccl")  // one process per mesh rank (Mesh::standard order)
    return run_mpi_rank(cfg, where, world,
                        world == int(cfg.dp)
                            ? fmt::format("parallel.dp is {}", world)
                            : fmt::format("parallel.pp x parallel.dp x parallel.cp x parallel.tp = {} x {} x {} x {} = {}",
                                          cfg.pp, cfg.dp, cfg.cp, cfg.tp, world),
                        co, [&](comm::Comm& w, std::function<void(int, const std::string&)> on_fail) {
                          return train_rank(cfg, opt, w, fault, on_fail);
                        });
  // Ranks as threads: each gets its share of the cores (at least one).
  const int total_threads = cfg.threads > 0 ? int(cfg.threads) : omp_get_max_threads();
  const int per_rank = std::max(1, total_threads / world);
  if (world == 1) {
    set_omp_threads(per_rank);
    comm::ThreadWorld one(1, co);
    auto c = one.comm(0);
    return train_rank(cfg, opt, *c, fault, [](int, const std::string&) {});
  }
  comm::ThreadWorld tw(world, co);
  std::vector<TrainResult> results(static_cast<size_t>(world));
  comm::run_rank_threads(
      tw,
      [&](int r) {
        try {
          auto c = tw.comm(r);
          set_omp_threads(per_rank);
          results[size_t(r)] =
              train_rank(cfg, opt, *c, fault, [&](int who, const std::string& what) { tw.fail(who, what); });
        } catch (const std::exception& e) {
          tw.fail(r, e.what());
        } catch (...) {
          tw.fail(r, "unknown exception");
        }
      },
      fmt::format("{}: {} ranks", where, world));
  if (const int failed = tw.failed_rank(); failed >= 0)
    throw Error(fmt::format("rank {} of {} failed: {}", failed, world, tw.failure()));
  return results[0];
}

}  // namespace loom::train

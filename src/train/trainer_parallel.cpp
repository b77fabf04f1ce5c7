#include "train/trainer_parallel.h"
#include "train/run_util.h"

#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>

#include <fmt/ranges.h>

#include "comm/threads.h"
#include "core/error.h"
#include "data/loader.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "model/gpt.h"
#include "model/parallel.h"
#include "optim/adamw.h"
#include "parallel/data/replica_optimizer.h"
#include "parallel/data/flat_layout.h"
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

// The single-device model on rank 0 into which every rank's parameters (and AdamW moments) are
// gathered: for checkpoints, validation of a pipeline and text samples.
struct FullModel {
  MemoryPool pool{"cpu:full"};
  std::unique_ptr<model::GPT> gpt;
  std::vector<Tensor> exp_avg, exp_avg_sq;  // f32, each parameter's shape (allocated on first use)
  std::map<std::string, size_t> index;      // parameter name -> position in gpt->parameters()
  int64_t optimizer_steps = 0;

  FullModel(const model::GPTConfig& mc, uint64_t seed) : gpt(std::make_unique<model::GPT>(mc, pool, seed)) {
    const auto& ps = gpt->parameters();
    for (size_t i = 0; i < ps.size(); ++i) index[ps[i]->spec.name] = i;
  }
  model::Parameter& param(const std::string& name, int64_t numel) {
    auto it = index.find(name);
    LOOM_CHECK(it != index.end(), "gather: the single-device model has no parameter '{}'", name);
    model::Parameter& p = *gpt->parameters()[it->second];
    LOOM_CHECK(p.spec.numel() == numel, "gather: parameter '{}' has {} elements, the single-device model {}", name,
               numel, p.spec.numel());
    return p;
  }
  void ensure_moments() {
    if (!exp_avg.empty()) return;
    for (model::Parameter* p : gpt->parameters()) {
      exp_avg.push_back(Tensor::zeros(p->spec.shape, DType::f32, MemTag::optimizer, pool));
      exp_avg_sq.push_back(Tensor::zeros(p->spec.shape, DType::f32, MemTag::optimizer, pool));
    }
  }
  // Full tensors in the checkpoint names of the single-device trainer.
  std::vector<NamedTensor> named() {
    ensure_moments();
    std::vector<NamedTensor> out;
    const auto& ps = gpt->parameters();
    for (size_t i = 0; i < ps.size(); ++i) {
      out.push_back({"param/" + ps[i]->spec.name, ps[i]->value});
      out.push_back({"adam_m/" + ps[i]->spec.name, exp_avg[i]});
      out.push_back({"adam_v/" + ps[i]->spec.name, exp_avg_sq[i]});
    }
    return out;
  }
};

struct StepOut {
  double loss = 0, grad_norm = 0;
};

// The full tensors of a checkpoint in the single-device names ("param/<name>", "adam_m/<name>",
// "adam_v/<name>"), read one at a time; errors name the file and the tensor.
class CheckpointTensors {
 public:
  explicit CheckpointTensors(const std::string& ckpt) : reader_((fs::path(ckpt) / "state.safetensors").string()) {}
  // Tensor kind/name, f32 of the given shape (checked), into a buffer kept until the next call.
  const std::vector<float>& read(const std::string& kind, const std::string& name, const Shape& shape) {
    buf_.resize(size_t(shape_numel(shape)));
    reader_.read_into(kind + "/" + name, buf_.data(), buf_.size() * sizeof(float), DType::f32, shape);
    return buf_;
  }
  // Tensor kind/name into t (f32, t's shape checked).
  void read_into(const std::string& kind, const std::string& name, const Tensor& t) {
    reader_.read_into(kind + "/" + name, t.raw(), t.nbytes(), t.dtype(), t.shape());
  }

 private:
  SafetensorsReader reader_;
  std::vector<float> buf_;
};

// A parameter's part of a full checkpoint tensor into dst f32 [n] (the rest, a vocabulary split's
// zero padding, zeroed).
void read_shard(CheckpointTensors& ckpt, const char* kind, const model::Parameter& p, float* dst, int64_t n) {
  const model::ParamSpec g = p.global();
  const std::vector<float>& full = ckpt.read(kind, g.name, g.shape);
  std::fill(dst, dst + n, 0.0f);
  for (const model::ShardSegment& s : p.segments())
    std::memcpy(dst + s.local, full.data() + s.global, size_t(s.n) * sizeof(float));
}

// The full tensor of parameter p on every rank of tp from each rank's part `src` (a sum over tp of
// zero-filled buffers into which every rank wrote its part, a whole tensor by tp rank 0 only, so
// values arrive unchanged) into out.
void assemble(comm::Comm& tp, const model::Parameter& p, const float* src, std::vector<float>& out) {
  out.assign(size_t(p.global().numel()), 0.0f);
  if (p.shard.split || tp.rank() == 0)
    for (const model::ShardSegment& sg : p.segments())
      std::memcpy(out.data() + sg.global, src + sg.local, size_t(sg.n) * sizeof(float));
  tp.all_reduce(out.data(), int64_t(out.size()), DType::f32);
}

// One rank's model, optimizer and step under either layout.
class Engine {
 public:
  virtual ~Engine() = default;
  // One optimizer step on training batch `step` at learning rate lr; the mean loss of the global
  // batch (every rank).
  virtual StepOut step(int64_t step, float lr) = 0;
  // Mean validation loss of n single-device batches of val_mb sequences (valid on rank 0).
  virtual double evaluate(data::Loader& val, int64_t n, int64_t val_mb, FullModel* full) = 0;
  // Collective: rank 0's `full` receives every parameter (and the moments when with_moments).
  virtual void gather(FullModel* full, bool with_moments) = 0;
  // The inverse, on every rank: this rank's part of every parameter and of both AdamW moments
  // from the checkpoint's full tensors, and the optimizer's step count (not collective).
  virtual void load(CheckpointTensors& ckpt, int64_t optimizer_steps) = 0;
  virtual std::string describe() const = 0;
  virtual std::vector<pipe::TraceEvent> trace() const { return {}; }
};

// Tensor / sequence / context parallel (model::GPT over the tp and cp groups) with data
// parallelism over dp: gradients
// reduced over dp x cp by parallel::ReplicaOptimizer, with full AdamW moments on every rank
// (parallel.zero = 0) or ZeRO-1's moments sharded over dp x cp.
class TensorEngine : public Engine {
 public:
  TensorEngine(const TrainConfig& cfg, const model::GPTConfig& mc, const optim::AdamWConfig& oc,
               parallel::MeshComms& comms, data::Loader& train, MemoryPool& pool)
      : cfg_(cfg), mc_(comms), train_(train), pool_(pool), dp_(comms["dp"]), tp_(comms["tp"]),
        dpcp_(comms.get({"dp", "cp"})),
        model_(mc, pool, cfg.seed, {.groups = {&comms["tp"], &comms["cp"]}, .sp = cfg.sp}) {
    // Gradients reduced over dp x cp in one collective: the cp ranks of a replica hold partial
    // sums (added), the dp replicas average. Under ZeRO-1 the moments are sharded over that
    // group, like Megatron's distributed optimizer. A parameter replicated over tp counts in the
    // norm on tp rank 0.
    parallel::ReplicaOptimizer::Options ro;
    ro.zero_stage = int(cfg.zero);
    ro.replicas = dp_.size();
    for (const model::Parameter* p : model_.parameters()) ro.in_norm.push_back(p->shard.split || tp_.rank() == 0);
    opt_ = std::make_unique<parallel::ReplicaOptimizer>(model_.parameters(), &dpcp_, ro, oc, pool);
    const int64_t dp = dp_.size();
    local_ = cfg.batch_size / dp;
    mb_ = local_ / cfg.grad_accum;
    x_ = Tensor::empty({mb_, cfg.seq_len}, DType::i32, MemTag::workspace, pool);
    y_ = Tensor::empty({mb_, cfg.seq_len}, DType::i32, MemTag::workspace, pool);
  }

  StepOut step(int64_t step, float lr) override {
    const int dpr = dp_.rank(), dp = dp_.size();
    model_.zero_grad();
    double loss = 0;
    for (int64_t micro = 0; micro < cfg_.grad_accum; ++micro) {
      train_.train_batch(step, cfg_.batch_size, dpr * local_ + micro * mb_, mb_, x_.i32(), y_.i32());
      model::ForwardOptions fo;
      fo.fuse_backward = true;
      fo.dloss_scale = 1.0f / float(cfg_.grad_accum);
      loss += model_.forward(x_, y_, fo);
      model_.backward();
    }
    model_.finish_gradients();
    StepOut out;
    out.loss = sum_over_ranks(dp_, loss / double(cfg_.grad_accum)) / double(dp);
    out.grad_norm = std::sqrt(sum_over_ranks(tp_, opt_->reduce_gradients()));
    opt_->step(out.grad_norm, lr);
    return out;
  }

  double evaluate(data::Loader& val, int64_t n, int64_t val_mb, FullModel*) override {
    const int dp = dp_.size();
    const int64_t vl = val_mb / dp, T = cfg_.seq_len;
    Tensor vx = Tensor::empty({vl, T}, DType::i32, MemTag::workspace, pool_);
    Tensor vy = Tensor::empty({vl, T}, DType::i32, MemTag::workspace, pool_);
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      val.val_batch(i, val_mb, dp_.rank() * vl, vl, vx.i32(), vy.i32());
      sum += model_.forward(vx, vy);
    }
    model_.release_activations();
    return sum_over_ranks(dp_, sum) / double(n * dp);
  }

  // Only the tp group of the replica with dp = cp = 0 takes part (its rank 0 is world rank 0):
  // each full tensor is assembled by a sum over tp of zero-filled buffers into which every rank
  // wrote its shard (a replicated tensor by tp rank 0 only), so values arrive unchanged. Under
  // ZeRO-1 every rank first gathers each shard's moments over dp x cp.
  void gather(FullModel* full, bool with_moments) override {
    const bool lead_replica = mc_.coord("dp") == 0 && mc_.coord("cp") == 0;
    if (!lead_replica && !(opt_->sharded() && with_moments)) return;
    if (full && with_moments) full->ensure_moments();
    const auto& ps = model_.parameters();
    std::vector<float> buf, m, v;
    for (size_t i = 0; i < ps.size(); ++i) {
      const model::Parameter& p = *ps[i];
      const float *mi = nullptr, *vi = nullptr;  // this part's full moments
      if (with_moments) {
        m.resize(size_t(p.spec.numel()));
        v.resize(size_t(p.spec.numel()));
        opt_->gather_moments(i, m.data(), v.data());  // collective over dp x cp under ZeRO-1
        mi = m.data(), vi = v.data();
      }
      if (!lead_replica) continue;
      const int64_t n = p.global().numel();
      model::Parameter* dst = full ? &full->param(p.spec.name, n) : nullptr;
      const size_t di = full ? full->index.at(p.spec.name) : 0;
      auto one = [&](const float* src, float* out) {
        assemble(tp_, p, src, buf);
        if (out) std::memcpy(out, buf.data(), size_t(n) * sizeof(float));
      };
      one(p.value.f32(), dst ? dst->value.f32() : nullptr);
      if (with_moments) {
        one(mi, full ? full->exp_avg[di].f32() : nullptr);
        one(vi, full ? full->exp_avg_sq[di].f32() : nullptr);
      }
    }
    if (full) full->optimizer_steps = opt_->steps_taken();
  }

  // Each shard (and its moments) takes its segments of the full tensor; the rest of a shard is
  // the zero padding of a vocabulary split, which stays zero in training.
  void load(CheckpointTensors& ckpt, int64_t optimizer_steps) override {
    const auto& ps = model_.parameters();
    const auto& opt_params = opt_->parameters();
    std::vector<float> m, v;
    for (size_t i = 0; i < ps.size(); ++i) {
      model::Parameter& p = *ps[i];
      LOOM_CHECK(opt_params[i] == &p, "load: the optimizer's parameter {} is not '{}'", i, p.spec.name);
      const int64_t n = p.spec.numel();
      m.resize(size_t(n));
      v.resize(size_t(n));
      read_shard(ckpt, "param", p, p.value.f32(), p.value.numel());
      read_shard(ckpt, "adam_m", p, m.data(), n);
      read_shard(ckpt, "adam_v", p, v.data(), n);
      opt_->load_moments(i, m.data(), v.data());  // under ZeRO-1 this rank keeps its dp x cp part
    }
    opt_->set_steps_taken(optimizer_steps);
  }

  std::string describe() const override {
    const model::ChainParallel& P = model_.parallel();
    return fmt::format("tp {}{} x cp {} x dp {}{}", P.tp(), P.sp() ? " + sp" : "", P.cp(), dp_.size(),
                       opt_->sharded() ? " (ZeRO-1)" : "");
  }

 private:
  const TrainConfig& cfg_;
  parallel::MeshComms& mc_;
  data::Loader& train_;
  MemoryPool& pool_;
  comm::Comm& dp_;
  comm::Comm& tp_;
  comm::Comm& dpcp_;  // the data-parallel reduction's group
  model::GPT model_;
  std::unique_ptr<parallel::ReplicaOptimizer> opt_;
  int64_t local_ = 0, mb_ = 0;
  Tensor x_, y_;  // i32 [mb, T]
};

// Pipeline parallel (PipelineExecutor) with data parallelism through its dp communicator, and
// tensor / sequence / context parallelism inside each stage.
class PipelineEngine : public Engine {
 public:
  PipelineEngine(const TrainConfig& cfg, const model::GPTConfig& mc, const optim::AdamWConfig& oc,
                 parallel::MeshComms& comms, data::Loader& train, MemoryPool& pool)
      : cfg_(cfg), mc_(comms), train_(train), pp_(comms["pp"]), dp_(comms["dp"]), tp_(comms["tp"]),
        exec_(mc, options(cfg, oc, mc.n_layer), comms["pp"], comms["dp"].size() > 1 ? &comms["dp"] : nullptr, pool,
              {&comms["tp"], &comms["cp"], &comms.get({"dp", "cp"})}) {
    local_ = cfg.batch_size / dp_.size();
    n_layer_ = mc.n_layer;
    x_ = Tensor::empty({local_, cfg.seq_len}, DType::i32, MemTag::workspace, pool);
    y_ = Tensor::empty({local_, cfg.seq_len}, DType::i32, MemTag::workspace, pool);
  }

  static pipe::ExecutorOptions options(const TrainConfig& cfg, const optim::AdamWConfig& oc, int64_t n_layer) {
    pipe::ExecutorOptions o;
    o.schedule.kind = pipe::parse_kind(cfg.schedule, "parallel.schedule");
    o.schedule.stages = int(cfg.pp);
    o.schedule.virtual_stages = o.schedule.kind == pipe::Kind::interleaved ? int(cfg.virtual_stages) : 1;
    o.schedule.micro_batches = int(cfg.grad_accum);
    o.tp = int(cfg.tp);
    o.cp = int(cfg.cp);
    o.sp = cfg.sp;
    o.zero_stage = int(cfg.zero);
    o.adamw = oc;
    o.seed = cfg.seed;
    o.seq_len = cfg.seq_len;
    if (!cfg.stage_layers.empty())
      o.cuts = pipe::cuts_from_stage_layers(cfg.stage_layers, n_layer, "parallel.stage_layers");
    return o;
  }

  StepOut step(int64_t step, float lr) override {
    train_.train_batch(step, cfg_.batch_size, dp_.rank() * local_, local_, x_.i32(), y_.i32());
    pipe::StepResult r = exec_.step(x_, y_, lr);
    return {double(r.loss), r.grad_norm};
  }

  // Rank 0 evaluates the gathered single-device model (the executor has no forward-only pass).
  double evaluate(data::Loader& val, int64_t n, int64_t val_mb, FullModel* full) override {
    gather(full, false);
    if (!full) return NAN;
    const int64_t T = cfg_.seq_len;
    Tensor vx = Tensor::empty({val_mb, T}, DType::i32, MemTag::workspace, full->pool);
    Tensor vy = Tensor::empty({val_mb, T}, DType::i32, MemTag::workspace, full->pool);
    double sum = 0;
    for (int64_t i = 0; i < n; ++i) {
      val.val_batch(i, val_mb, 0, val_mb, vx.i32(), vy.i32());
      sum += full->gpt->forward(vx, vy);
    }
    full->gpt->release_activations();
    return sum / double(n);
  }

  // The pipeline of the replica with dp = cp = 0 takes part. Under tp each stage first assembles
  // its full tensors over the tp group (a sum of zero-filled buffers into which every rank wrote
  // its shard, a replicated tensor by tp rank 0 only); then tp rank 0's pipeline (world rank 0's)
  // moves them: pipeline rank k > 0 sends, for each of its parameters (the last stage's copy of a
  // tied wte skipped), its name, size and tensors to pipeline rank 0.
  void gather(FullModel* full, bool with_moments) override {
    parallel::ReplicaOptimizer& opt = exec_.optimizer();
    // Under ZeRO-1 every rank of the stage's dp x cp group first takes part in gathering the
    // moments.
    const bool lead_replica = mc_.coord("dp") == 0 && mc_.coord("cp") == 0;
    if (!lead_replica && !(opt.sharded() && with_moments)) return;
    if (full && with_moments) full->ensure_moments();
    std::vector<size_t> mine;
    const auto ps = exec_.parameters();
    for (size_t i = 0; i < ps.size(); ++i)
      if (!exec_.is_copy(ps[i])) mine.push_back(i);
    // Full tensors of this stage's parameters: value, and the moments when with_moments.
    struct Full {
      std::string name;
      std::vector<float> v, m, s;
    };
    std::vector<Full> fulls;
    std::vector<float> gm, gv;  // this parameter's full moments
    for (size_t i : mine) {
      const model::Parameter& p = *ps[i];
      if (with_moments) {  // collective over dp x cp under ZeRO-1
        gm.resize(size_t(p.spec.numel()));
        gv.resize(size_t(p.spec.numel()));
        opt.gather_moments(i, gm.data(), gv.data());
      }
      if (!lead_replica) continue;
      auto one = [&](const float* src, std::vector<float>& out) {
        if (tp_.size() == 1) {
          out.assign(src, src + p.spec.numel());
          return;
        }
        assemble(tp_, p, src, out);
      };
      Full f;
      f.name = p.spec.name;
      one(p.value.f32(), f.v);
      if (with_moments) {
        one(gm.data(), f.m);
        one(gv.data(), f.s);
      }
      fulls.push_back(std::move(f));
    }
    if (!lead_replica || tp_.rank() != 0) return;
    auto store = [&](const std::string& name, int64_t n, const float* v, const float* m, const float* s) {
      model::Parameter& dst = full->param(name, n);
      const size_t di = full->index.at(name);
      std::memcpy(dst.value.f32(), v, size_t(n) * sizeof(float));
      if (with_moments) {
        std::memcpy(full->exp_avg[di].f32(), m, size_t(n) * sizeof(float));
        std::memcpy(full->exp_avg_sq[di].f32(), s, size_t(n) * sizeof(float));
      }
    };
    const int tag = 7;
    if (pp_.rank() != 0) {
      int32_t count = int32_t(fulls.size());
      pp_.send(&count, 1, DType::i32, 0, tag);
      for (const Full& f : fulls) {
        const int64_t n = int64_t(f.v.size());
        int32_t head[2] = {int32_t(f.name.size()), int32_t(n)};
        pp_.send(head, 2, DType::i32, 0, tag);
        std::vector<int32_t> chars(f.name.begin(), f.name.end());
        pp_.send(chars.data(), int64_t(chars.size()), DType::i32, 0, tag);
        pp_.send(f.v.data(), n, DType::f32, 0, tag);
        if (with_moments) {
          pp_.send(f.m.data(), n, DType::f32, 0, tag);
          pp_.send(f.s.data(), n, DType::f32, 0, tag);
        }
      }
      return;
    }
    for (const Full& f : fulls)
      if (full) store(f.name, int64_t(f.v.size()), f.v.data(), f.m.data(), f.s.data());
    std::vector<float> v, m, s;
    for (int src = 1; src < pp_.size(); ++src) {
      int32_t count = 0;
      pp_.recv(&count, 1, DType::i32, src, tag);
      for (int32_t k = 0; k < count; ++k) {
        int32_t head[2];
        pp_.recv(head, 2, DType::i32, src, tag);
        std::vector<int32_t> chars(static_cast<size_t>(head[0]));
        pp_.recv(chars.data(), head[0], DType::i32, src, tag);
        std::string name(chars.begin(), chars.end());
        v.resize(size_t(head[1]));
        pp_.recv(v.data(), head[1], DType::f32, src, tag);
        if (with_moments) {
          m.resize(size_t(head[1]));
          s.resize(size_t(head[1]));
          pp_.recv(m.data(), head[1], DType::f32, src, tag);
          pp_.recv(s.data(), head[1], DType::f32, src, tag);
        }
        if (full) store(name, head[1], v.data(), m.data(), s.data());
      }
    }
    if (full) full->optimizer_steps = opt.steps_taken();
  }

  // Each of this rank's parameters by name: the last stage's copy of a tied wte takes wte (both
  // copies always take the same update, so their moments are wte's too).
  // Under tp / cp each stage's shard takes its segments of the full tensor.
  void load(CheckpointTensors& ckpt, int64_t optimizer_steps) override {
    const auto ps = exec_.parameters();
    parallel::ReplicaOptimizer& opt = exec_.optimizer();
    std::vector<float> m, v;
    for (size_t i = 0; i < ps.size(); ++i) {
      const int64_t n = ps[i]->spec.numel();
      m.resize(size_t(n));
      v.resize(size_t(n));
      if (ps[i]->shard.split) {
        read_shard(ckpt, "param", *ps[i], ps[i]->value.f32(), n);
        read_shard(ckpt, "adam_m", *ps[i], m.data(), n);
        read_shard(ckpt, "adam_v", *ps[i], v.data(), n);
      } else {
        ckpt.read_into("param", ps[i]->spec.name, ps[i]->value);
        const Shape& sh = ps[i]->spec.shape;
        std::memcpy(m.data(), ckpt.read("adam_m", ps[i]->spec.name, sh).data(), size_t(n) * sizeof(float));
        std::memcpy(v.data(), ckpt.read("adam_v", ps[i]->spec.name, sh).data(), size_t(n) * sizeof(float));
      }
      opt.load_moments(i, m.data(), v.data());  // under ZeRO-1 each rank keeps its part
    }
    opt.set_steps_taken(optimizer_steps);
  }

  std::string describe() const override {
    const auto& sp = exec_.schedule().spec;
    const std::string blocks = fmt::format("{}", fmt::join(pipe::stage_layers_from_cuts(exec_.cuts(), n_layer_), ","));
    return fmt::format("pp {} ({}, m = {}{}, blocks {}) x dp {}{}{}", sp.stages, pipe::kind_name(sp.kind),
                       sp.micro_batches, sp.virtual_stages > 1 ? fmt::format(", v = {}", sp.virtual_stages) : "",
                       blocks, dp_.size(),
                       exec_.optimizer().sharded() ? " (ZeRO-1)" : "",
                       cfg_.tp > 1 || cfg_.cp > 1 || cfg_.sp
                           ? fmt::format(" x tp {}{} x cp {}", cfg_.tp, cfg_.sp ? " + sp" : "", cfg_.cp)
                           : "");
  }
  std::vector<pipe::TraceEvent> trace() const override { return exec_.trace(); }

 private:
  const TrainConfig& cfg_;
  parallel::MeshComms& mc_;
  data::Loader& train_;
  comm::Comm& pp_;
  comm::Comm& dp_;
  comm::Comm& tp_;
  pipe::PipelineExecutor exec_;
  int64_t local_ = 0, n_layer_ = 0;
  Tensor x_, y_;  // i32 [B / dp, T]
};

// Every rank's pipeline trace events on rank 0 (rank order; the others get an empty list): each
// event travels as five doubles (op, micro-batch, chunk, start, end) in a gather over `world`,
// so it works whether the ranks are threads or processes.
std::vector<std::vector<pipe::TraceEvent>> gather_traces(comm::Comm& world, const std::vector<pipe::TraceEvent>& mine) {
  constexpr int64_t kFields = 5;
  const int n = world.size();
  std::vector<double> send;
  for (const pipe::TraceEvent& e : mine)
    for (double v : {double(int(e.op)), double(e.mb), double(e.chunk), e.start, e.end}) send.push_back(v);
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
      out[size_t(r)].push_back({pipe::Op(int(v[0])), int(v[1]), int(v[2]), v[3], v[4]});
  return out;
}

// Everything one rank does; rank 0 prints, evaluates (pipeline), samples and writes files. Every
// rank runs the same collectives in the same order.
TrainResult train_mesh_rank(const TrainConfig& cfg, const TrainOptions& opt, parallel::MeshComms& comms,
                            const FaultInjection& fault) {
  comm::Comm& world = comms.world();
  const int rank = world.rank(), ranks = world.size();
  const bool lead = rank == 0;
  auto say = [&](const std::string& s) {
    if (lead && !opt.quiet) std::printf("%s\n", s.c_str()), std::fflush(stdout);
  };

  RunData run_data = open_run_data(cfg, opt.config_path);
  check_ranks_agree(world, cfg, run_data);  // before any other collective
  const std::string vocabulary = run_data.tokenizer ? run_data.tokenizer->fingerprint() : "";
  data::Loader& train = run_data.train;
  std::unique_ptr<data::Loader>& val = run_data.val;
  const model::GPTConfig mc = run_data.model;

  MemoryPool pool(fmt::format("cpu:{}", rank));
  const optim::AdamWConfig oc = adamw_config(cfg);
  std::unique_ptr<Engine> engine;
  if (cfg.pp > 1) engine = std::make_unique<PipelineEngine>(cfg, mc, oc, comms, train, pool);
  else engine = std::make_unique<TensorEngine>(cfg, mc, oc, comms, train, pool);
  std::unique_ptr<FullModel> full;
  if (lead) full = std::make_unique<FullModel>(mc, cfg.seed);
  LrSchedule sched{cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps, cfg.lr_schedule};

  TrainResult res;
  fs::path out_dir(cfg.out_dir);
  if (lead) fs::create_directories(out_dir);
  // The writing rank holds the run directory for the whole run (a second run into it is refused).
  std::unique_ptr<RunDirLock> dir_lock = lead ? std::make_unique<RunDirLock>(out_dir.string()) : nullptr;
  const std::string metrics_path = (out_dir / "metrics.jsonl").string();
  int64_t start_step = 0;
  if (opt.resume) {
    // Every rank reads the checkpoint itself and keeps its own part of each full tensor: like
    // Megatron, this assumes train.out_dir is on a filesystem every rank sees. Rank 0's step is
    // broadcast so a rank that found another checkpoint (or none) is an error, not a silent
    // divergence.
    std::vector<std::string> notes;
    const std::string ckpt = resume_checkpoint(cfg.out_dir, &notes);
    for (const std::string& n : notes) say("resume: " + n);
    CheckpointMeta meta;
    if (!ckpt.empty()) {
      meta = read_checkpoint_meta(ckpt);
      check_resume_checkpoint(ckpt, meta, cfg, mc, vocabulary);
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
      say(fmt::format("resume: no checkpoint in {}, starting from step 0", cfg.out_dir));
    } else {
      CheckpointTensors tensors(ckpt);
      engine->load(tensors, meta.optimizer_steps);
      start_step = meta.step;
      if (lead) truncate_metrics(metrics_path, start_step);
      say(fmt::format("resumed from {} (step {})", ckpt, start_step));
    }
  }
  if (lead && start_step == 0 && fs::exists(metrics_path)) fs::remove(metrics_path);
  world.barrier();  // rank 0 has prepared the output directory

  std::unique_ptr<data::Tokenizer> tok = lead ? std::move(run_data.tokenizer) : nullptr;

  const int64_t T = cfg.seq_len, val_mb = cfg.batch_size / cfg.grad_accum;
  if (lead)
    say(fmt::format("model {} | {:.2f}M parameters | {} ({}, {} ranks) | {} threads per rank", mc.str(),
                    double(full->gpt->num_parameters()) / 1e6, engine->describe(), world.backend(), ranks,
                    omp_get_max_threads()));
  const double peak = job_gemm_peak(world);
  res.last_val_loss = NAN;
  res.unigram_val_loss = lead ? unigram_loss(train, val.get(), mc.vocab_size) : NAN;
  say(fmt::format("data {} | train {} tokens{} | unigram baseline loss {:.4f} | GEMM peak {:.1f} GFLOP/s", cfg.data_dir,
                  train.total_tokens(), val ? fmt::format(", val {} tokens", val->total_tokens()) : "",
                  res.unigram_val_loss, peak / 1e9));

  RunLog log(cfg, metrics_path, start_step, lead, opt.quiet, mc.flops_per_token(T), peak,
             res.unigram_val_loss);

  auto evaluate = [&]() -> double {
    if (!val) return NAN;
    const int64_t n = std::min(cfg.eval_batches, val->val_batches(val_mb));
    if (n == 0) return NAN;
    return engine->evaluate(*val, n, val_mb, full.get());
  };
  // Collective (the parameters are gathered); rank 0 samples from the single-device model.
  auto sample = [&](int64_t step) -> std::string {
    if (cfg.sample_tokens == 0) return "";
    engine->gather(full.get(), false);
    if (!lead) return "";
    return sample_text(cfg, *full->gpt, sample_prompt(cfg, tok.get(), train, val.get()), step, tok.get());
  };
  // Collective, ending in a barrier: no rank starts the next step before rank 0 has the whole
  // checkpoint on disk, so a rank that fails in that step cannot cut the gather (or the write)
  // short and lose the checkpoint.
  auto checkpoint = [&](int64_t step) {
    engine->gather(full.get(), true);
    if (lead)
      save_checkpoint(out_dir.string(), checkpoint_meta(cfg, mc, step, full->optimizer_steps, vocabulary), full->named(),
                      cfg.keep_checkpoints);
    world.barrier();
  };

  pool.reset_peaks();
  RunHooks hooks;
  hooks.step = [&](int64_t step, float lr) {
    StepOut st = engine->step(step, lr);
    return RunHooks::StepOut{st.loss, st.grad_norm};
  };
  hooks.evaluate = evaluate;
  hooks.sample = sample;
  hooks.checkpoint = checkpoint;
  run_steps(cfg, log, sched, fault, rank, ranks, start_step, val != nullptr, hooks, res);
  for (int t = 0; t < kNumMemTags; ++t) res.peak_bytes[size_t(t)] = pool.peak(MemTag(t));
  say(fmt::format("memory of rank 0 (peak): params {} | grads {} | optimizer {} | activations {}",
                  format_bytes(res.peak_bytes[size_t(MemTag::params)]), format_bytes(res.peak_bytes[size_t(MemTag::grads)]),
                  format_bytes(res.peak_bytes[size_t(MemTag::optimizer)]),
                  format_bytes(res.peak_bytes[size_t(MemTag::activations)])));
  res.last_sample = sample(cfg.steps);
  if (!res.last_sample.empty()) say(fmt::format("--- sample ---\n{}\n---", res.last_sample));
  if (!opt.trace_path.empty()) {  // pipeline only (checked before the ranks start)
    auto traces = gather_traces(world, engine->trace());  // collective
    if (lead) {
      pipe::write_chrome_trace(opt.trace_path, traces);
      say(fmt::format("wrote trace {} (the last step of every rank)", opt.trace_path));
    }
  }
  log.finish((out_dir / "loss.png").string(), fmt::format("loom: {} on {}", mc.name, cfg.data_dir));
  return res;
}

// train_mesh_rank over the mesh of cfg on `world`. on_fail runs before the communicators are
// destroyed when the rank throws (mpi: the job is aborted naming the rank, so no other rank waits
// for the communicator's timeout); what else the rank held is only memory.
TrainResult train_rank(const TrainConfig& cfg, const TrainOptions& opt, comm::Comm& world, const FaultInjection& fault,
                       const std::function<void(const std::string&)>& on_fail) {
  std::unique_ptr<parallel::MeshComms> comms;
  try {
    comms = std::make_unique<parallel::MeshComms>(
        parallel::Mesh::standard(int(cfg.pp), int(cfg.dp), int(cfg.cp), int(cfg.tp)), world);
    return train_mesh_rank(cfg, opt, *comms, fault);
  } catch (const std::exception& e) {
    on_fail(e.what());
    throw;
  }
}

}  // namespace

bool needs_mesh(const TrainConfig& cfg) { return cfg.tp > 1 || cfg.cp > 1 || cfg.pp > 1 || cfg.sp; }

TrainResult run_training_mesh(const TrainConfig& cfg, const TrainOptions& opt) {
  const std::string where = opt.config_path.empty() ? "config" : opt.config_path;
  if (cfg.pp > 1 && cfg.zero >= 2)
    throw Error(fmt::format("{}: parallel.zero = {} is not supported with parallel.pp = {} (pipelines compose with "
                            "ZeRO stage 0 or 1: stages 2 and 3 shard the gradients and parameters every "
                            "micro-batch needs whole); set parallel.zero = 0 or 1",
                            where, cfg.zero, cfg.pp));
  if (cfg.zero >= 2)
    throw Error(fmt::format("{}: parallel.zero = {} is not supported with parallel.tp = {}, parallel.cp = {}, "
                            "parallel.sp = {} (ZeRO stages 2 and 3 run with data parallelism alone; tensor, "
                            "sequence and context parallelism compose with stage 0 or 1); set parallel.zero = 0 or 1",
                            where, cfg.zero, cfg.tp, cfg.cp, cfg.sp));
  if (cfg.offload)
    throw Error(fmt::format("{}: parallel.offload is not supported with parallel.tp = {}, parallel.cp = {}, "
                            "parallel.sp = {}, parallel.pp = {} (offload runs with data parallelism alone); set "
                            "parallel.offload = false",
                            where, cfg.tp, cfg.cp, cfg.sp, cfg.pp));
  if (!opt.trace_path.empty() && cfg.pp == 1)
    throw Error(fmt::format("{}: --trace is available with parallel.pp > 1 and data parallelism, not with "
                            "parallel.tp/cp/sp",
                            where));
  if (cfg.cp > 1 && cfg.seq_len % (2 * cfg.cp) != 0)
    throw Error(fmt::format("{}: data.seq_len = {} must be divisible by 2 x parallel.cp = {} (each rank takes two "
                            "chunks of every sequence)",
                            where, cfg.seq_len, 2 * cfg.cp));
  if (cfg.tp > 1 && cfg.n_head > 0 && cfg.n_head % cfg.tp != 0)
    throw Error(fmt::format("{}: model.n_head = {} is not divisible by parallel.tp = {}", where, cfg.n_head, cfg.tp));
  const int world = int(cfg.pp * cfg.dp * cfg.cp * cfg.tp);
  const comm::CommOptions co = comm_options(cfg);
  const FaultInjection fault = FaultInjection::from_env(world);
  if (cfg.comm == "mpi")  // one process per mesh rank, the mesh over the MPI world (Mesh::standard order)
    return run_mpi_rank(cfg, where, world,
                        fmt::format("parallel.pp x parallel.dp x parallel.cp x parallel.tp = {} x {} x {} x {} = {}",
                                    cfg.pp, cfg.dp, cfg.cp, cfg.tp, world),
                        co, [&](comm::Comm& w, std::function<void(const std::string&)> on_fail) {
                          return train_rank(cfg, opt, w, fault, on_fail);
                        });
  comm::RunOptions ro;
  ro.comm = co;
  const int total_threads = cfg.threads > 0 ? int(cfg.threads) : omp_get_max_threads();
  ro.threads_per_rank = std::max(1, total_threads / world);
  TrainResult result;
  comm::run_ranks(
      world,
      [&](comm::Comm& c) {
        TrainResult r;
        try {
          r = train_rank(cfg, opt, c, fault, [](const std::string&) {});
        } catch (const std::exception& e) {
          throw Error(fmt::format("rank {} of {} failed: {}", c.rank(), world, e.what()));
        }
        if (c.rank() == 0) result = r;
      },
      ro);
  return result;
}

}  // namespace loom::train

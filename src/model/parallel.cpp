#include "model/parallel.h"

#include <algorithm>
#include <numeric>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "parallel/context/ring_attention.h"
#include "parallel/tensor/mappings.h"
#include "parallel/tensor/vocab_parallel.h"

namespace loom::model {

namespace tpm = parallel::tp;

ChainParallel::ChainParallel(Backend& be) : be_(be) {}

ChainParallel::ChainParallel(Backend& be, ParallelGroups groups, bool sp) : be_(be), g_(groups), sp_(sp) {
  tp_ = tpm::group_size(g_.tp);
  tpr_ = tpm::group_rank(g_.tp);
  cp_ = tpm::group_size(g_.cp);
  cpr_ = tpm::group_rank(g_.cp);
  // On a device the groups' collectives take its memory (comm/nccl_comm.h's device
  // communicators), in the compute dtype; scalars and sampling's rows go over the host groups.
  if (be.device() != Device::cpu) {
    if (cp_ > 1 && !g_.cp->device_buffers())
      throw Error(fmt::format("context parallelism (cp = {}) on the {} backend needs a device communicator for its "
                              "group (comm::make_device_comm), got the {} backend's",
                              cp_, be.name(), g_.cp->backend()));
    if (tp_ > 1 && !g_.tp->device_buffers())
      throw Error(fmt::format("tensor parallelism (tp = {}) on the {} backend needs a device communicator for its "
                              "group (comm::make_device_comm), got the {} backend's",
                              tp_, be.name(), g_.tp->backend()));
    // Host buffers (loss sums, sampling's rows) need the groups' host communicators.
    for (auto [n, host, what] : {std::tuple{tp_, g_.tp_host, "tp_host"}, std::tuple{cp_, g_.cp_host, "cp_host"}})
      if (n > 1 && !host)
        throw Error(fmt::format("model parallelism on the {} backend needs ParallelGroups::{} (the group's host "
                                "communicator, for host buffers)",
                                be.name(), what));
  }
  if (tp_ > 1 && be.compute_dtype() != DType::f32 && be.compute_dtype() != DType::bf16)
    throw Error(fmt::format("tensor parallelism (tp = {}) computes in f32 or bf16 (the collectives' reductions), not {}",
                            tp_, dtype_name(be.compute_dtype())));
}

ChainParallel::~ChainParallel() = default;

void ChainParallel::check(const GPTConfig& cfg, const std::string& where) const {
  if (cfg.n_head % tp_ != 0)
    throw Error(fmt::format("{}: n_head = {} is not divisible by tp = {} (attention is split by heads; choose tp "
                            "dividing the head count)",
                            where, cfg.n_head, tp_));
  if (cfg.kv_heads() % tp_ != 0 && tp_ % cfg.kv_heads() != 0)
    throw Error(fmt::format("{}: n_kv_head = {} and tp = {}: the key/value heads are split over tp where tp divides "
                            "them and replicated where they divide tp; choose tp a divisor or a multiple of n_kv_head",
                            where, cfg.kv_heads(), tp_));
  if (cfg.ffn() % tp_ != 0)
    throw Error(fmt::format("{}: ffn_hidden = {} is not divisible by tp = {} (the feed-forward is split by columns)",
                            where, cfg.ffn(), tp_));
}

void ChainParallel::check_sequence(int64_t T, const std::string& where) const {
  parallel::cp::check_sequence(T, cp_, where.c_str());
}

int64_t ChainParallel::sequence_unit() const {
  return std::lcm<int64_t>(cp_ > 1 ? 2 * cp_ : 1, sp_active() ? tp_ : 1);
}

std::vector<float> ChainParallel::logits_row(const float* logits, int64_t T, int64_t position,
                                             const GPTConfig& cfg) const {
  check_sequence(T, "logits_row");
  LOOM_CHECK(position >= 0 && position < T, "logits_row: position {} outside a sequence of {}", position, T);
  const int64_t Vr = vocab_rows(cfg);
  int owner = 0;
  int64_t local = position;
  if (cp_ > 1)
    for (int r = 0; r < cp_; ++r)
      for (int64_t t = 0; t < T / cp_; ++t)
        if (parallel::cp::global_position(t, T, cp_, r) == position) owner = r, local = t;
  std::vector<float> mine(static_cast<size_t>(Vr));
  if (cpr_ == owner) std::copy_n(logits + local * Vr, Vr, mine.begin());
  if (comm::Comm* g = cp_host_group()) g->broadcast(mine.data(), Vr, DType::f32, owner);
  comm::Comm* tp = tp_host_group();  // (host vectors)
  if (!tp) return mine;
  std::vector<float> row(static_cast<size_t>(Vr * tp_));
  tp->all_gather(mine.data(), row.data(), int64_t(row.size()), DType::f32);
  return row;
}

int64_t ChainParallel::vocab_rows(const GPTConfig& cfg) const {
  return cfg.vocab_shard_rows(tp_);
}

comm::Range ChainParallel::own(int64_t B, int64_t T) const {
  const int64_t N = rows(B, T);
  return sp_active() ? tpm::sp_rows(N, tp_, tpr_) : comm::Range{0, N};
}

Parameter ChainParallel::whole(ParamSpec spec, bool sp_partial) const {
  Parameter p;
  p.spec = std::move(spec);
  p.shard.sp_partial = sp_partial && sp_active();
  return p;
}

comm::Comm* ChainParallel::shared_group(int size) {
  auto it = shared_.find(size);
  if (it != shared_.end()) return it->second.get();
  // Ranks r with the same r / size hold the same replicated head.
  return (shared_[size] = g_.tp->split(tpr_ / size, tpr_)).get();
}

Parameter ChainParallel::rows_split(ParamSpec spec, const std::vector<Section>& sections) {
  if (tp_ == 1) return whole(std::move(spec), false);
  const int64_t K = spec.shape.size() > 1 ? spec.shape[1] : 1;
  Parameter p;
  p.shard.global_shape = spec.shape;
  p.shard.split = true;
  int64_t global = 0, local = 0;
  for (const Section& sec : sections) {
    const int64_t Rs = sec.heads * sec.head_rows;
    if (sec.heads % tp_ == 0) {
      const int64_t Rl = Rs / tp_;
      p.shard.segments.push_back({local * K, (global + tpr_ * Rl) * K, Rl * K});
      local += Rl;
    } else {
      LOOM_CHECK(tp_ % sec.heads == 0, "parameter '{}': {} heads neither split over nor divide tp = {}", spec.name,
                 sec.heads, tp_);
      const int group = tp_ / int(sec.heads);
      const int64_t head = tpr_ / group;
      p.shard.segments.push_back({local * K, (global + head * sec.head_rows) * K, sec.head_rows * K,
                                  /*shared=*/true, /*replica=*/tpr_ % group != 0});
      p.shard.shared_group = shared_group(group);
      local += sec.head_rows;
    }
    global += Rs;
  }
  LOOM_CHECK(global == spec.shape[0], "parameter '{}': sections of {} rows for {}", spec.name, global, spec.shape[0]);
  spec.shape[0] = local;
  spec.alloc_rows = local;
  spec.row_blocks.clear();  // (the whole tensor's; a rank holds pieces of them)
  p.spec = std::move(spec);
  return p;
}

Parameter ChainParallel::columns_split(ParamSpec spec) const {
  if (tp_ == 1) return whole(std::move(spec), false);
  const int64_t R = spec.shape[0], K = spec.shape[1], Kl = K / tp_;
  Parameter p;
  p.shard.global_shape = spec.shape;
  p.shard.split = true;
  for (int64_t i = 0; i < R; ++i) p.shard.segments.push_back({i * Kl, i * K + tpr_ * Kl, Kl});
  spec.shape = {R, Kl};
  spec.alloc_rows = R;
  p.spec = std::move(spec);
  return p;
}

Parameter ChainParallel::vocab_split(ParamSpec spec, const GPTConfig& cfg) const {
  if (tp_ == 1) return whole(std::move(spec), false);
  // Rows [v0, v0 + Vs) of the padded vocabulary; rows >= V are zero padding.
  const int64_t V = spec.shape[0], C = spec.shape[1], Vs = vocab_rows(cfg), v0 = vocab_begin(cfg);
  const int64_t real = std::clamp<int64_t>(V - v0, 0, Vs);
  Parameter p;
  p.shard.global_shape = spec.shape;
  p.shard.split = true;
  if (real > 0) p.shard.segments.push_back({0, v0 * C, real * C});
  spec.shape = {Vs, C};
  spec.alloc_rows = Vs;
  p.spec = std::move(spec);
  return p;
}

void* ChainParallel::scratch(Tensor& t, int64_t n) {
  if (!t.defined() || t.numel() < n) {
    t = Tensor();
    t = be_.empty({n}, be_.compute_dtype(), MemTag::workspace);
  }
  return t.raw();
}

const void* ChainParallel::gather(const void* own, int64_t N, int64_t C) {
  if (!sp_active()) return own;
  void* full = scratch(gathered_, N * C);
  tpm::gather_rows_forward(g_.tp, own, full, N, C, be_.compute_dtype());
  return full;
}

void ChainParallel::reduce(void* partial, void* out, int64_t N, int64_t C) {
  if (tp_ == 1) return;
  if (sp_active()) {
    tpm::scatter_rows_forward(g_.tp, partial, out, N, C, be_.compute_dtype());
    return;
  }
  LOOM_CHECK(partial == out, "tensor parallel reduce: without sp the partial sums are reduced in place");
  tpm::reduce_forward(g_.tp, out, N * C, be_.compute_dtype());
}

const void* ChainParallel::reduce_input_grad(void* partial, int64_t N, int64_t C) {
  if (tp_ == 1) return partial;
  if (!sp_active()) {
    tpm::copy_backward(g_.tp, partial, N * C, be_.compute_dtype());
    return partial;
  }
  const int64_t Ns = tpm::sp_rows(N, tp_, tpr_).size();
  void* own = scratch(own_grad_, std::max<int64_t>(Ns, 1) * C);
  tpm::gather_rows_backward(g_.tp, partial, own, N, C, be_.compute_dtype());
  return own;
}

void* ChainParallel::partial_buffer(int64_t N, int64_t C) { return scratch(partial_, N * C); }

float* ChainParallel::loss_statistics(int64_t N) {
  if (!stats_.defined() || stats_.numel() < 3 * N) {
    stats_ = Tensor();
    stats_ = be_.empty({3 * N}, DType::f32, MemTag::workspace);
  }
  return stats_.f32();
}

void ChainParallel::slice_sequence(const int32_t* full, int32_t* local, int64_t B, int64_t T) const {
  const int64_t n = B * (T / cp_);
  std::vector<int32_t> host(static_cast<size_t>(n));
  parallel::cp::slice_sequence(full, host.data(), B, T, cp_, cpr_);
  be_.copy({.dst = local, .dst_dtype = DType::i32, .src = host.data(), .src_dtype = DType::i32, .src_host = true, .n = n});
}

const int32_t* ChainParallel::positions(int64_t T) {
  if (T != positions_T_) {
    const int64_t Tl = T / cp_;
    positions_ = Tensor();
    positions_ = be_.empty({Tl}, DType::i32, MemTag::workspace);
    std::vector<int32_t> host(static_cast<size_t>(Tl));
    for (int64_t t = 0; t < Tl; ++t) host[size_t(t)] = int32_t(parallel::cp::global_position(t, T, cp_, cpr_));
    be_.copy({.dst = positions_.raw(), .dst_dtype = DType::i32, .src = host.data(), .src_dtype = DType::i32,
              .src_host = true, .n = Tl});
    positions_T_ = T;
  }
  return positions_.i32();
}

parallel::cp::RingAttention& ChainParallel::ring() {
  if (!ring_) ring_ = std::make_unique<parallel::cp::RingAttention>(be_);
  return *ring_;
}

void ChainParallel::release() {
  gathered_ = partial_ = own_grad_ = stats_ = positions_ = Tensor();
  positions_T_ = 0;
  if (ring_) ring_->release();
}

}  // namespace loom::model

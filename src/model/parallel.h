// The groups a chain of blocks is split over on one rank, Megatron style, and what the blocks
// share there. Every block takes one (model/blocks.h); at size 1 each mapping is the identity and
// the blocks run exactly the single-device ops.
//
// Tensor parallel (tp): attention's c_attn column-parallel by heads (under grouped-query attention
// the key/value heads are split too, or, where tp exceeds their count, each replicated on tp /
// n_kv_head ranks whose partial gradients are summed over that group: ShardSegment::shared), c_proj
// row-parallel; the MLP's c_fc column-parallel (SwiGLU's gate and up each by columns), c_proj
// row-parallel; wte (and lm_head) split by vocabulary rows,
// with a vocabulary-parallel embedding and cross-entropy (no rank materialises full logits). A
// head count that tp does not divide is refused; any vocabulary is padded (masked) to tp shards.
// Sequence parallel (sp, within tp): LayerNorms and residual regions hold rows own(B, T) of the
// N = B T / cp token rows; all-gather before each column-parallel GEMM, reduce-scatter after each
// row-parallel one; a gathered LayerNorm output is not kept but gathered again in backward.
// Context parallel (cp): the rank's two load-balanced chunks of every sequence
// (parallel/context/ring_attention.h), ring attention.
//
// Every rank of a tp x cp group passes the same full micro-batch tokens [B, T]; the blocks take
// their own positions. Parameters are the single-device model's full tensors (model/param_specs.h)
// cut by role (Parameter::shard), initialised element by element as the full tensor, so every
// layout starts from the same weights.
//
// The tp and cp collectives run through comm::Comm on the backend's memory in its compute dtype:
// host communicators for the CPU backend, device communicators (comm/nccl_comm.h: NCCL, or staged
// through host memory where ranks share a GPU) for a GPU's, made on the backend's queue
// (DeviceCommOptions::stream = Backend::native_queue(), so that a collective follows the ops
// that wrote its buffers), whose compute dtype must then be one the reductions take (f32 or bf16).
// Ring attention (cp) runs over the backend's ops (parallel/context/ring_attention.h); the host
// groups (ParallelGroups::tp_host, cp_host) carry scalars and sampling's rows.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "comm/comm.h"
#include "core/backend.h"
#include "core/tensor.h"
#include "model/config.h"
#include "model/param.h"

namespace loom::parallel::cp {
class RingAttention;
}

namespace loom::model {

struct ParallelGroups {
  comm::Comm* tp = nullptr;     // tensor (and sequence) parallel group; null: tp = 1
  comm::Comm* cp = nullptr;     // context parallel group; null: cp = 1
  comm::Comm* dp_cp = nullptr;  // dp x cp: the data-parallel reduction's group (when dp, cp > 1)
  // On a device, where tp is a device communicator: the same group's host communicator, for host
  // buffers (scalars, the norm's sums, sampling's logits rows); null: tp itself.
  comm::Comm* tp_host = nullptr;
  // The same for cp, whose group on a device is a device communicator for ring attention.
  comm::Comm* cp_host = nullptr;
};

class ChainParallel {
 public:
  // The single device.
  explicit ChainParallel(Backend& be);
  ChainParallel(Backend& be, ParallelGroups groups, bool sp);
  ~ChainParallel();
  ChainParallel(const ChainParallel&) = delete;
  ChainParallel& operator=(const ChainParallel&) = delete;

  int tp() const { return tp_; }
  int tp_rank() const { return tpr_; }
  int cp() const { return cp_; }
  int cp_rank() const { return cpr_; }
  bool sp() const { return sp_; }          // sequence parallelism asked for
  bool sp_active() const { return sp_ && tp_ > 1; }
  bool single() const { return tp_ == 1 && cp_ == 1; }
  const ParallelGroups& groups() const { return g_; }
  comm::Comm* tp_group() const { return tp_ > 1 ? g_.tp : nullptr; }
  // The tp group for host memory (ParallelGroups::tp_host, or tp itself).
  comm::Comm* tp_host_group() const { return tp_ > 1 ? (g_.tp_host ? g_.tp_host : g_.tp) : nullptr; }
  comm::Comm* cp_group() const { return cp_ > 1 ? g_.cp : nullptr; }
  // The cp group for host memory (ParallelGroups::cp_host, or cp itself).
  comm::Comm* cp_host_group() const { return cp_ > 1 ? (g_.cp_host ? g_.cp_host : g_.cp) : nullptr; }

  // Checks a model config against the layout (query heads, key/value heads and the feed-forward's
  // width divisible by tp), naming `where`.
  void check(const GPTConfig& cfg, const std::string& where) const;
  // Checks a micro-batch's sequence length (divisible by 2 cp), naming `where`.
  void check_sequence(int64_t T, const std::string& where) const;
  // Rows of the vocabulary per tp rank (the padded vocabulary split in tp equal parts) and this
  // rank's first.
  int64_t vocab_rows(const GPTConfig& cfg) const;
  int64_t vocab_begin(const GPTConfig& cfg) const { return int64_t(tpr_) * vocab_rows(cfg); }
  // Sampling. The length a sequence must be a multiple of here (2 cp under cp, tp under sp, their
  // least common multiple under both; 1 on one device).
  int64_t sequence_unit() const;
  // From this rank's logits [T / cp, vocab_rows] of one sequence of T tokens: the whole padded
  // row of `position`, on every rank (the cp rank holding the position sends its row, the tp
  // ranks' vocabulary columns are gathered). Collective over the cp and tp groups.
  std::vector<float> logits_row(const float* logits, int64_t T, int64_t position, const GPTConfig& cfg) const;

  // Token rows of a micro-batch [B, T] (T global) on this rank: B T / cp; and the rows of the
  // residual stream it holds: all of them, or its share under sp.
  int64_t rows(int64_t B, int64_t T) const { return B * (T / cp_); }
  comm::Range own(int64_t B, int64_t T) const;
  int64_t own_rows(int64_t B, int64_t T) const { return own(B, T).size(); }

  // The parameter `spec` as this rank holds it: whole (replicated over tp; sp_partial: its
  // gradient is a partial sum under sp), rows split over tp (column-parallel weights and biases),
  // columns split over tp (row-parallel weights), or vocabulary rows.
  Parameter whole(ParamSpec spec, bool sp_partial) const;
  // Rows in consecutive sections (c_attn: the queries' heads, then the keys' and the values';
  // SwiGLU's c_fc: the gate's F rows, then the up projection's), each of `heads` heads of
  // `head_rows` rows split over tp by heads; a section of fewer heads than tp (tp a multiple of
  // them) is replicated instead: rank r holds head r / (tp / heads), shared with the other ranks
  // holding it (ShardSegment::shared, Sharding::shared_group).
  struct Section {
    int64_t heads = 0, head_rows = 0;
  };
  Parameter rows_split(ParamSpec spec, const std::vector<Section>& sections);
  Parameter columns_split(ParamSpec spec) const;
  Parameter vocab_split(ParamSpec spec, const GPTConfig& cfg) const;

  // The mappings (parallel/tensor/mappings.h) on activations [N, C] in the compute dtype.
  // The full rows of own rows under sp, gathered into the shared gather buffer; `own` itself
  // otherwise.
  const void* gather(const void* own, int64_t N, int64_t C);
  // Partial sums [N, C] of a row-parallel GEMM -> the sum (all-reduce in place into `out` = partial,
  // or under sp the reduce-scatter into out's own rows).
  void reduce(void* partial, void* out, int64_t N, int64_t C);
  // The gradient of a column-parallel GEMM's input, partial [N, C] over tp -> this rank's rows of
  // the sum: in place (all-reduce), or under sp reduce-scattered into the shared own-rows buffer.
  const void* reduce_input_grad(void* partial, int64_t N, int64_t C);
  // Shared scratch (tag workspace): [N, C] for partial sums before a reduce-scatter.
  void* partial_buffer(int64_t N, int64_t C);
  // f32 [3 N]: the vocabulary-parallel cross-entropy's row statistics (tag workspace, shared).
  float* loss_statistics(int64_t N);
  // i32 [T / cp] in the backend's memory: the global position of each of the rank's rows of a
  // sequence of T (tag workspace, kept for the last T).
  const int32_t* positions(int64_t T);
  // local i32 [B, T / cp] (the backend's memory) = this rank's positions of full i32 [B, T] (host).
  void slice_sequence(const int32_t* full, int32_t* local, int64_t B, int64_t T) const;
  // Ring attention over cp (its K/V blocks and partial outputs, shared by the chain's blocks).
  parallel::cp::RingAttention& ring();
  // Frees the shared scratch.
  void release();

 private:
  void* scratch(Tensor& t, int64_t n);
  Backend& be_;
  ParallelGroups g_;
  bool sp_ = false;
  int tp_ = 1, tpr_ = 0, cp_ = 1, cpr_ = 0;
  Tensor gathered_, partial_, own_grad_;  // [N, C], [N, C], [Ns, C] (tag workspace)
  Tensor stats_;                          // f32 [3 N] (tag workspace)
  Tensor positions_;                      // i32 [T / cp] (tag workspace)
  int64_t positions_T_ = 0;
  std::unique_ptr<parallel::cp::RingAttention> ring_;
  // The groups of tp ranks holding the same replicated head, by group size (created collectively
  // over tp the first time a size is asked for).
  std::map<int, std::unique_ptr<comm::Comm>> shared_;
  comm::Comm* shared_group(int size);
};

}  // namespace loom::model

// Named parameters: a spec (global shape, initialisation, weight-decay group) and the tensors the
// model allocated for it. Initialisation is a pure function of (seed, name, global element index),
// so a later sharded layout can initialise exactly its shard of the same full tensor.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/memory.h"
#include "core/tensor.h"

namespace loom {
class Backend;
}
namespace loom::comm {
class Comm;
}

namespace loom::model {

enum class Init : uint8_t { normal, zeros, ones };

struct ParamSpec {
  std::string name;       // Hugging Face GPT-2 name: "wte.weight", "h.3.attn.c_attn.weight", ...
  Shape shape;            // global logical shape; weights in PyTorch Linear layout [out, in]
  int64_t alloc_rows = 0; // rows of storage (>= shape[0]): wte is padded to the padded vocabulary
  Init init = Init::zeros;
  float std = 0.0f;       // for Init::normal
  // The matrices a fused weight stacks by rows, as (label, rows), where the model's Hugging Face
  // layout keeps them apart (a Llama block's c_attn: q, k, v; its c_fc: gate, up), so GaLore
  // projects each on its own as it does Hugging Face's modules; empty: one matrix.
  std::vector<std::pair<std::string, int64_t>> row_blocks = {};
  // nanoGPT's groups: every parameter with two or more dimensions is decayed, others are not.
  bool decay() const { return shape.size() >= 2; }
  int64_t numel() const { return shape_numel(shape); }
  int64_t alloc_numel() const;  // numel including padding rows
};

// Elements [local, local + n) of a parameter's tensor are elements [global, global + n) of the
// full tensor.
struct ShardSegment {
  int64_t local = 0, global = 0, n = 0;
  // Held by several ranks of the tp group (key/value heads replicated where tp exceeds their
  // count): its gradient is a partial sum over Sharding::shared_group, and on all but the first
  // of them it is a replica, read from checkpoints but not written and not counted in the norm.
  bool shared = false;
  bool replica = false;
};

// Where a parameter's tensor lies in the model's full tensor of that name, under tensor
// parallelism (model/parallel.h). The default is the whole tensor.
struct Sharding {
  Shape global_shape;                  // the full tensor's logical shape (empty: spec.shape)
  std::vector<ShardSegment> segments;  // where the tensor lies in the full one (empty: all of it)
  bool split = false;       // a part of the full tensor (else the whole, the same on every tp rank)
  bool sp_partial = false;  // under sequence parallelism its gradient is a partial sum over tp
  bool tied_copy = false;   // a pipeline stage's copy of wte for its tied lm_head
  comm::Comm* shared_group = nullptr;  // the ranks holding its shared segments (not owned)
};

struct Parameter {
  ParamSpec spec;  // name and initialisation of the full tensor; shape of this rank's part
  Tensor value;       // f32 spec.shape (the first shape[0] rows of value_full): the master weights
  Tensor grad;        // f32 spec.shape, accumulated by backward
  Tensor value_full;  // f32 [alloc_rows, ...], padding rows zero
  Tensor grad_full;   // f32 [alloc_rows, ...]
  // A copy of the master weights in the backend's compute dtype (tag params), where that is not
  // f32; refreshed from the master weights by refresh_compute (or by the optimizer's update).
  // Undefined where the ops read the master weights themselves.
  Tensor compute;       // spec.shape
  Tensor compute_full;  // [alloc_rows, ...]
  // What the ops read: the compute copy, or the master weights.
  const Tensor& weights() const { return compute.defined() ? compute : value; }
  const Tensor& weights_full() const { return compute_full.defined() ? compute_full : value_full; }

  // Allocates value (tag params) and grad (tag grads, zeroed) from a host pool; compute is value.
  void allocate(MemoryPool& pool);
  // The same from the backend's pool (its device), with a compute copy where the backend computes
  // in another dtype than f32. With grad_storage (f32, at least alloc_numel() elements, zeroed) the
  // gradient lives there instead of in an allocation of its own.
  void allocate(Backend& be, const Tensor& grad_storage = Tensor());
  // The initial values of this rank's elements [begin, begin + n) (indices into value_full) into
  // dst: the elements initialise() draws there, zero for padding. Needs no storage of its own.
  void initialise_part(uint64_t seed, int64_t begin, int64_t n, float* dst) const;
  // value[i] for the global element indices [first, first + n) of the full tensor, drawn from
  // fill_normal(seed, stream_of(name), index); padding rows are zeroed. Parameters on a device
  // are drawn on the host and uploaded through `be`, and their compute copy refreshed.
  void initialise(uint64_t seed, Backend* be = nullptr);
  // compute_full = value_full in the compute dtype (nothing where they are the same tensor, or
  // where there is no value_full: an offloaded run's masters in host memory).
  void refresh_compute(Backend& be);

  Sharding shard;
  // The full tensor's spec (spec with the global shape).
  ParamSpec global() const;
  // This tensor's segments of the full one ({0, 0, numel} when it is the whole tensor).
  std::vector<ShardSegment> segments() const;
  // Calls f(global, n, local) for each run of this tensor's elements [begin, end) (local indices)
  // that lies in the full tensor, starting at the full tensor's element `global` (a vocabulary
  // split's padding lies nowhere); with owned_only, not the replicas of shared segments.
  template <class F>
  void for_each_global(int64_t begin, int64_t end, F&& f, bool owned_only = false) const {
    for (const ShardSegment& s : segments()) {
      if (owned_only && s.replica) continue;
      const int64_t lo = std::max(begin, s.local), hi = std::min(end, s.local + s.n);
      if (lo < hi) f(s.global + (lo - s.local), hi - lo, lo);
    }
  }
  // The local ranges [begin, end) of elements [0, numel) that count in the gradient norm: all
  // but replicas, in order.
  std::vector<std::pair<int64_t, int64_t>> norm_ranges() const;
  // Completes this rank's partial gradient sums on the local elements [begin, end) whose gradient
  // lies at grad (grad[0] is element begin): over tp where sequence parallelism left them partial
  // (shard.sp_partial), and the shared segments' over shared_group (replicated key/value heads).
  // Collective over those groups; nothing for a parameter with neither.
  // (`shared`: the communicator for the shared segments instead of shard.shared_group, over the
  // same ranks: a host one for gradients in host memory.)
  void sum_partial_gradients(int64_t begin, int64_t end, float* grad, comm::Comm* tp,
                             comm::Comm* shared = nullptr) const;
  bool has_shared() const { return shard.shared_group != nullptr; }
};

// Fills out[0, n) with the initial values of global elements [first, first + n) of spec.
void init_values(const ParamSpec& spec, uint64_t seed, float* out, int64_t first, int64_t n);

}  // namespace loom::model

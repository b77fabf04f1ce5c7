// Causal (or full) multi-head attention through cuDNN's fused flash-attention engines, written
// against cuDNN 9's backend graph API: a second path next to loom's own kernels
// (kernels/cuda/attention.cuh) with the same arguments, layouts and outputs, so the two are
// interchangeable and can be compared.
//
// A CudnnAttention is built for one shape (AttnArgs: B, NH, HS, Tq, Tkv, row strides, causal,
// scale). Its constructor builds the forward graph (QK^T -> scale -> causal mask -> softmax with
// its log-sum-exp as the stats output -> PV) and the backward graph (rowsum(dO * O), recomputed
// probabilities from the saved log-sum-exp, dV = P^T dO, dS, dK = dS^T Q, dQ = dS K through an f32
// accumulator), asks cuDNN's heuristics (mode A) for engine configurations and keeps the first one
// that finalizes into an execution plan, for each graph. forward() and backward() then only run
// the plans on a stream with a caller-given workspace.
//
// Layout as loom's kernels: element (b, t, h, d) of X at X[(b * T + t) * stride + h * HS + d]; lse
// f32 [B, NH, Tq], the natural log of each row's sum of exp of the scaled scores (cuDNN's softmax
// stats are exactly that: max + log(sum(exp(s - max)))).
//
// Grouped-query attention: NKV key/value heads dividing NH (query head h reads key/value head
// h / (NH / NKV)); the backward computes dK and dV per query head inside the fused graph and sums
// each group's into its key/value head.
//
// Supported (checked before any device work, loom::Error naming the field otherwise): bf16, HS 64
// or 128, NKV dividing NH, causal masks aligned at the first query and key (q_pos0 == kv_pos0: query t sees keys
// s <= t) or no mask, any Tq and Tkv >= 1 but not both 1 (cuDNN's backward does not take one query
// and one key), row strides >= NH * HS (kv: NKV * HS) and multiples of 8 elements;
// pointers (q, k, v, out, lse, dout, dq, dk, dv, workspace) 16-byte aligned. The constructor also
// refuses cuDNN releases before 9.16 (they need workarounds this path does not build), and a
// shape no cuDNN engine takes is a loom::Error naming the graph and cuDNN's message.
// Not thread-safe: one object per thread (it owns a cuDNN handle).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "kernels/cuda/attention.cuh"

namespace loom::cuda {

// True when loom was built with cuDNN (CMake found libcudnn).
bool cudnn_available();

// The version of the cuDNN library loaded at run time (e.g. 91900 for 9.19.0); 0 without cuDNN.
int64_t cudnn_runtime_version();

// Throws loom::Error naming the field when CudnnAttention does not take `a`; no device work, so it
// also runs on a machine without a GPU.
void cudnn_attention_check(const AttnArgs& a);

class CudnnAttention {
 public:
  // Builds and plans both graphs (needs a CUDA device of compute capability 8.0 or newer).
  // dtype: the 16-bit tensors' type, bf16 or f16.
  explicit CudnnAttention(const AttnArgs& a, DType dtype = DType::bf16);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  const AttnArgs& args() const;

  // Workspace bytes forward() / backward() need (backward's holds cuDNN's own scratch, the f32
  // rowsum(dO * O) [B, NH, Tq] and the f32 dQ accumulator [B, NH, Tq, HS]).
  size_t forward_workspace_bytes() const;
  size_t backward_workspace_bytes() const;

  // The chosen engines, for logs: "forward engine <global index> (<i>-th of <n> heuristic
  // configurations), backward engine ...".
  std::string describe() const;

  // out (o_stride, the dtype) and lse f32 [B, NH, Tq], as attention_forward.
  void forward(void* out, float* lse, const void* q, const void* k, const void* v, void* workspace,
               cudaStream_t stream);

  // dq (q_stride), dk, dv (kv_stride) in the dtype, written, from dout (o_stride), q, k, v, out and the
  // forward's lse, as attention_backward. dq is summed with atomics inside cuDNN, so its last bits
  // may differ between runs.
  void backward(void* dq, void* dk, void* dv, const void* dout, const void* q, const void* k, const void* v,
                const void* out, const float* lse, void* workspace, cudaStream_t stream);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom::cuda

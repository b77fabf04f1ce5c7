// The CUDA backend (core/backend.h): bf16 or f16 compute (BackendOptions::compute) with f32
// accumulation, f32 gradients and master weights, over the kernels of this folder. An instance owns
// everything it keeps between calls: its device pool (or the caller's), its stream, its BLAS state
// (cuBLASLt and cuBLAS handles, workspaces, tuned algorithms: cuda::Blas), the scratch of the bias-
// gradient and LayerNorm reductions, the attention workspace and the cuDNN attention plans per
// shape. Two instances share nothing, so ranks that are threads of one process each make their own,
// on one GPU or several.
//
// Ops enqueue on stream() and return; buffers passed to them are device memory of this instance's
// device (token ids and targets included). Scratch grows on demand: run a step once before
// capturing it into a CUDA graph (growing during a capture is refused), or prepare the shapes.
#pragma once
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "core/backend.h"
#include "kernels/cuda/allocator.cuh"
#include "kernels/cuda/matmul.cuh"

namespace loom::cuda {

class CudnnAttention;

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const BackendOptions& opt = {});
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  Device device() const override { return Device::cuda; }
  std::string name() const override { return name_; }
  DType compute_dtype() const override { return dtype_; }
  bool supports(Op op, DType dtype) const override;
  MemoryPool& pool() override { return *pool_; }
  AttnKernel attention_kernel(const AttnShape& s) const override;
  std::string attention_note() const override { return attention_note_; }

  void linear_forward(const LinearForward& a) override;
  void linear_backward(const LinearBackward& a) override;
  void layernorm_forward(const LayerNormForward& a) override;
  void layernorm_backward(const LayerNormBackward& a) override;
  void prepare_attention(DType dtype, const AttnShape& s) override;
  int64_t attention_probs_bytes(DType dtype, const AttnShape& s) const override;
  int64_t attention_workspace_bytes(DType dtype, const AttnShape& s, int threads = 0) const override;
  void attention_forward(const AttentionForward& a) override;
  void attention_backward(const AttentionBackward& a) override;
  void attention_merge(const AttentionMerge& a) override;
  void crossentropy(const CrossEntropy& a) override;
  void vocab_crossentropy(const VocabCrossEntropy& a) override;
  void embedding_forward(const EmbeddingForward& a) override;
  void embedding_backward(const EmbeddingBackward& a) override;
  void gelu_forward(DType dtype, void* out, const void* inp, int64_t n) override;
  void gelu_backward(DType dtype, void* dinp, const void* inp, const void* dout, int64_t n) override;
  void rope(const Rope& a) override;
  void swiglu_forward(DType dtype, void* out, const void* inp, int64_t N, int64_t H) override;
  void swiglu_backward(DType dtype, void* dinp, const void* dout, const void* inp, int64_t N, int64_t H) override;
  void add(DType dtype, void* out, const void* a, const void* b, int64_t n) override;
  void add_to_host(float* host, const float* src, int64_t n) override;
  void sum_squares(const std::vector<Range>& ranges, double* sums) override;
  void sum(const float* x, int64_t n, float scale, float* out) override;
  std::unique_ptr<AdamWPlan> plan_adamw(const std::vector<loom::AdamWTensor>& tensors) override;
  // Copies that read or write host memory wait for the stream (host buffers may go at return).
  void copy(const Copy& a) override;
  void copy_strided(const StridedCopy& a) override;
  void fill_zero(void* dst, int64_t bytes) override;
  // Frees the bias-gradient, LayerNorm and attention scratch and forgets the attention plans.
  void release_workspace() override;
  void synchronize() override;
  void* native_queue() const override { return stream_; }
  // (Defined with the device communicators, comm/nccl_comm.cu.) After require_nccl(true) the
  // collectives' communicators take NCCL's path or throw (parallel.comm = nccl).
  std::unique_ptr<comm::Comm> buffer_comm(std::unique_ptr<comm::Comm> host, bool staged) override;
  void require_nccl(bool on) { require_nccl_ = on; }
  // CUDA graphs of the instance's stream (thread-local capture mode).
  bool can_capture() const override { return true; }
  void begin_capture() override;
  std::unique_ptr<Graph> end_capture() override;

  int device_index() const { return device_; }
  bool capturing() const;
  cudaStream_t stream() const { return stream_; }
  Blas& blas() { return *blas_; }

 private:
  struct Plan;  // one attention shape: the kernel that runs it, cuDNN's plan, the workspace it needs
  using ShapeKey = std::vector<int64_t>;
  static ShapeKey key(DType dtype, const AttnShape& s);
  Plan& plan(DType dtype, const AttnShape& s);
  const Plan* find_plan(DType dtype, const AttnShape& s) const;
  AttnKernel resolve(const AttnShape& s, std::string* note) const;
  // Device scratch of at least `bytes` (tag workspace), grown outside graph captures only.
  void* grow(void*& p, size_t& have, size_t bytes, const char* what);
  void activate() const;  // makes this instance's device current on the calling thread
  void check(Op op, DType dtype) const;

  int device_ = 0;
  bool require_nccl_ = false;  // buffer_comm's collectives on NCCL's path only
  DType dtype_ = DType::bf16;  // what the model computes in (BackendOptions::compute); every op takes bf16 and f16
  std::string name_;
  std::unique_ptr<ArenaAllocator> own_alloc_;
  std::unique_ptr<MemoryPool> own_pool_;
  MemoryPool* pool_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<Blas> blas_;
  AttnKernel requested_ = AttnKernel::automatic;
  std::string attention_note_;
  std::map<ShapeKey, std::unique_ptr<Plan>> plans_;
  void* dbias_scratch_ = nullptr;
  size_t dbias_bytes_ = 0;
  void* ln_scratch_ = nullptr;
  size_t ln_bytes_ = 0;
  void* attn_ws_ = nullptr;
  size_t attn_ws_bytes_ = 0;
  // Copies between host and device memory that convert, and add_to_host: two staging buffers of
  // kStageBytes from pinned_host_allocator (page-locked, or pageable where the host refuses; the
  // backend's own, like its BLAS workspaces), used in turn so that one piece's transfer runs while
  // the host converts or adds the other (a conversion to the host: the first alone), and the events
  // that say a buffer's transfer is done. (Every op of an instance is called by one thread at a
  // time: the buffers are not locked.)
  static constexpr size_t kStageBytes = size_t(8) << 20;
  void* stage_[2] = {nullptr, nullptr};
  cudaEvent_t stage_free_[2] = {nullptr, nullptr};
  void ensure_stage();
};

}  // namespace loom::cuda

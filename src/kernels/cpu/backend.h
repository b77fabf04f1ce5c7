// The CPU backend (core/backend.h) over the kernels of this folder: f32 compute, the calling
// thread's OpenMP team, the tiled attention with its scratch kept by the instance.
#pragma once
#include <memory>

#include "core/backend.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/matmul.h"

namespace loom::cpu {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const BackendOptions& opt = {});

  Device device() const override { return Device::cpu; }
  std::string name() const override { return bf16_ ? "cpu (bf16 matmuls)" : "cpu"; }
  DType compute_dtype() const override { return DType::f32; }
  bool supports(Op op, DType dtype) const override;
  MemoryPool& pool() override { return *pool_; }
  AttnKernel attention_kernel(const AttnShape&) const override { return AttnKernel::tiled; }

  void linear_forward(const LinearForward& a) override;
  void linear_backward(const LinearBackward& a) override;
  int64_t linear_workspace_bytes(const std::vector<LinearShape>& shapes) const override;
  void layernorm_forward(const LayerNormForward& a) override;
  void layernorm_backward(const LayerNormBackward& a) override;
  void prepare_attention(DType dtype, const AttnShape& s) override;
  int64_t attention_probs_bytes(DType, const AttnShape&) const override { return 0; }
  // The larger of one forward and one backward call's scratch on the calling thread's team
  // (cpu::attention_training_workspace_bytes).
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
  std::unique_ptr<AdamWPlan> plan_adamw(const std::vector<AdamWTensor>& tensors) override;
  void copy(const Copy& a) override;
  void copy_strided(const StridedCopy& a) override;
  void fill_zero(void* dst, int64_t bytes) override;
  void release_workspace() override {
    attn_ws_->release();
    if (bf16_) bf16_->release();
  }
  void synchronize() override {}

  // The attention scratch every call of this instance uses (tag workspace of pool()).
  AttnWorkspace& attention_scratch() { return *attn_ws_; }
  // The CPU kernel's arguments for a shape (for tests and callers of the kernels themselves).
  static AttnArgs attn_args(const AttnShape& s);

 private:
  void check(Op op, DType dtype) const;
  MemoryPool* pool_;
  std::unique_ptr<AttnWorkspace> attn_ws_;
  std::unique_ptr<Bf16Matmul> bf16_;  // with BackendOptions::matmul = bf16
};

}  // namespace loom::cpu

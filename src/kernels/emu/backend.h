// The emulated device (Device::emu): a backend (core/backend.h) whose memory is host memory but
// which the model, the parallel runtimes and the trainer treat as a device, as they treat a GPU:
// activations in the compute dtype (bf16 by default, or f32) and, in bf16, the parameters'
// compute copies in the device's pool, tokens uploaded into it, f32 master weights, gradients
// and moments, the groups' collectives on communicators that take its memory
// (Backend::buffer_comm). Each op runs the CPU's kernel (kernels/cpu/backend.h) in f32: its bf16
// operands are widened into f32 scratch, and what it writes is rounded back to
// bf16 (round to nearest even), as a GPU's kernels store their bf16 outputs after computing in f32.
//
// It exists for testing: `train.device = "emu"` runs the device paths of every layout (compute
// copies, bf16 activations between pipeline stages and over the tp and cp groups, ZeRO-3's
// gathered compute copies, offload to the host pool, uploads and downloads) on any machine; with
// f32 compute (no compute copies then) the runs compare with the CPU's at the CPU's tolerances,
// in bf16 with one emulated device at a GPU's. What it cannot show is anything of CUDA's own: its
// kernels, streams, graphs and NCCL.
//
// The widening scratch is the emulator's, not the device's (a GPU's kernels widen in registers):
// it is kept in the device's pool (tag workspace) until set_scratch_pool gives it a host pool, as
// the trainer does with each rank's host pool. The device's pool then holds what a GPU's would
// (the model's, the parallel runtimes' and the optimizer's buffers), and of its own only the CPU
// attention kernel's scratch (a few hundred KiB): that is what train.memory_limit bounds and the
// planner predicts (loom plan --precision device).
#pragma once
#include <memory>

#include "core/backend.h"
#include "kernels/cpu/backend.h"

namespace loom::emu {

class EmuBackend final : public Backend {
 public:
  // opt.pool: an emu pool (MemoryPool over emu_allocator()); null: the instance's own. opt.compute:
  // bf16 or f32.
  explicit EmuBackend(const BackendOptions& opt = {});
  ~EmuBackend() override;

  Device device() const override { return Device::emu; }
  std::string name() const override;
  DType compute_dtype() const override { return compute_; }
  bool supports(Op op, DType dtype) const override;
  MemoryPool& pool() override { return *pool_; }
  AttnKernel attention_kernel(const AttnShape&) const override { return AttnKernel::tiled; }

  void linear_forward(const LinearForward& a) override;
  void linear_backward(const LinearBackward& a) override;
  void layernorm_forward(const LayerNormForward& a) override;
  void layernorm_backward(const LayerNormBackward& a) override;
  void prepare_attention(DType dtype, const AttnShape& s) override;
  int64_t attention_probs_bytes(DType, const AttnShape&) const override { return 0; }
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
  void add_to_host(float* host, const float* src, int64_t n) override { cpu_->add_to_host(host, src, n); }
  void sum_squares(const std::vector<Range>& ranges, double* sums) override { cpu_->sum_squares(ranges, sums); }
  void sum(const float* x, int64_t n, float scale, float* out) override { cpu_->sum(x, n, scale, out); }
  std::unique_ptr<AdamWPlan> plan_adamw(const std::vector<AdamWTensor>& tensors) override;
  void copy(const Copy& a) override { cpu_->copy(a); }
  void copy_strided(const StridedCopy& a) override { cpu_->copy_strided(a); }
  void fill_zero(void* dst, int64_t bytes) override { cpu_->fill_zero(dst, bytes); }
  void release_workspace() override;
  void synchronize() override {}
  // The group's host communicator, declaring that it takes this device's memory (it is host
  // memory): the collectives a GPU's device communicator runs, on the host backend's code.
  std::unique_ptr<comm::Comm> buffer_comm(std::unique_ptr<comm::Comm> host, bool staged) override;

  // f32 scratch of at least n elements (tag workspace), kept between ops.
  float* scratch(int64_t n);
  // Keeps the widening scratch in `host` (a pool of host memory) from now on; what it held is
  // released.
  void set_scratch_pool(MemoryPool& host);

 private:
  void check(Op op, DType dtype) const;
  void release_scratch();
  std::unique_ptr<MemoryPool> own_pool_;
  MemoryPool* pool_;
  DType compute_;
  std::unique_ptr<cpu::CpuBackend> cpu_;
  MemoryPool* scratch_pool_;
  void* scratch_ = nullptr;
  int64_t scratch_elems_ = 0;
};

}  // namespace loom::emu

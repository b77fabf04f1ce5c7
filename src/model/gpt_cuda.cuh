// GPT-2 training on one GPU: bf16 compute copies of the parameters, f32 master weights, gradients
// and AdamW moments; bf16 activations with f32 accumulation; fused kernels (residual + LayerNorm,
// bias and GELU in the GEMM epilogues, softmax + cross-entropy + dlogits in one pass over the
// padded vocabulary, multi-tensor AdamW with global-norm clipping); the whole step (forward,
// backward, optimizer) captured once as a CUDA graph and replayed.
//
// Parameters have the CPU model's names, shapes, layout and initialisation (model/param.h), so CPU
// and GPU runs start from the same weights.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/memory.h"
#include "kernels/cuda/adamw.cuh"
#include "kernels/cuda/common.cuh"
#include "model/config.h"
#include "model/param.h"
#include "model/param_specs.h"

namespace loom::cuda {
class CudaBackend;
class CudnnAttention;
class StepProfile;
}

namespace loom::model {

enum class CudaAttention : uint8_t {
  flash,  // loom's flash attention (kernels/cuda/attention.cuh): head sizes 64 and 128
  gemm,   // cuBLAS batched GEMMs with the probabilities materialised (kernels/cuda/attn_gemm.cuh)
  cudnn,  // cuDNN's fused attention through loom's backend-graph path (kernels/cuda/cudnn_attention.cuh):
          // head sizes 64 and 128, needs a build with cuDNN
};

// "flash", "gemm", "cudnn" (the names train.cuda_attention and train_gpt2_cuda take); throws
// naming the value otherwise.
CudaAttention cuda_attention_from_name(const std::string& name);
const char* cuda_attention_name(CudaAttention a);

// What train.cuda_attention = auto takes for a head size on this build and host: cudnn where loom
// was built with cuDNN, the cuDNN loaded at run time is one the path takes (9.16 or newer) and the
// head size is 64 or 128 (on an H100 it ran GPT-2 124M's training step 6% faster than flash,
// bench/results/2026-11-23-h100-checks); else flash for head sizes 64 and 128; else gemm.
CudaAttention auto_cuda_attention(int64_t head_size);

struct GPTCudaOptions {
  int64_t B = 8, T = 1024;  // micro-batch: activations are allocated for exactly this shape
  CudaAttention attention = CudaAttention::flash;
  bool cuda_graph = true;    // capture forward + backward + optimizer once, replay every step
  // With attention = cudnn: when cuDNN's attention cannot be set up (no engine for this shape, an
  // old GPU, cuDNN's own errors), use flash instead of throwing (auto's choice; options().attention
  // and attention_note() then say so).
  bool cudnn_falls_back_to_flash = false;
  bool fuse_dgelu = true;    // GELU backward in the GEMM epilogue (else a separate kernel)
  float lr = 6e-4f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
  float grad_clip = 1.0f;    // global-norm clipping; <= 0 disables
};

// The parameter list of a GPT-2 config (model/param_specs.h: the CPU model's own), after checking
// the config is one the CUDA model supports (tied embeddings).
std::vector<ParamSpec> cuda_param_specs(const GPTConfig& cfg);

class GPTCuda {
 public:
  // Allocates everything (parameters, gradients, moments, activations for B x T, workspace) from
  // `pool`, a device pool, and initialises the weights from seed as the CPU model does.
  GPTCuda(const GPTConfig& cfg, const GPTCudaOptions& opt, MemoryPool& pool, uint64_t seed = 1337);
  ~GPTCuda();
  GPTCuda(const GPTCuda&) = delete;
  GPTCuda& operator=(const GPTCuda&) = delete;

  const GPTConfig& config() const { return cfg_; }
  const GPTCudaOptions& options() const { return opt_; }
  // Why the attention differs from the one asked for (cuDNN's error), or "".
  const std::string& attention_note() const { return attention_note_; }
  const std::vector<ParamSpec>& specs() const { return specs_; }
  int64_t num_parameters() const;  // logical elements (no vocabulary padding)

  void init_weights(uint64_t seed);
  // Logical values of one parameter (host f32, spec.numel() elements); throws naming it.
  void set_parameter(const std::string& name, const float* values);
  std::vector<float> parameter(const std::string& name) const;
  std::vector<float> gradient(const std::string& name) const;

  // tokens, targets: host i32 [B, T] (targets may hold -1: ignored). Token ids are validated.
  // Forward only: returns the mean loss; logits() then holds the logits.
  float forward(const int32_t* tokens, const int32_t* targets);
  // Zeroes the gradients, runs forward and backward; returns the mean loss. No parameter update.
  float forward_backward(const int32_t* tokens, const int32_t* targets);
  // One optimizer step on the batch: gradients, global-norm clipping, AdamW at learning rate lr,
  // step (1-based) for bias correction. Returns the mean loss (before the update).
  float train_step(const int32_t* tokens, const int32_t* targets, float lr, int64_t step);
  float last_grad_norm() const { return h_stats_[1]; }  // of the last train_step or optimizer_step

  // Gradient accumulation over micro-batches, then one update: zero_grad(), accumulate() once
  // per micro-batch, optimizer_step(). accumulate() adds the gradient of the batch's mean loss
  // and returns that mean loss; with cuda_graph its forward + backward is captured once and
  // replayed. optimizer_step() is train_step's update (clipping, AdamW at lr, bias correction
  // for `step`) on grad_scale times the accumulated gradients (1 / k for the mean over k
  // micro-batches: the norm, the clipping and the update all see the scaled gradient) and
  // returns that gradient's norm before clipping.
  void zero_grad();
  float accumulate(const int32_t* tokens, const int32_t* targets);
  float optimizer_step(float lr, int64_t step, float grad_scale = 1.f);
  // The flat f32 gradient buffer, flat_elements() long (every parameter's gradient, padding
  // included, at its offset), for summing data-parallel replicas' gradients in one collective
  // between accumulate() and optimizer_step(), ordered on stream().
  float* gradient_buffer() { return grads_; }
  int64_t flat_elements() const { return total_; }

  // AdamW moments of one parameter (host f32, spec.numel() elements), for checkpoints; throws
  // naming it. The step count is the caller's: train_step and optimizer_step take it.
  std::vector<float> exp_avg(const std::string& name) const;
  std::vector<float> exp_avg_sq(const std::string& name) const;
  void set_exp_avg(const std::string& name, const float* values);
  void set_exp_avg_sq(const std::string& name, const float* values);

  // Times the parts of each step (kernels/cuda/profile.cuh) while set: every part of the forward,
  // backward and update marks `p` on stream() with its FLOPs; the caller opens and closes each
  // step (p->start(), p->finish()). While set, nothing runs as a CUDA graph. nullptr: off.
  void set_profile(cuda::StepProfile* p) { prof_ = p; }
  // CUDA graph replays so far (train_step, accumulate): what the work of a step ran as.
  int64_t graph_launches() const { return graph_launches_; }

  // f32 [B, T, Vp] copy of the last forward()'s bf16 logits (padding columns included).
  std::vector<float> logits() const;
  MemoryPool& pool() const { return pool_; }
  cudaStream_t stream() const { return stream_; }
  // The backend instance that holds this model's CUDA state (its stream and BLAS state).
  cuda::CudaBackend& backend() const { return *backend_; }

 private:
  struct Layer;
  void build(uint64_t seed);  // the constructor's work
  void release();             // gives back the stream, graphs, pinned and device memory
  void upload_batch(const int32_t* tokens, const int32_t* targets);
  void enqueue_forward(bool fused_loss_grad);
  void enqueue_backward();
  void enqueue_step();   // zero grads, forward (fused loss grad), backward, optimizer
  void enqueue_micro();  // forward (fused loss grad), backward: accumulate()'s work
  void enqueue_update(); // AdamW over the gradients, its norm and clip scale copied to h_stats_[1..2]
  // Runs `enqueue` eagerly without cuda_graph and the first time either graph would be captured
  // (library handles and algorithm choices are made outside any capture); else replays `exec`,
  // capturing it first when there is none or when its baked-in dloss is not the batch's.
  void run_graphed(cudaGraphExec_t& exec, float& exec_dloss, void (GPTCuda::*enqueue)());
  void set_adamw_hyper(float lr, int64_t step, float grad_scale);
  std::vector<float> download(const float* base, const std::string& name) const;  // logical elements
  void upload(float* base, const std::string& name, const float* values);
  float read_loss();
  void refresh_bf16();
  void mark(const char* part, double flops = 0);  // prof_'s mark, when set
  void* alloc(size_t bytes, MemTag tag);

  GPTConfig cfg_;
  GPTCudaOptions opt_;
  std::string attention_note_;
  MemoryPool& pool_;
  std::vector<ParamSpec> specs_;
  std::vector<int64_t> offsets_;  // element offset of each spec in the flat parameter buffers
  int64_t total_ = 0;             // elements in the flat buffers (with padding and alignment)
  std::vector<std::pair<void*, std::pair<size_t, MemTag>>> allocations_;

  float* master_ = nullptr;   // f32 [total] master weights
  cuda::bf16* wbf_ = nullptr;       // bf16 [total] compute copy
  float* grads_ = nullptr;    // f32 [total]
  float* m_ = nullptr;        // f32 [total]
  float* v_ = nullptr;        // f32 [total]
  std::unique_ptr<cuda::MultiTensorAdamW> adamw_;
  std::unique_ptr<cuda::CudnnAttention> cudnn_attn_;  // the planned graphs (attention == cudnn)

  struct Acts;
  std::unique_ptr<Acts> acts_;
  int32_t* d_tokens_ = nullptr;   // i32 [B, T]
  int32_t* d_targets_ = nullptr;  // i32 [B, T]
  int32_t* h_tokens_ = nullptr;   // pinned staging i32 [2, B, T]
  float* d_loss_ = nullptr;       // f32 [1] mean loss
  float* h_stats_ = nullptr;      // pinned f32 [3]: loss, grad norm, clip scale
  float dloss_ = 0.f;             // 1 / number of counted targets of the current batch
  int64_t counted_ = 0;

  std::unique_ptr<cuda::CudaBackend> backend_;
  cudaStream_t stream_ = nullptr;  // backend_'s
  cudaGraphExec_t graph_ = nullptr;
  float graph_dloss_ = 0.f;  // dloss baked into the captured graph
  cudaGraphExec_t micro_graph_ = nullptr;  // accumulate(): forward + backward, no zeroing, no update
  float micro_graph_dloss_ = 0.f;          // dloss baked into micro_graph_
  bool warmed_ = false;      // an eager step has run (before the first capture)
  cuda::StepProfile* prof_ = nullptr;
  int64_t graph_launches_ = 0;
};

}  // namespace loom::model

#include "kernels/cuda/common.cuh"
#include "model/gpt_cuda.cuh"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/attn_gemm.cuh"
#include "kernels/cuda/backend.cuh"
#include "kernels/cuda/crossentropy.cuh"
#include "kernels/cuda/cudnn_attention.cuh"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/gelu.cuh"
#include "kernels/cuda/layernorm.cuh"
#include "kernels/cuda/matmul.cuh"
#include "kernels/cuda/profile.cuh"

namespace loom::model {

using cuda::bf16;

namespace {

constexpr int64_t kAlignElems = 128;  // parameter offsets: 256 bytes of bf16, 512 of f32
constexpr int kPerLayer = kBlockParams;  // indices within a layer: model::BlockParam

__global__ void f32_to_bf16_kernel(bf16* out, const float* in, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(in[i]);
}

// out[0] = sum(losses) * scale, one block, fixed order.
__global__ void mean_loss_kernel(float* out, const float* losses, int64_t n, float scale) {
  __shared__ float sh[32];
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += losses[i];
  s = cuda::block_sum(s, sh);
  if (threadIdx.x == 0) out[0] = s * scale;
}

// Captures what `enqueue()` puts on `stream` into a graph and instantiates it. A throw while
// enqueueing ends the capture and discards the partial graph before it propagates.
template <class Enqueue>
cudaGraphExec_t capture_graph(cudaStream_t stream, Enqueue&& enqueue) {
  cudaGraph_t g = nullptr;
  LOOM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    enqueue();
  } catch (...) {
    cudaStreamEndCapture(stream, &g);
    if (g) cudaGraphDestroy(g);
    throw;
  }
  LOOM_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
  cudaGraphExec_t exec = nullptr;
  try {
    LOOM_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
  } catch (...) {
    cudaGraphDestroy(g);
    throw;
  }
  LOOM_CUDA_CHECK(cudaGraphDestroy(g));
  return exec;
}

}  // namespace

std::vector<ParamSpec> cuda_param_specs(const GPTConfig& cfg) {
  cfg.validate("GPTCuda config");
  LOOM_CHECK(cfg.tied_embeddings, "GPTCuda config '{}': untied embeddings (lm_head.weight) are not supported on CUDA",
             cfg.name);
  return gpt_param_specs(cfg);
}

// Saved activations (bf16 unless noted) and backward workspace, all for the options' B x T.
struct GPTCuda::Acts {
  struct Layer {
    bf16* ln1;            // [BT, C]
    float *ln1_mean, *ln1_rstd;  // f32 [BT]
    bf16* qkv;            // [BT, 3C]
    bf16* atty;           // [BT, C]
    bf16* att;            // gemm attention: [B, NH, T, T] probabilities
    float* lse;           // flash attention: f32 [B, NH, T]
    bf16* x2;             // [BT, C] residual after attention
    bf16* ln2;            // [BT, C]
    float *ln2_mean, *ln2_rstd;
    bf16* fch;            // [BT, 4C] before GELU
    bf16* fch_gelu;       // [BT, 4C]
  };
  std::vector<bf16*> x;   // L + 1 residual streams [BT, C]: x[0] embeddings, x[l + 1] after layer l
  std::vector<Layer> layers;
  bf16* lnf;              // [BT, C]
  float *lnf_mean, *lnf_rstd;
  bf16* logits;           // [BT, Vp] (dlogits in place after the fused loss)
  float* losses;          // f32 [BT]
  // Workspace
  bf16* proj;             // [BT, C] projection outputs before the residual add
  bf16* dres;             // [BT, C] residual-stream gradient
  bf16* dln;              // [BT, C]
  bf16* dbig;             // [BT, 4C] (also dqkv [BT, 3C])
  float* dbias_scratch;
  float* ln_scratch;
  void* attn_ws;
  size_t attn_ws_bytes = 0;
};

void* GPTCuda::alloc(size_t bytes, MemTag tag) {
  void* p = pool_.allocate(bytes, tag);
  allocations_.push_back({p, {bytes, tag}});
  return p;
}

GPTCuda::GPTCuda(const GPTConfig& cfg, const GPTCudaOptions& opt, MemoryPool& pool, uint64_t seed)
    : cfg_(cfg), opt_(opt), pool_(pool) {
  // A check, an allocation or cuDNN's planning can throw midway: give back what was taken.
  try {
    build(seed);
  } catch (...) {
    release();
    throw;
  }
}

CudaAttention cuda_attention_from_name(const std::string& name) {
  if (name == "flash") return CudaAttention::flash;
  if (name == "gemm") return CudaAttention::gemm;
  if (name == "cudnn") return CudaAttention::cudnn;
  LOOM_FAIL("attention '{}' is not flash, gemm or cudnn", name);
}

const char* cuda_attention_name(CudaAttention a) {
  return a == CudaAttention::flash ? "flash" : a == CudaAttention::cudnn ? "cudnn" : "gemm";
}

CudaAttention auto_cuda_attention(int64_t head_size) {
  const bool hs = head_size == 64 || head_size == 128;
  if (hs && cuda::cudnn_available() && cuda::cudnn_runtime_version() >= 91600) return CudaAttention::cudnn;
  return cuda::flash_head_size_supported(head_size) ? CudaAttention::flash : CudaAttention::gemm;
}

void GPTCuda::build(uint64_t seed) {
  LOOM_CHECK(pool_.device() == Device::cuda, "GPTCuda: pool '{}' is not a device pool", pool_.name().c_str());
  specs_ = cuda_param_specs(cfg_);
  // Every copy and memset of the model runs on its own (non-blocking) stream, so it is ordered
  // with the model's kernels; the legacy default stream would not be.
  // The CUDA state (stream, BLAS handles and workspaces, tuned algorithms) is the backend
  // instance's, made on the current device over the model's pool.
  BackendOptions bo;
  LOOM_CUDA_CHECK(cudaGetDevice(&bo.device_index));
  bo.pool = &pool_;
  backend_ = std::make_unique<cuda::CudaBackend>(bo);
  stream_ = backend_->stream();
  const int64_t B = opt_.B, T = opt_.T, C = cfg_.n_embd, L = cfg_.n_layer, NH = cfg_.n_head, HS = cfg_.head_size();
  const int64_t Vp = cfg_.padded_vocab(), BT = B * T;
  LOOM_CHECK(B > 0 && T > 0 && T <= cfg_.block_size, "GPTCuda options: need B > 0 and 0 < T <= block_size {} (B={} T={})",
             cfg_.block_size, B, T);
  LOOM_CHECK(C % 8 == 0 && HS % 8 == 0, "GPTCuda config '{}': n_embd {} and head size {} must be multiples of 8",
             cfg_.name.c_str(), C, HS);
  if (opt_.attention != CudaAttention::gemm)
    LOOM_CHECK(cuda::flash_head_size_supported(HS), "GPTCuda: {} attention needs head size 64 or 128, got {} (use gemm attention)",
               cuda_attention_name(opt_.attention), HS);

  for (const ParamSpec& s : specs_) {
    offsets_.push_back(total_);
    total_ += cuda::ceil_div(s.alloc_numel(), kAlignElems) * kAlignElems;
  }
  const size_t nf = size_t(total_) * sizeof(float);
  master_ = static_cast<float*>(alloc(nf, MemTag::params));
  wbf_ = static_cast<bf16*>(alloc(size_t(total_) * sizeof(bf16), MemTag::params));
  grads_ = static_cast<float*>(alloc(nf, MemTag::grads));
  m_ = static_cast<float*>(alloc(nf, MemTag::optimizer));
  v_ = static_cast<float*>(alloc(nf, MemTag::optimizer));
  for (float* p : {master_, grads_, m_, v_}) LOOM_CUDA_CHECK(cudaMemsetAsync(p, 0, nf, stream_));

  std::vector<cuda::AdamWTensor> tensors;
  for (size_t i = 0; i < specs_.size(); ++i) {
    cuda::AdamWTensor t;
    const int64_t o = offsets_[i];
    t.param = master_ + o;
    t.param_bf16 = wbf_ + o;
    t.grad = grads_ + o;
    t.m = m_ + o;
    t.v = v_ + o;
    t.n = specs_[i].alloc_numel();
    t.weight_decay = specs_[i].decay() ? opt_.weight_decay : 0.f;
    tensors.push_back(t);
  }
  adamw_ = std::make_unique<cuda::MultiTensorAdamW>(std::move(tensors), pool_);

  auto bf = [&](int64_t n, MemTag tag) { return static_cast<bf16*>(alloc(size_t(n) * sizeof(bf16), tag)); };
  auto f32 = [&](int64_t n, MemTag tag) { return static_cast<float*>(alloc(size_t(n) * sizeof(float), tag)); };
  const MemTag A = MemTag::activations, W = MemTag::workspace;
  acts_ = std::make_unique<Acts>();
  Acts& a = *acts_;
  for (int64_t l = 0; l <= L; ++l) a.x.push_back(bf(BT * C, A));
  for (int64_t l = 0; l < L; ++l) {
    Acts::Layer y{};
    y.ln1 = bf(BT * C, A);
    y.ln1_mean = f32(BT, A);
    y.ln1_rstd = f32(BT, A);
    y.qkv = bf(BT * 3 * C, A);
    y.atty = bf(BT * C, A);
    if (opt_.attention == CudaAttention::gemm)
      y.att = bf(B * NH * T * T, A);
    else
      y.lse = f32(B * NH * T, A);
    y.x2 = bf(BT * C, A);
    y.ln2 = bf(BT * C, A);
    y.ln2_mean = f32(BT, A);
    y.ln2_rstd = f32(BT, A);
    y.fch = bf(BT * 4 * C, A);
    y.fch_gelu = bf(BT * 4 * C, A);
    a.layers.push_back(y);
  }
  a.lnf = bf(BT * C, A);
  a.lnf_mean = f32(BT, A);
  a.lnf_rstd = f32(BT, A);
  a.logits = bf(BT * Vp, A);
  a.losses = f32(BT, A);
  a.proj = bf(BT * C, W);
  a.dres = bf(BT * C, W);
  a.dln = bf(BT * C, W);
  a.dbig = bf(BT * 4 * C, W);
  a.dbias_scratch = f32(cuda::matmul_dbias_scratch_floats(std::max(Vp, 4 * C)), W);
  a.ln_scratch = f32(cuda::layernorm_backward_scratch_floats(C), W);
  if (opt_.attention == CudaAttention::gemm) {
    a.attn_ws_bytes = cuda::attn_gemm_workspace_bytes({B, T, NH, HS});
  } else {
    cuda::AttnArgs args;
    args.B = B;
    args.NH = NH;
    args.HS = HS;
    args.Tq = args.Tkv = T;
    args.q_stride = args.kv_stride = 3 * C;
    args.o_stride = C;
    if (opt_.attention == CudaAttention::cudnn) {
      try {
        cudnn_attn_ = std::make_unique<cuda::CudnnAttention>(args);
      } catch (const Error& e) {
        if (!opt_.cudnn_falls_back_to_flash || !cuda::flash_head_size_supported(HS)) throw;
        attention_note_ = e.what();
        opt_.attention = CudaAttention::flash;
      }
    }
    if (cudnn_attn_) {
      a.attn_ws_bytes = std::max(cudnn_attn_->forward_workspace_bytes(), cudnn_attn_->backward_workspace_bytes());
    } else {
      a.attn_ws_bytes = cuda::attention_backward_workspace_bytes(args);
    }
  }
  a.attn_ws = a.attn_ws_bytes ? alloc(a.attn_ws_bytes, W) : nullptr;

  d_tokens_ = static_cast<int32_t*>(alloc(size_t(BT) * sizeof(int32_t), A));
  d_targets_ = static_cast<int32_t*>(alloc(size_t(BT) * sizeof(int32_t), A));
  d_loss_ = f32(1, A);
  LOOM_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&h_tokens_), size_t(2 * BT) * sizeof(int32_t)));
  LOOM_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&h_stats_), 3 * sizeof(float)));
  std::memset(h_stats_, 0, 3 * sizeof(float));
  if (opt_.attention == CudaAttention::gemm) (void)backend_->blas().cublas();
  LOOM_CUDA_CHECK(cudaDeviceSynchronize());  // the optimizer's tables were copied on the default stream
  init_weights(seed);
}

GPTCuda::~GPTCuda() { release(); }

void GPTCuda::release() {
  if (graph_) cudaGraphExecDestroy(graph_);
  if (micro_graph_) cudaGraphExecDestroy(micro_graph_);
  if (stream_) cudaStreamSynchronize(stream_);
  cudnn_attn_.reset();  // its cuDNN handle runs on stream_
  cudaFreeHost(h_tokens_);
  cudaFreeHost(h_stats_);
  adamw_.reset();
  for (auto it = allocations_.rbegin(); it != allocations_.rend(); ++it)
    pool_.deallocate(it->first, it->second.first, it->second.second);
  allocations_.clear();
  backend_.reset();  // the stream and the BLAS state, last
  graph_ = micro_graph_ = nullptr;
  stream_ = nullptr;
  h_tokens_ = nullptr;
  h_stats_ = nullptr;
}

int64_t GPTCuda::num_parameters() const {
  int64_t n = 0;
  for (const ParamSpec& s : specs_) n += s.numel();
  return n;
}

void GPTCuda::refresh_bf16() {
  f32_to_bf16_kernel<<<1024, 256, 0, stream_>>>(wbf_, master_, total_);
  LOOM_CUDA_LAUNCH_CHECK();
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void GPTCuda::init_weights(uint64_t seed) {
  std::vector<float> host(size_t(total_), 0.f);
  for (size_t i = 0; i < specs_.size(); ++i) init_values(specs_[i], seed, host.data() + offsets_[i], 0, specs_[i].numel());
  LOOM_CUDA_CHECK(
      cudaMemcpyAsync(master_, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice, stream_));
  LOOM_CUDA_CHECK(cudaMemsetAsync(m_, 0, size_t(total_) * sizeof(float), stream_));
  LOOM_CUDA_CHECK(cudaMemsetAsync(v_, 0, size_t(total_) * sizeof(float), stream_));
  refresh_bf16();  // synchronises the stream, so `host` outlives the copy
}

static size_t find_spec(const std::vector<ParamSpec>& specs, const std::string& name) {
  for (size_t i = 0; i < specs.size(); ++i)
    if (specs[i].name == name) return i;
  throw Error(fmt::format("GPTCuda: no parameter named '{}'", name));
}

void GPTCuda::set_parameter(const std::string& name, const float* values) {
  upload(master_, name, values);
  refresh_bf16();
}

std::vector<float> GPTCuda::parameter(const std::string& name) const { return download(master_, name); }
std::vector<float> GPTCuda::gradient(const std::string& name) const { return download(grads_, name); }

std::vector<float> GPTCuda::logits() const {
  const int64_t n = opt_.B * opt_.T * cfg_.padded_vocab();
  std::vector<uint16_t> raw(static_cast<size_t>(n));
  LOOM_CUDA_CHECK(
      cudaMemcpyAsync(raw.data(), acts_->logits, size_t(n) * sizeof(bf16), cudaMemcpyDeviceToHost, stream_));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::vector<float> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = uint32_t(raw[size_t(i)]) << 16;
    std::memcpy(&out[size_t(i)], &u, 4);
  }
  return out;
}

void GPTCuda::upload_batch(const int32_t* tokens, const int32_t* targets) {
  const int64_t BT = opt_.B * opt_.T, V = cfg_.vocab_size;
  LOOM_CHECK(tokens && targets, "GPTCuda: tokens and targets must be given");
  cuda::check_token_ids(tokens, BT, V, "GPTCuda tokens");
  int64_t counted = 0;
  for (int64_t i = 0; i < BT; ++i) {
    LOOM_CHECK(targets[i] >= -1 && targets[i] < V, "GPTCuda targets: id {} at position {} is outside [-1, {})",
               targets[i], i, V);
    counted += targets[i] != -1;
  }
  // The previous step has completed (every entry point synchronises), so the staging is free.
  std::memcpy(h_tokens_, tokens, size_t(BT) * sizeof(int32_t));
  std::memcpy(h_tokens_ + BT, targets, size_t(BT) * sizeof(int32_t));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(d_tokens_, h_tokens_, size_t(BT) * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  LOOM_CUDA_CHECK(
      cudaMemcpyAsync(d_targets_, h_tokens_ + BT, size_t(BT) * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
  counted_ = counted;
  dloss_ = counted > 0 ? 1.f / float(counted) : 0.f;
}

void GPTCuda::enqueue_forward(bool fused_loss_grad) {
  Acts& a = *acts_;
  cuda::Blas& blas = backend_->blas();
  const int64_t B = opt_.B, T = opt_.T, C = cfg_.n_embd, L = cfg_.n_layer, NH = cfg_.n_head, HS = cfg_.head_size();
  const int64_t V = cfg_.vocab_size, Vp = cfg_.padded_vocab(), BT = B * T;
  const float eps = cfg_.ln_eps;
  cudaStream_t s = stream_;
  auto W = [&](size_t i) { return wbf_ + offsets_[i]; };

  // FLOPs of the marks: 2 per multiply-add of each GEMM; attention as FlashAttention-2 counts
  // it (causal: half of 4 B T^2 C), its backward 2.5 times that.
  const double gemm = 2.0 * double(BT) * double(C), attn = 2.0 * double(B) * double(T) * double(T) * double(C);
  cuda::embedding_forward(a.x[0], d_tokens_, W(0), W(1), B, T, C, V, s);
  cuda::layernorm_forward(a.layers[0].ln1, a.layers[0].ln1_mean, a.layers[0].ln1_rstd, a.x[0], W(2 + kLn1W),
                          W(2 + kLn1B), BT, C, s, eps);
  mark("fwd embedding + layernorm");
  for (int64_t l = 0; l < L; ++l) {
    Acts::Layer& y = a.layers[size_t(l)];
    const size_t p = size_t(2 + kPerLayer * l);
    cuda::matmul_forward(blas, {y.qkv, nullptr, y.ln1, W(p + kQkvW), W(p + kQkvB), BT, C, 3 * C, false}, s);
    mark("fwd qkv matmul", gemm * 3 * double(C));
    if (opt_.attention == CudaAttention::gemm) {
      cuda::attn_gemm_forward(blas, y.atty, y.att, y.qkv, {B, T, NH, HS}, a.attn_ws, s);
    } else if (opt_.attention == CudaAttention::cudnn) {
      cudnn_attn_->forward(y.atty, y.lse, y.qkv, y.qkv + C, y.qkv + 2 * C, a.attn_ws, s);
    } else {
      cuda::AttnArgs args;
      args.B = B;
      args.NH = NH;
      args.HS = HS;
      args.Tq = args.Tkv = T;
      args.q_stride = args.kv_stride = 3 * C;
      args.o_stride = C;
      cuda::attention_forward(y.atty, y.lse, y.qkv, y.qkv + C, y.qkv + 2 * C, args, s);
    }
    mark("fwd attention", attn);
    cuda::matmul_forward(blas, {a.proj, nullptr, y.atty, W(p + kAttnProjW), W(p + kAttnProjB), BT, C, C, false}, s);
    mark("fwd attn-proj matmul", gemm * double(C));
    cuda::residual_layernorm_forward(y.x2, y.ln2, y.ln2_mean, y.ln2_rstd, a.x[size_t(l)], a.proj, W(p + kLn2W),
                                     W(p + kLn2B), BT, C, s, eps);
    mark("fwd residual + layernorm");
    cuda::matmul_forward(blas, {y.fch_gelu, y.fch, y.ln2, W(p + kFcW), W(p + kFcB), BT, C, 4 * C, true}, s);
    mark("fwd fc matmul + gelu", gemm * 4 * double(C));
    cuda::matmul_forward(blas, {a.proj, nullptr, y.fch_gelu, W(p + kMlpProjW), W(p + kMlpProjB), BT, 4 * C, C, false}, s);
    mark("fwd mlp-proj matmul", gemm * 4 * double(C));
    if (l + 1 < L) {
      Acts::Layer& z = a.layers[size_t(l + 1)];
      const size_t q = p + kPerLayer;
      cuda::residual_layernorm_forward(a.x[size_t(l + 1)], z.ln1, z.ln1_mean, z.ln1_rstd, y.x2, a.proj, W(q + kLn1W),
                                       W(q + kLn1B), BT, C, s, eps);
    } else {
      const size_t f = size_t(2 + kPerLayer * L);
      cuda::residual_layernorm_forward(a.x[size_t(L)], a.lnf, a.lnf_mean, a.lnf_rstd, y.x2, a.proj, W(f), W(f + 1), BT,
                                       C, s, eps);
    }
    mark("fwd residual + layernorm");
  }
  // logits [BT, Vp] = lnf @ wte^T (tied; padding rows of wte are zero, so padding logits are 0)
  cuda::matmul_forward(blas, {a.logits, nullptr, a.lnf, W(0), nullptr, BT, C, Vp, false}, s);
  mark("fwd logits matmul", gemm * double(Vp));
  if (fused_loss_grad)
    cuda::crossentropy_forward_backward(a.losses, a.logits, a.logits, d_targets_, dloss_, BT, V, Vp, s);
  else
    cuda::crossentropy_forward(a.losses, a.logits, d_targets_, BT, V, Vp, s);
  mean_loss_kernel<<<1, 1024, 0, s>>>(d_loss_, a.losses, BT, dloss_);
  LOOM_CUDA_LAUNCH_CHECK();
  mark(fused_loss_grad ? "fwd cross-entropy + dlogits" : "fwd cross-entropy");
}

void GPTCuda::enqueue_backward() {
  Acts& a = *acts_;
  cuda::Blas& blas = backend_->blas();
  const int64_t B = opt_.B, T = opt_.T, C = cfg_.n_embd, L = cfg_.n_layer, NH = cfg_.n_head, HS = cfg_.head_size();
  const int64_t V = cfg_.vocab_size, Vp = cfg_.padded_vocab(), BT = B * T;
  cudaStream_t s = stream_;
  auto W = [&](size_t i) { return wbf_ + offsets_[i]; };
  auto G = [&](size_t i) { return grads_ + offsets_[i]; };
  const size_t f = size_t(2 + kPerLayer * L);
  const double gemm = 4.0 * double(BT) * double(C), attn = 5.0 * double(B) * double(T) * double(T) * double(C);

  // lm_head (tied with wte): dlnf = dlogits @ wte; dwte += dlogits^T @ lnf
  cuda::MatmulBwdArgs head;
  head.dinp = a.dln;
  head.dweight = G(0);
  head.dout = a.logits;
  head.inp = a.lnf;
  head.weight = W(0);
  head.M = BT;
  head.K = C;
  head.N = Vp;
  cuda::matmul_backward(blas, head, s);
  mark("bwd logits matmul", gemm * double(Vp));
  cuda::layernorm_backward(a.dres, G(f), G(f + 1), a.dln, a.x[size_t(L)], W(f), a.lnf_mean, a.lnf_rstd, BT, C, false,
                           a.ln_scratch, s);
  mark("bwd layernorm");
  for (int64_t l = L - 1; l >= 0; --l) {
    Acts::Layer& y = a.layers[size_t(l)];
    const size_t p = size_t(2 + kPerLayer * l);
    // MLP projection (and GELU): dres is d x[l + 1], also d of the projection's output.
    cuda::MatmulBwdArgs fcp;
    fcp.dinp = a.dbig;
    fcp.dweight = G(p + kMlpProjW);
    fcp.dbias = G(p + kMlpProjB);
    fcp.dout = a.dres;
    fcp.inp = y.fch_gelu;
    fcp.weight = W(p + kMlpProjW);
    fcp.dinp_gelu_pre = opt_.fuse_dgelu ? y.fch : nullptr;
    fcp.M = BT;
    fcp.K = 4 * C;
    fcp.N = C;
    fcp.dbias_scratch = a.dbias_scratch;
    cuda::matmul_backward(blas, fcp, s);
    if (!opt_.fuse_dgelu) cuda::gelu_backward(a.dbig, y.fch, a.dbig, BT * 4 * C, s);
    mark("bwd mlp-proj matmul + dgelu", gemm * 4 * double(C));
    cuda::MatmulBwdArgs fc;
    fc.dinp = a.dln;
    fc.dweight = G(p + kFcW);
    fc.dbias = G(p + kFcB);
    fc.dout = a.dbig;
    fc.inp = y.ln2;
    fc.weight = W(p + kFcW);
    fc.M = BT;
    fc.K = C;
    fc.N = 4 * C;
    fc.dbias_scratch = a.dbias_scratch;
    cuda::matmul_backward(blas, fc, s);
    mark("bwd fc matmul", gemm * 4 * double(C));
    cuda::layernorm_backward(a.dres, G(p + kLn2W), G(p + kLn2B), a.dln, y.x2, W(p + kLn2W), y.ln2_mean, y.ln2_rstd, BT,
                             C, true, a.ln_scratch, s);
    mark("bwd layernorm");
    // Attention projection: dres is now d x2.
    cuda::MatmulBwdArgs proj;
    proj.dinp = a.dln;
    proj.dweight = G(p + kAttnProjW);
    proj.dbias = G(p + kAttnProjB);
    proj.dout = a.dres;
    proj.inp = y.atty;
    proj.weight = W(p + kAttnProjW);
    proj.M = BT;
    proj.K = C;
    proj.N = C;
    proj.dbias_scratch = a.dbias_scratch;
    cuda::matmul_backward(blas, proj, s);
    mark("bwd attn-proj matmul", gemm * double(C));
    bf16* dqkv = a.dbig;  // [BT, 3C]
    if (opt_.attention == CudaAttention::gemm) {
      cuda::attn_gemm_backward(blas, dqkv, y.att, a.dln, y.qkv, {B, T, NH, HS}, a.attn_ws, s);
    } else if (opt_.attention == CudaAttention::cudnn) {
      cudnn_attn_->backward(dqkv, dqkv + C, dqkv + 2 * C, a.dln, y.qkv, y.qkv + C, y.qkv + 2 * C, y.atty, y.lse,
                            a.attn_ws, s);
    } else {
      cuda::AttnArgs args;
      args.B = B;
      args.NH = NH;
      args.HS = HS;
      args.Tq = args.Tkv = T;
      args.q_stride = args.kv_stride = 3 * C;
      args.o_stride = C;
      cuda::attention_backward(dqkv, dqkv + C, dqkv + 2 * C, a.dln, y.qkv, y.qkv + C, y.qkv + 2 * C, y.atty, y.lse,
                               args, a.attn_ws, s);
    }
    mark("bwd attention", attn);
    cuda::MatmulBwdArgs qkv;
    qkv.dinp = a.dln;
    qkv.dweight = G(p + kQkvW);
    qkv.dbias = G(p + kQkvB);
    qkv.dout = dqkv;
    qkv.inp = y.ln1;
    qkv.weight = W(p + kQkvW);
    qkv.M = BT;
    qkv.K = C;
    qkv.N = 3 * C;
    qkv.dbias_scratch = a.dbias_scratch;
    cuda::matmul_backward(blas, qkv, s);
    mark("bwd qkv matmul", gemm * 3 * double(C));
    cuda::layernorm_backward(a.dres, G(p + kLn1W), G(p + kLn1B), a.dln, a.x[size_t(l)], W(p + kLn1W), y.ln1_mean,
                             y.ln1_rstd, BT, C, true, a.ln_scratch, s);
    mark("bwd layernorm");
  }
  cuda::embedding_backward(G(0), G(1), a.dres, d_tokens_, B, T, C, V, s);
  mark("bwd embedding");
}

float GPTCuda::read_loss() {
  LOOM_CUDA_CHECK(cudaMemcpyAsync(h_stats_, d_loss_, sizeof(float), cudaMemcpyDeviceToHost, stream_));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return h_stats_[0];
}

float GPTCuda::forward(const int32_t* tokens, const int32_t* targets) {
  upload_batch(tokens, targets);
  enqueue_forward(false);
  return read_loss();
}

float GPTCuda::forward_backward(const int32_t* tokens, const int32_t* targets) {
  upload_batch(tokens, targets);
  zero_grad();
  enqueue_micro();
  return read_loss();
}

void GPTCuda::enqueue_step() {
  zero_grad();
  mark("upload batch + zero grads");
  enqueue_micro();
  enqueue_update();
}

void GPTCuda::enqueue_update() {
  adamw_->launch(stream_);
  LOOM_CUDA_CHECK(cudaMemcpyAsync(h_stats_ + 1, adamw_->norm_and_scale(), 2 * sizeof(float), cudaMemcpyDeviceToHost,
                                  stream_));
  mark("adamw (norm, clip, update, bf16 copy)");
}

void GPTCuda::mark(const char* part, double flops) {
  if (prof_) prof_->mark(part, flops);
}

void GPTCuda::set_adamw_hyper(float lr, int64_t step, float grad_scale) {
  cuda::AdamWHyper h;
  h.lr = lr;
  h.beta1 = opt_.beta1;
  h.beta2 = opt_.beta2;
  h.eps = opt_.eps;
  h.step = step;
  h.max_norm = opt_.grad_clip;
  h.grad_scale = grad_scale;
  adamw_->set_hyper(h);
}

void GPTCuda::enqueue_micro() {
  enqueue_forward(true);
  enqueue_backward();
}

void GPTCuda::run_graphed(cudaGraphExec_t& exec, float& exec_dloss, void (GPTCuda::*enqueue)()) {
  if (exec && exec_dloss != dloss_) {
    LOOM_CUDA_CHECK(cudaGraphExecDestroy(exec));
    exec = nullptr;
  }
  if (!opt_.cuda_graph || !warmed_ || prof_) {
    (this->*enqueue)();
    warmed_ = true;
    return;
  }
  if (!exec) {
    exec = capture_graph(stream_, [&] { (this->*enqueue)(); });
    exec_dloss = dloss_;
  }
  LOOM_CUDA_CHECK(cudaGraphLaunch(exec, stream_));
  ++graph_launches_;
}

float GPTCuda::train_step(const int32_t* tokens, const int32_t* targets, float lr, int64_t step) {
  upload_batch(tokens, targets);
  set_adamw_hyper(lr, step, 1.f);
  run_graphed(graph_, graph_dloss_, &GPTCuda::enqueue_step);
  return read_loss();
}

void GPTCuda::zero_grad() { LOOM_CUDA_CHECK(cudaMemsetAsync(grads_, 0, size_t(total_) * sizeof(float), stream_)); }

float GPTCuda::accumulate(const int32_t* tokens, const int32_t* targets) {
  upload_batch(tokens, targets);
  run_graphed(micro_graph_, micro_graph_dloss_, &GPTCuda::enqueue_micro);
  return read_loss();
}

float GPTCuda::optimizer_step(float lr, int64_t step, float grad_scale) {
  set_adamw_hyper(lr, step, grad_scale);
  enqueue_update();
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return h_stats_[1];
}

std::vector<float> GPTCuda::download(const float* base, const std::string& name) const {
  const size_t i = find_spec(specs_, name);
  std::vector<float> out(size_t(specs_[i].numel()));
  LOOM_CUDA_CHECK(
      cudaMemcpyAsync(out.data(), base + offsets_[i], out.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return out;
}

void GPTCuda::upload(float* base, const std::string& name, const float* values) {
  const size_t i = find_spec(specs_, name);
  LOOM_CHECK(values, "GPTCuda: no values given for '{}'", name);
  LOOM_CUDA_CHECK(cudaMemcpyAsync(base + offsets_[i], values, size_t(specs_[i].numel()) * sizeof(float),
                                  cudaMemcpyHostToDevice, stream_));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // `values` may be freed on return
}

std::vector<float> GPTCuda::exp_avg(const std::string& name) const { return download(m_, name); }
std::vector<float> GPTCuda::exp_avg_sq(const std::string& name) const { return download(v_, name); }
void GPTCuda::set_exp_avg(const std::string& name, const float* values) { upload(m_, name, values); }
void GPTCuda::set_exp_avg_sq(const std::string& name, const float* values) { upload(v_, name, values); }

}  // namespace loom::model

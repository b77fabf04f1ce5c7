#include "kernels/cuda/backend.cuh"

#include <cmath>
#include <cstring>
#include <type_traits>

#include "core/error.h"
#include "kernels/cuda/adamw.cuh"
#include "kernels/cuda/allocator.cuh"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/attn_gemm.cuh"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/crossentropy.cuh"
#include "kernels/cuda/cudnn_attention.cuh"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/gelu.cuh"
#include "kernels/cuda/layernorm.cuh"
#include "kernels/cuda/llama.cuh"

namespace loom::cuda {

namespace {

// The ops' 16-bit buffers as the element type T of the call (bf16 or f16, LOOM_CUDA_DISPATCH_16).
template <class T>
const T* h(const void* p) {
  return static_cast<const T*>(p);
}
template <class T>
T* h(void* p) {
  return static_cast<T*>(p);
}
#define LOOM_T std::remove_pointer_t<decltype(tag)>

AttnArgs attn_args(const AttnShape& s) { return attn_args_of<AttnArgs>(s); }

// The GEMM kernels take GPT-2's packed self-attention only: q, k, v the columns of one
// [B, T, 3C] buffer, the output [B, T, C], causal from position 0, the default scale.
bool gemm_takes(const AttnShape& s) {
  const int64_t C = s.NH * s.HS;
  return s.kv_heads() == s.NH && s.Tq == s.Tkv && s.q_stride == 3 * C && s.kv_stride == 3 * C && s.o_stride == C && s.q_pos0 == 0 &&
         s.kv_pos0 == 0 && s.causal && (s.scale == 0.f || s.scale == 1.f / std::sqrt(float(s.HS))) && s.HS % 8 == 0;
}

__global__ void add_f32_kernel(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = a[i] + b[i];
}

template <class T>
__global__ void add_kernel(T* out, const T* a, const T* b, int64_t n) {
  const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (i + 8 <= n) {
    const Vec8<T> x = *reinterpret_cast<const Vec8<T>*>(a + i), y = *reinterpret_cast<const Vec8<T>*>(b + i);
    Vec8<T> o;
#pragma unroll
    for (int k = 0; k < 8; ++k) o.v[k] = from_f32<T>(to_f32(x.v[k]) + to_f32(y.v[k]));
    *reinterpret_cast<Vec8<T>*>(out + i) = o;
  } else {
    for (int64_t j = i; j < n; ++j) out[j] = from_f32<T>(to_f32(a[j]) + to_f32(b[j]));
  }
}

__device__ __forceinline__ float load_f32(float x) { return x; }
__device__ __forceinline__ float load_f32(bf16 x) { return to_f32(x); }
__device__ __forceinline__ float load_f32(f16 x) { return to_f32(x); }
template <class T>
__device__ __forceinline__ T store_f32(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return from_f32<T>(x);
}

// StridedCopy with a conversion or accumulation (same-type copies go to cudaMemcpy2DAsync): one
// thread per element; a single row (Copy's conversions) indexes without divisions.
template <class D, class S>
__global__ void copy_strided_kernel(D* dst, const S* src, int64_t rows, int64_t cols, int64_t total, int64_t dst_row,
                                    int64_t dst_batch, int64_t src_row, int64_t src_batch, bool accumulate) {
  const bool one_row = total == cols;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = one_row ? i : i % cols, r = one_row ? 0 : (i / cols) % rows, b = one_row ? 0 : i / (cols * rows);
    const float x = load_f32(src[b * src_batch + r * src_row + c]);
    D* d = dst + b * dst_batch + r * dst_row + c;
    if constexpr (std::is_same_v<D, float>) *d = accumulate ? *d + x : x;
    else *d = store_f32<D>(x);
  }
}

// AttentionMerge: one warp per (b, h, t) row, its lanes over the head's elements.
template <class T>
__global__ void attention_merge_kernel(float* out, float* lse, const T* part, const float* part_lse, int64_t B,
                                       int64_t NH, int64_t HS, int64_t Tq, int64_t o_row, int64_t o_batch,
                                       int64_t lse_batch, bool init) {
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = int(threadIdx.x % 32);
  if (row >= B * NH * Tq) return;
  const int64_t t = row % Tq, h = (row / Tq) % NH, b = row / (Tq * NH);
  float* l = lse + b * lse_batch + h * Tq + t;
  float* o = out + b * o_batch + t * o_row + h * HS;
  const T* p = part + (b * Tq + t) * NH * HS + h * HS;
  const double lb = part_lse[(b * NH + h) * Tq + t];
  const double la = init ? -double(INFINITY) : double(*l);
  __syncwarp();  // every lane has read lse before lane 0 writes it
  if (!init && isinf(lb) && lb < 0) return;  // no visible key in this block
  if (isinf(la) && la < 0) {
    for (int64_t d = lane; d < HS; d += 32) o[d] = load_f32(p[d]);
    if (lane == 0) *l = float(lb);
    return;
  }
  const double m = fmax(la, lb), wa = exp(la - m), wb = exp(lb - m), sum = wa + wb;
  const double ca = wa / sum, cb = wb / sum;
  for (int64_t d = lane; d < HS; d += 32) o[d] = float(ca * double(o[d]) + cb * double(load_f32(p[d])));
  if (lane == 0) *l = float(m + log(sum));
}

// Host conversions between f32 and a 16-bit type (the same rounding as the device's: to nearest
// even); same-type copies as they are.
void convert_on_host(void* dst, DType dt, const void* src, DType st, int64_t n) {
  if (dt == st) {
    std::memcpy(dst, src, size_t(n) * dtype_size(dt));
  } else if (dt == DType::f32 && st == DType::bf16) {
    loom::bf16_to_f32(static_cast<float*>(dst), static_cast<const loom::bf16*>(src), n);
  } else if (dt == DType::bf16 && st == DType::f32) {
    loom::f32_to_bf16(static_cast<loom::bf16*>(dst), static_cast<const float*>(src), n);
  } else if (dt == DType::f32 && st == DType::f16) {
    for (int64_t i = 0; i < n; ++i) static_cast<float*>(dst)[i] = __half2float(static_cast<const f16*>(src)[i]);
  } else if (dt == DType::f16 && st == DType::f32) {
    for (int64_t i = 0; i < n; ++i) static_cast<f16*>(dst)[i] = __float2half_rn(static_cast<const float*>(src)[i]);
  } else {
    LOOM_FAIL("copy: no conversion from {} to {}", dtype_name(st), dtype_name(dt));
  }
}

// out[0] = scale * sum(x): one block, a fixed order (each thread a strided partial sum, then the
// block's fixed-order reduction).
__global__ void sum_kernel(float* out, const float* x, int64_t n, float scale) {
  __shared__ float shared[32];
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
  s = block_sum(s, shared);
  if (threadIdx.x == 0) out[0] = scale * s;
}

// FlashAttention-2's count: 4 B NH Tq Tkv HS for the two products, halved under a causal mask
// over a square block.
double attention_flops(const AttnShape& s) {
  const double f = 4.0 * double(s.B) * double(s.NH) * double(s.HS) * double(s.Tq) * double(s.Tkv);
  return s.causal && s.Tq == s.Tkv ? 0.5 * f : f;
}

class CudaAdamW final : public AdamWPlan {
 public:
  CudaAdamW(const std::vector<loom::AdamWTensor>& t, DType compute, MemoryPool& pool, cudaStream_t stream, int device,
            Backend* be)
      : stream_(stream), device_(device), be_(be) {
    std::vector<cuda::AdamWTensor> list;
    list.reserve(t.size());
    for (const loom::AdamWTensor& x : t) {
      LOOM_CHECK(x.param && x.grad && x.m && x.v && x.n >= 0, "adamw plan: a tensor without param, grad or moments");
      cuda::AdamWTensor y;
      y.param = x.param;
      if (compute == DType::f16)
        y.param_f16 = static_cast<f16*>(x.compute);
      else
        y.param_bf16 = static_cast<bf16*>(x.compute);
      y.grad = x.grad;
      y.m = x.m;
      y.v = x.v;
      y.n = x.n;
      y.weight_decay = float(x.weight_decay);
      list.push_back(y);
    }
    impl_ = std::make_unique<MultiTensorAdamW>(std::move(list), pool);
  }
  void set_hyper(const loom::AdamWHyper& hp) override {
    LOOM_CUDA_CHECK(cudaSetDevice(device_));
    // The hyperparameters are read from pinned memory by the enqueued work: the last launch must
    // have read them before they change.
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    cuda::AdamWHyper x;
    x.lr = float(hp.lr);
    x.beta1 = float(hp.beta1);
    x.beta2 = float(hp.beta2);
    x.eps = float(hp.eps);
    x.step = hp.step;
    x.max_norm = hp.max_norm;
    x.grad_scale = hp.grad_scale;
    x.global_norm = float(hp.global_norm);
    impl_->set_hyper(x);
  }
  void launch() override {
    LOOM_CUDA_CHECK(cudaSetDevice(device_));
    impl_->launch(stream_);
    if (be_->observer()) be_->observer()->op_done("adamw", 0);
  }
  double grad_norm() override {
    LOOM_CUDA_CHECK(cudaSetDevice(device_));
    float v[2] = {0.f, 0.f};
    LOOM_CUDA_CHECK(cudaMemcpyAsync(v, impl_->norm_and_scale(), sizeof(v), cudaMemcpyDeviceToHost, stream_));
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return double(v[0]);
  }

 private:
  cudaStream_t stream_;
  int device_;
  Backend* be_;
  std::unique_ptr<MultiTensorAdamW> impl_;
};

}  // namespace

struct CudaBackend::Plan {
  AttnKernel kernel = AttnKernel::flash;
  std::unique_ptr<CudnnAttention> cudnn;
  size_t workspace = 0;  // bytes the forward and backward calls need
};

CudaBackend::CudaBackend(const BackendOptions& opt)
    : device_(opt.device_index), dtype_(opt.compute), requested_(opt.attention) {
  LOOM_CHECK(dtype_ == DType::bf16 || dtype_ == DType::f16,
             "cuda backend: the compute dtype must be bf16 or f16 (f32 master weights and accumulation), got {}",
             dtype_name(dtype_));
  int count = 0;
  LOOM_CUDA_CHECK(cudaGetDeviceCount(&count));
  LOOM_CHECK(device_ >= 0 && device_ < count, "cuda backend: device {} does not exist ({} GPUs)", device_, count);
  LOOM_CHECK(requested_ != AttnKernel::tiled, "cuda backend: attention kernel 'tiled' is the CPU's (CUDA: flash, cudnn, gemm)");
  activate();
  cudaDeviceProp prop{};
  LOOM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
  name_ = "cuda:" + std::to_string(device_) + " (" + prop.name + ")";
  if (opt.pool) {
    LOOM_CHECK(opt.pool->device() == Device::cuda, "cuda backend: pool '{}' is not a device pool", opt.pool->name().c_str());
    pool_ = opt.pool;
  } else {
    own_alloc_ = std::make_unique<ArenaAllocator>(size_t(256) << 20, device_);
    own_pool_ = std::make_unique<MemoryPool>("cuda:" + std::to_string(device_), own_alloc_.get());
    pool_ = own_pool_.get();
  }
  // Every copy and memset runs on the instance's own non-blocking stream, ordered with its kernels.
  LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  try {
    blas_ = std::make_unique<Blas>(*pool_, opt.gemm_tune);
  } catch (...) {
    cudaStreamDestroy(stream_);
    throw;
  }
}

CudaBackend::~CudaBackend() {
  cudaSetDevice(device_);
  cudaStreamSynchronize(stream_);
  plans_.clear();
  if (dbias_scratch_) pool_->deallocate(dbias_scratch_, dbias_bytes_, MemTag::workspace);
  if (ln_scratch_) pool_->deallocate(ln_scratch_, ln_bytes_, MemTag::workspace);
  if (attn_ws_) pool_->deallocate(attn_ws_, attn_ws_bytes_, MemTag::workspace);
  for (int i = 0; i < 2; ++i) {
    if (stage_[i]) pinned_host_allocator().deallocate(stage_[i], kStageBytes);
    if (stage_free_[i]) cudaEventDestroy(stage_free_[i]);
  }
  blas_.reset();
  cudaStreamDestroy(stream_);
}

void CudaBackend::ensure_stage() {
  for (int i = 0; i < 2; ++i) {
    // Page-locked where the host allows it, else pageable (with the allocator's one-time note): the
    // copies then run at pageable memory's rate, and are as correct.
    if (!stage_[i]) stage_[i] = pinned_host_allocator().allocate(kStageBytes);
    if (!stage_free_[i]) LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&stage_free_[i], cudaEventDisableTiming));
  }
}

void CudaBackend::activate() const {
  int current = -1;
  LOOM_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device_) LOOM_CUDA_CHECK(cudaSetDevice(device_));
}

bool CudaBackend::capturing() const { return stream_capturing(stream_); }

namespace {
class CudaGraph final : public Graph {
 public:
  CudaGraph(cudaGraphExec_t exec, cudaStream_t stream, int device) : exec_(exec), stream_(stream), device_(device) {}
  ~CudaGraph() override { cudaGraphExecDestroy(exec_); }
  void replay() override {
    LOOM_CUDA_CHECK(cudaSetDevice(device_));
    LOOM_CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
  }

 private:
  cudaGraphExec_t exec_;
  cudaStream_t stream_;
  int device_;
};
}  // namespace

void CudaBackend::begin_capture() {
  activate();
  LOOM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
}

std::unique_ptr<Graph> CudaBackend::end_capture() {
  activate();
  cudaGraph_t g = nullptr;
  LOOM_CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, g, 0);
  cudaGraphDestroy(g);
  LOOM_CUDA_CHECK(err);
  return std::make_unique<CudaGraph>(exec, stream_, device_);
}

bool CudaBackend::supports(Op op, DType dtype) const {
  // Copies also move i32 (token ids, targets) between host and device, without conversion.
  // Every op takes both 16-bit types (the model computes in compute_dtype()).
  if (op == Op::copy) return dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16 || dtype == DType::i32;
  if (op == Op::add && dtype == DType::f32) return true;  // gradient sums
  return dtype == DType::bf16 || dtype == DType::f16;
}

void CudaBackend::check(Op op, DType dtype) const {
  LOOM_CHECK(supports(op, dtype), "cuda backend: {} in {} is not supported (bf16 or f16 with f32 accumulation)",
             op_name(op), dtype_name(dtype));
  activate();
}

void CudaBackend::sum(const float* x, int64_t n, float scale, float* out) {
  activate();
  LOOM_CHECK(n >= 0, "sum: negative size {}", n);
  sum_kernel<<<1, 1024, 0, stream_>>>(out, x, n, scale);
  LOOM_CUDA_LAUNCH_CHECK();
  observed("sum");
}

void CudaBackend::synchronize() {
  activate();
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void* CudaBackend::grow(void*& p, size_t& have, size_t bytes, const char* what) {
  if (bytes <= have) return p;
  LOOM_CHECK(!capturing(),
             "cuda backend: {} needs {} bytes of scratch while a CUDA graph is being captured (run the step once "
             "before capturing it)",
             what, bytes);
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // the old buffer may still be in use
  if (p) pool_->deallocate(p, have, MemTag::workspace);
  memory_moved();
  p = nullptr;
  have = 0;
  p = pool_->allocate(bytes, MemTag::workspace);
  have = bytes;
  return p;
}

void CudaBackend::linear_forward(const LinearForward& a) {
  check(Op::linear, a.dtype);
  MatmulFwdArgs m;
  m.dtype = a.dtype;
  m.out = a.out;
  m.pre_gelu = a.pre_gelu;
  m.inp = a.inp;
  m.weight = a.weight;
  m.bias = a.bias;
  m.M = a.M;
  m.K = a.K;
  m.N = a.N;
  m.gelu = a.gelu;
  m.residual = a.residual;
  matmul_forward(*blas_, m, stream_);
  observed(a.gelu ? "linear forward + gelu" : "linear forward", 2.0 * double(a.M) * double(a.N) * double(a.K));
}

void CudaBackend::linear_backward(const LinearBackward& a) {
  check(Op::linear, a.dtype);
  LOOM_CHECK(!(a.gelu_pre && a.accumulate_dinp), "linear_backward: gelu_pre with accumulate_dinp");
  MatmulBwdArgs m;
  m.dtype = a.dtype;
  m.dinp = a.dinp;
  m.accumulate_dinp = a.accumulate_dinp;
  m.dweight = a.dweight;
  m.dbias = a.dbias;
  m.dout = a.dout;
  m.inp = a.inp;
  m.weight = a.weight;
  m.dinp_gelu_pre = a.gelu_pre;
  m.M = a.M;
  m.K = a.K;
  m.N = a.N;
  if (a.dbias)
    m.dbias_scratch = static_cast<float*>(
        grow(dbias_scratch_, dbias_bytes_, size_t(matmul_dbias_scratch_floats(a.N)) * sizeof(float), "the bias gradient"));
  matmul_backward(*blas_, m, stream_);
  const double gemm = 2.0 * double(a.M) * double(a.N) * double(a.K);
  observed(a.gelu_pre ? "linear backward + dgelu" : "linear backward", (a.dinp ? gemm : 0.0) + (a.dweight ? gemm : 0.0));
}

void CudaBackend::layernorm_forward(const LayerNormForward& a) {
  check(a.rms ? Op::rmsnorm : Op::layernorm, a.dtype);
  LOOM_CHECK(!a.residual_b || a.residual_out, "layernorm_forward: residual_b without residual_out");
  LOOM_CUDA_DISPATCH_16(a.dtype, "layernorm_forward", [&](auto* tag) {
    using T = LOOM_T;
    if (a.residual_b)
      residual_layernorm_forward(h<T>(a.residual_out), h<T>(a.out), a.mean, a.rstd, h<T>(a.inp), h<T>(a.residual_b),
                                 h<T>(a.weight), h<T>(a.bias), a.N, a.C, stream_, a.eps, a.rms);
    else
      cuda::layernorm_forward(h<T>(a.out), a.mean, a.rstd, h<T>(a.inp), h<T>(a.weight), h<T>(a.bias), a.N, a.C, stream_,
                              a.eps, a.rms);
  });
  observed(a.rms ? (a.residual_b ? "residual + rmsnorm forward" : "rmsnorm forward")
                 : (a.residual_b ? "residual + layernorm forward" : "layernorm forward"));
}

void CudaBackend::layernorm_backward(const LayerNormBackward& a) {
  check(a.rms ? Op::rmsnorm : Op::layernorm, a.dtype);
  LOOM_CHECK(a.dweight && (a.rms || a.dbias), "cuda layernorm_backward: dweight and dbias (LayerNorm) must be set");
  auto* scratch = static_cast<float*>(
      grow(ln_scratch_, ln_bytes_, size_t(layernorm_backward_scratch_floats(a.C)) * sizeof(float), "the LayerNorm backward"));
  LOOM_CUDA_DISPATCH_16(a.dtype, "layernorm_backward", [&](auto* tag) {
    using T = LOOM_T;
    cuda::layernorm_backward(h<T>(a.dinp), a.dweight, a.dbias, h<T>(a.dout), h<T>(a.inp), h<T>(a.weight), a.mean,
                             a.rstd, a.N, a.C, a.accumulate, scratch, stream_, a.rms);
  });
  observed(a.rms ? "rmsnorm backward" : "layernorm backward");
}

CudaBackend::ShapeKey CudaBackend::key(DType dtype, const AttnShape& s) {
  int32_t scale_bits = 0;
  std::memcpy(&scale_bits, &s.scale, sizeof(scale_bits));
  return {s.B,      s.NH,      s.HS,     s.Tq,         s.Tkv,      s.q_stride, s.kv_stride,
          s.o_stride, s.q_pos0, s.kv_pos0, s.causal, scale_bits, s.kv_heads(), int64_t(dtype)};
}

const CudaBackend::Plan* CudaBackend::find_plan(DType dtype, const AttnShape& s) const {
  auto it = plans_.find(key(dtype, s));
  return it == plans_.end() ? nullptr : it->second.get();
}

AttnKernel CudaBackend::resolve(const AttnShape& s, std::string* note) const {
  const bool flash_ok = flash_head_size_supported(s.HS);
  if (requested_ == AttnKernel::automatic) {
    if (flash_ok && cudnn_available() && cudnn_runtime_version() >= 91600) {
      try {
        cudnn_attention_check(attn_args(s));
        return AttnKernel::cudnn;
      } catch (const Error& e) {
        if (note) *note = e.what();
      }
    }
    if (flash_ok) return AttnKernel::flash;
    LOOM_CHECK(gemm_takes(s), "cuda attention: head size {} needs the GEMM kernels, which take packed causal "
               "self-attention only", s.HS);
    return AttnKernel::gemm;
  }
  if (requested_ == AttnKernel::flash)
    LOOM_CHECK(flash_ok, "cuda attention: flash needs head size 64 or 128, got {}", s.HS);
  if (requested_ == AttnKernel::gemm)
    LOOM_CHECK(gemm_takes(s), "cuda attention: the GEMM kernels take packed causal self-attention only");
  if (requested_ == AttnKernel::cudnn) cudnn_attention_check(attn_args(s));
  return requested_;
}

AttnKernel CudaBackend::attention_kernel(const AttnShape& s) const {
  if (const Plan* p = find_plan(dtype_, s)) return p->kernel;
  return resolve(s, nullptr);
}

CudaBackend::Plan& CudaBackend::plan(DType dtype, const AttnShape& s) {
  auto it = plans_.find(key(dtype, s));
  if (it != plans_.end()) return *it->second;
  LOOM_CHECK(!capturing(), "cuda attention: a new shape while a CUDA graph is being captured (prepare it first)");
  auto p = std::make_unique<Plan>();
  std::string note;
  p->kernel = resolve(s, &note);
  const AttnArgs args = attn_args(s);
  if (p->kernel == AttnKernel::cudnn) {
    try {
      p->cudnn = std::make_unique<CudnnAttention>(args, dtype);
    } catch (const Error& e) {
      // automatic falls back to flash when cuDNN cannot plan the shape; asked for by name it fails.
      if (requested_ != AttnKernel::automatic) throw;
      note = e.what();
      p->kernel = AttnKernel::flash;
    }
  }
  if (!note.empty()) attention_note_ = note;
  if (p->kernel == AttnKernel::cudnn)
    p->workspace = std::max(p->cudnn->forward_workspace_bytes(), p->cudnn->backward_workspace_bytes());
  else if (p->kernel == AttnKernel::flash)
    p->workspace = attention_backward_workspace_bytes(args);
  else
    p->workspace = attn_gemm_workspace_bytes({s.B, s.Tq, s.NH, s.HS});
  grow(attn_ws_, attn_ws_bytes_, p->workspace, "attention");
  return *plans_.emplace(key(dtype, s), std::move(p)).first->second;
}

void CudaBackend::prepare_attention(DType dtype, const AttnShape& s) {
  check(Op::attention, dtype);
  (void)plan(dtype, s);
}

int64_t CudaBackend::attention_probs_bytes(DType dtype, const AttnShape& s) const {
  check(Op::attention, dtype);
  if (attention_kernel(s) != AttnKernel::gemm) return 0;
  return s.B * s.NH * s.Tq * s.Tkv * int64_t(dtype_size(dtype));
}

int64_t CudaBackend::attention_workspace_bytes(DType dtype, const AttnShape& s, int) const {
  check(Op::attention, dtype);
  if (const Plan* p = find_plan(dtype, s)) return int64_t(p->workspace);
  const AttnKernel k = resolve(s, nullptr);
  if (k == AttnKernel::gemm) return int64_t(attn_gemm_workspace_bytes({s.B, s.Tq, s.NH, s.HS}));
  if (k == AttnKernel::flash) return int64_t(attention_backward_workspace_bytes(attn_args(s)));
  CudnnAttention probe(attn_args(s), dtype);  // cuDNN's own scratch is known once planned
  return int64_t(std::max(probe.forward_workspace_bytes(), probe.backward_workspace_bytes()));
}

void CudaBackend::attention_forward(const AttentionForward& a) {
  check(Op::attention, a.dtype);
  Plan& p = plan(a.dtype, a.shape);
  const AttnArgs args = attn_args(a.shape);
  LOOM_CUDA_DISPATCH_16(a.dtype, "attention_forward", [&](auto* tag) {
    using T = LOOM_T;
    switch (p.kernel) {
      case AttnKernel::cudnn:
        p.cudnn->forward(a.out, a.lse, a.q, a.k, a.v, attn_ws_, stream_);
        break;
      case AttnKernel::gemm: {
        const int64_t C = a.shape.NH * a.shape.HS;
        LOOM_CHECK(a.probs && a.k == h<T>(a.q) + C && a.v == h<T>(a.q) + 2 * C,
                   "cuda attention (gemm): q, k, v must be one packed [B, T, 3C] buffer and probs set");
        attn_gemm_forward(*blas_, h<T>(a.out), h<T>(a.probs), h<T>(a.q),
                          {a.shape.B, a.shape.Tq, a.shape.NH, a.shape.HS}, attn_ws_, stream_);
        break;
      }
      default:
        cuda::attention_forward(h<T>(a.out), a.lse, h<T>(a.q), h<T>(a.k), h<T>(a.v), args, stream_);
    }
  });
  observed("attention forward", attention_flops(a.shape));
}

void CudaBackend::attention_backward(const AttentionBackward& a) {
  check(Op::attention, a.dtype);
  Plan& p = plan(a.dtype, a.shape);
  const AttnArgs args = attn_args(a.shape);
  LOOM_CUDA_DISPATCH_16(a.dtype, "attention_backward", [&](auto* tag) {
    using T = LOOM_T;
    switch (p.kernel) {
      case AttnKernel::cudnn:
        p.cudnn->backward(a.dq, a.dk, a.dv, a.dout, a.q, a.k, a.v, a.out, a.lse, attn_ws_, stream_);
        break;
      case AttnKernel::gemm: {
        const int64_t C = a.shape.NH * a.shape.HS;
        LOOM_CHECK(a.probs && a.k == h<T>(a.q) + C && a.v == h<T>(a.q) + 2 * C && a.dk == h<T>(a.dq) + C &&
                       a.dv == h<T>(a.dq) + 2 * C,
                   "cuda attention (gemm): q, k, v and dq, dk, dv must be packed [B, T, 3C] buffers and probs set");
        attn_gemm_backward(*blas_, h<T>(a.dq), h<T>(a.probs), h<T>(a.dout), h<T>(a.q),
                           {a.shape.B, a.shape.Tq, a.shape.NH, a.shape.HS}, attn_ws_, stream_);
        break;
      }
      default:
        cuda::attention_backward(h<T>(a.dq), h<T>(a.dk), h<T>(a.dv), h<T>(a.dout), h<T>(a.q), h<T>(a.k), h<T>(a.v),
                                 h<T>(a.out), a.lse, args, attn_ws_, stream_);
    }
  });
  observed("attention backward", 2.5 * attention_flops(a.shape));
}

void CudaBackend::attention_merge(const AttentionMerge& a) {
  check(Op::attention, a.dtype);
  LOOM_CHECK(a.B >= 0 && a.NH >= 0 && a.HS >= 0 && a.Tq >= 0, "attention_merge: negative sizes");
  const int64_t rows = a.B * a.NH * a.Tq;
  if (rows == 0) return;
  const unsigned blocks = unsigned(ceil_div(rows * 32, 256));
  LOOM_CUDA_DISPATCH_16(a.dtype, "attention_merge", [&](auto* tag) {
    using T = LOOM_T;
    attention_merge_kernel<T><<<blocks, 256, 0, stream_>>>(a.out, a.lse, h<T>(a.part), a.part_lse, a.B, a.NH, a.HS,
                                                           a.Tq, a.o_row, a.o_batch, a.lse_batch, a.init);
  });
  LOOM_CUDA_LAUNCH_CHECK();
  observed("attention merge");
}

void CudaBackend::crossentropy(const CrossEntropy& a) {
  check(Op::crossentropy, a.dtype);
  LOOM_CUDA_DISPATCH_16(a.dtype, "crossentropy", [&](auto* tag) {
    using T = LOOM_T;
    if (a.dlogits)
      crossentropy_forward_backward(a.losses, h<T>(a.dlogits), h<T>(a.logits), a.targets, a.dloss, a.N, a.V, a.Vp,
                                    stream_);
    else
      crossentropy_forward(a.losses, h<T>(a.logits), a.targets, a.N, a.V, a.Vp, stream_);
  });
  observed(a.dlogits ? "cross-entropy + dlogits" : "cross-entropy");
}

void CudaBackend::vocab_crossentropy(const VocabCrossEntropy& a) {
  check(Op::crossentropy, a.dtype);
  LOOM_CUDA_DISPATCH_16(a.dtype, "vocab_crossentropy", [&](auto* tag) {
    using T = LOOM_T;
    cuda::vocab_crossentropy(int(a.pass), a.losses, a.pass == VocabCrossEntropy::Pass::finish ? h<T>(a.dlogits) : nullptr,
                             h<T>(a.logits), a.targets, a.stats, a.dloss, a.N, a.Vs, a.v0, a.V, stream_);
  });
  observed("vocabulary-parallel cross-entropy");
}

void CudaBackend::embedding_forward(const EmbeddingForward& a) {
  check(Op::embedding, a.dtype);
  LOOM_CUDA_DISPATCH_16(a.dtype, "embedding_forward", [&](auto* tag) {
    using T = LOOM_T;
    cuda::embedding_forward(h<T>(a.out), a.tokens, h<T>(a.wte), h<T>(a.wpe), a.B, a.T, a.C, a.V, stream_,
                            {.pos0 = a.pos0, .positions = a.positions, .v0 = a.vocab_begin, .Vs = a.vocab_rows});
  });
  observed("embedding forward");
}

void CudaBackend::embedding_backward(const EmbeddingBackward& a) {
  check(Op::embedding, a.dtype);
  LOOM_CUDA_DISPATCH_16(a.dtype, "embedding_backward", [&](auto* tag) {
    using T = LOOM_T;
    cuda::embedding_backward(a.dwte, a.dwpe, h<T>(a.dout), a.tokens, a.B, a.T, a.C, a.V, stream_,
                             {.pos0 = a.pos0, .positions = a.positions, .v0 = a.vocab_begin, .Vs = a.vocab_rows});
  });
  observed("embedding backward");
}

void CudaBackend::rope(const Rope& a) {
  check(Op::rope, a.dtype);
  LOOM_CUDA_DISPATCH_16(a.dtype, "rope", [&](auto* tag) {
    using T = LOOM_T;
    cuda::rope(h<T>(a.x), a.B, a.T, a.NH, a.HS, a.stride, a.inv_freq, a.pos0, a.positions, a.inverse, stream_);
  });
  observed("rope");
}

void CudaBackend::swiglu_forward(DType dtype, void* out, const void* inp, int64_t N, int64_t H) {
  check(Op::swiglu, dtype);
  LOOM_CUDA_DISPATCH_16(dtype, "swiglu_forward", [&](auto* tag) {
    using T = LOOM_T;
    cuda::swiglu_forward(h<T>(out), h<T>(inp), N, H, stream_);
  });
  observed("swiglu forward");
}

void CudaBackend::swiglu_backward(DType dtype, void* dinp, const void* dout, const void* inp, int64_t N, int64_t H) {
  check(Op::swiglu, dtype);
  LOOM_CUDA_DISPATCH_16(dtype, "swiglu_backward", [&](auto* tag) {
    using T = LOOM_T;
    cuda::swiglu_backward(h<T>(dinp), h<T>(dout), h<T>(inp), N, H, stream_);
  });
  observed("swiglu backward");
}

void CudaBackend::gelu_forward(DType dtype, void* out, const void* inp, int64_t n) {
  check(Op::gelu, dtype);
  LOOM_CUDA_DISPATCH_16(dtype, "gelu_forward", [&](auto* tag) {
    using T = LOOM_T;
    cuda::gelu_forward(h<T>(out), h<T>(inp), n, stream_);
  });
}

void CudaBackend::gelu_backward(DType dtype, void* dinp, const void* inp, const void* dout, int64_t n) {
  check(Op::gelu, dtype);
  LOOM_CUDA_DISPATCH_16(dtype, "gelu_backward", [&](auto* tag) {
    using T = LOOM_T;
    cuda::gelu_backward(h<T>(dinp), h<T>(inp), h<T>(dout), n, stream_);
  });
}

void CudaBackend::add(DType dtype, void* out, const void* a, const void* b, int64_t n) {
  check(Op::add, dtype);
  LOOM_CHECK(n >= 0, "add: negative size {}", n);
  if (n == 0) return;
  if (dtype == DType::f32) {  // gradient sums (data parallelism)
    add_f32_kernel<<<unsigned(std::min<int64_t>(ceil_div(n, 256), 65536)), 256, 0, stream_>>>(
        static_cast<float*>(out), static_cast<const float*>(a), static_cast<const float*>(b), n);
    LOOM_CUDA_LAUNCH_CHECK();
    observed("add");
    return;
  }
  LOOM_CHECK(reinterpret_cast<uintptr_t>(out) % 16 == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0 &&
                 reinterpret_cast<uintptr_t>(b) % 16 == 0,
             "cuda add: buffers must be 16-byte aligned");
  LOOM_CUDA_DISPATCH_16(dtype, "add", [&](auto* tag) {
    using T = LOOM_T;
    add_kernel<T><<<unsigned(ceil_div(ceil_div(n, 8), 256)), 256, 0, stream_>>>(h<T>(out), h<T>(a), h<T>(b), n);
  });
  LOOM_CUDA_LAUNCH_CHECK();
  observed("residual add");
}

void CudaBackend::sum_squares(const std::vector<Range>& ranges, double* sums) {
  activate();
  std::vector<const float*> x;
  std::vector<int64_t> n;
  for (const Range& r : ranges) x.push_back(r.x), n.push_back(r.n);
  cuda::sum_squares_ranges(x, n, sums, *pool_, stream_);
}

std::unique_ptr<AdamWPlan> CudaBackend::plan_adamw(const std::vector<loom::AdamWTensor>& tensors) {
  activate();
  return std::make_unique<CudaAdamW>(tensors, dtype_, *pool_, stream_, device_, this);
}

void CudaBackend::copy(const Copy& a) {
  check(Op::copy, a.dst_dtype);
  check(Op::copy, a.src_dtype);
  LOOM_CHECK(a.n >= 0, "copy: negative size {}", a.n);
  // Conversions: between f32 and a 16-bit type only (i32 is copied as it is).
  const bool converts = a.dst_dtype != DType::i32 && a.src_dtype != DType::i32 &&
                        (a.dst_dtype == DType::f32) != (a.src_dtype == DType::f32);
  LOOM_CHECK(a.dst_dtype == a.src_dtype || converts,
             "copy: no conversion from {} to {} (16-bit types convert to and from f32)", dtype_name(a.src_dtype),
             dtype_name(a.dst_dtype));
  if (a.n == 0) return;
  const size_t n = size_t(a.n);
  if (a.dst_host && a.src_host) {
    convert_on_host(a.dst, a.dst_dtype, a.src, a.src_dtype, a.n);
    return;
  }
  const size_t ds = dtype_size(a.dst_dtype), ss = dtype_size(a.src_dtype);
  if ((a.src_host || a.dst_host) && a.dst_dtype == a.src_dtype) {  // host <-> device as it is
    LOOM_CUDA_CHECK(cudaMemcpyAsync(a.dst, a.src, n * ds, a.src_host ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                                    stream_));
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return;
  }
  if (a.src_host) {  // host -> device: converted on the host, chunk by chunk, into page-locked staging
    activate();
    ensure_stage();
    const size_t chunk = kStageBytes / std::max(ds, ss);
    int i = 0;
    for (size_t k = 0; k < n; k += chunk, i ^= 1) {
      const size_t m = std::min(chunk, n - k);
      LOOM_CUDA_CHECK(cudaEventSynchronize(stage_free_[i]));  // the transfer that last read it is done
      convert_on_host(stage_[i], a.dst_dtype, static_cast<const char*>(a.src) + k * ss, a.src_dtype, int64_t(m));
      LOOM_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(a.dst) + k * ds, stage_[i], m * ds, cudaMemcpyHostToDevice,
                                      stream_));
      LOOM_CUDA_CHECK(cudaEventRecord(stage_free_[i], stream_));
    }
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return;
  }
  if (a.dst_host) {  // device -> host: through page-locked staging, converted on the host after
    activate();
    ensure_stage();
    const size_t chunk = kStageBytes / std::max(ds, ss);
    for (size_t k = 0; k < n; k += chunk) {
      const size_t m = std::min(chunk, n - k);
      LOOM_CUDA_CHECK(cudaMemcpyAsync(stage_[0], static_cast<const char*>(a.src) + k * ss, m * ss,
                                      cudaMemcpyDeviceToHost, stream_));
      LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
      convert_on_host(static_cast<char*>(a.dst) + k * ds, a.dst_dtype, stage_[0], a.src_dtype, int64_t(m));
    }
    return;
  }
  if (a.dst_dtype == a.src_dtype) {
    LOOM_CUDA_CHECK(cudaMemcpyAsync(a.dst, a.src, n * dtype_size(a.dst_dtype), cudaMemcpyDeviceToDevice, stream_));
  } else {  // one row through the strided copy's conversion kernel
    copy_strided({.dst = a.dst, .dst_dtype = a.dst_dtype, .src = a.src, .src_dtype = a.src_dtype, .cols = a.n});
  }
}

void CudaBackend::add_to_host(float* host, const float* src, int64_t n) {
  LOOM_CHECK(n >= 0, "add_to_host: negative size {}", n);
  if (n == 0) return;
  activate();
  ensure_stage();
  // Piece k lands in stage_[k % 2] (its event recorded after the transfer); the host adds piece k - 1
  // while piece k transfers. A buffer is refilled only after the host's addition from it returned.
  const int64_t chunk = int64_t(kStageBytes / sizeof(float));
  int64_t prev_at = -1, prev_n = 0;
  int i = 0;
  for (int64_t k = 0; k < n; k += chunk, i ^= 1) {
    const int64_t m = std::min(chunk, n - k);
    LOOM_CUDA_CHECK(cudaMemcpyAsync(stage_[i], src + k, size_t(m) * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    LOOM_CUDA_CHECK(cudaEventRecord(stage_free_[i], stream_));
    if (prev_at >= 0) {
      LOOM_CUDA_CHECK(cudaEventSynchronize(stage_free_[i ^ 1]));
      add_f32(host + prev_at, static_cast<const float*>(stage_[i ^ 1]), prev_n);
    }
    prev_at = k, prev_n = m;
  }
  LOOM_CUDA_CHECK(cudaEventSynchronize(stage_free_[i ^ 1]));
  add_f32(host + prev_at, static_cast<const float*>(stage_[i ^ 1]), prev_n);
}

void CudaBackend::release_workspace() {
  activate();
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  plans_.clear();
  memory_moved();
  for (auto [p, n] : {std::make_pair(&dbias_scratch_, &dbias_bytes_), std::make_pair(&ln_scratch_, &ln_bytes_),
                      std::make_pair(&attn_ws_, &attn_ws_bytes_)}) {
    if (*p) pool_->deallocate(*p, *n, MemTag::workspace);
    *p = nullptr;
    *n = 0;
  }
}

void CudaBackend::copy_strided(const StridedCopy& a) {
  check(Op::copy, a.dst_dtype);
  check(Op::copy, a.src_dtype);
  check_strided_copy(a);
  const bool converts = a.dst_dtype != DType::i32 && a.src_dtype != DType::i32 &&
                        (a.dst_dtype == DType::f32) != (a.src_dtype == DType::f32);
  LOOM_CHECK(a.dst_dtype == a.src_dtype || converts,
             "copy_strided: no conversion from {} to {} (16-bit types convert to and from f32)", dtype_name(a.src_dtype),
             dtype_name(a.dst_dtype));
  const int64_t total = a.batches * a.rows * a.cols;
  if (total == 0) return;
  if (a.dst_dtype == a.src_dtype && !a.accumulate) {
    const size_t e = dtype_size(a.dst_dtype), width = size_t(a.cols) * e;
    // One row: its pitch is its width (the strides may be 0, as StridedCopy's defaults).
    const size_t dpitch = a.rows > 1 ? size_t(a.dst_row) * e : width, spitch = a.rows > 1 ? size_t(a.src_row) * e : width;
    for (int64_t b = 0; b < a.batches; ++b)
      LOOM_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char*>(a.dst) + size_t(b * a.dst_batch) * e, dpitch,
                                        static_cast<const char*>(a.src) + size_t(b * a.src_batch) * e, spitch, width,
                                        size_t(a.rows), cudaMemcpyDeviceToDevice, stream_));
    observed("strided copy");
    return;
  }
  const unsigned blocks = unsigned(std::min<int64_t>(ceil_div(total, 256), 65536));
  auto launch = [&](auto* d, const auto* s) {
    copy_strided_kernel<<<blocks, 256, 0, stream_>>>(d, s, a.rows, a.cols, total, a.dst_row, a.dst_batch, a.src_row,
                                                     a.src_batch, a.accumulate);
  };
  if (a.dst_dtype == DType::f32 && a.src_dtype == DType::f32) {
    launch(static_cast<float*>(a.dst), static_cast<const float*>(a.src));
  } else if (a.dst_dtype == DType::f32) {
    LOOM_CUDA_DISPATCH_16(a.src_dtype, "copy_strided", [&](auto* tag) {
      using T = LOOM_T;
      launch(static_cast<float*>(a.dst), h<T>(a.src));
    });
  } else {
    LOOM_CUDA_DISPATCH_16(a.dst_dtype, "copy_strided", [&](auto* tag) {
      using T = LOOM_T;
      launch(h<T>(a.dst), static_cast<const float*>(a.src));
    });
  }
  LOOM_CUDA_LAUNCH_CHECK();
  observed("strided copy");
}

void CudaBackend::fill_zero(void* dst, int64_t bytes) {
  activate();
  LOOM_CHECK(bytes >= 0, "fill_zero: negative size {}", bytes);
  LOOM_CUDA_CHECK(cudaMemsetAsync(dst, 0, size_t(bytes), stream_));
  observed("fill zero");
}

}  // namespace loom::cuda

// Registration (core/backend.h); the anchor keeps this file in every program that links loom_cuda.
extern "C" {
int loom_cuda_backend_anchor = [] {
  loom::register_backend(
      loom::Device::cuda,
      [](const loom::BackendOptions& opt) -> std::unique_ptr<loom::Backend> {
        return std::make_unique<loom::cuda::CudaBackend>(opt);
      },
      [](std::string* why) {
        int count = 0;
        const cudaError_t err = cudaGetDeviceCount(&count);
        if (err == cudaSuccess && count > 0) return true;
        if (why) *why = err == cudaSuccess ? std::string("no CUDA device") : std::string(cudaGetErrorString(err));
        return false;
      },
      [](loom::DeviceInfo* info, std::string* why) {
        int count = 0, device = 0;
        cudaDeviceProp prop{};
        cudaError_t err = cudaGetDeviceCount(&count);
        if (err == cudaSuccess) err = cudaGetDevice(&device);
        if (err == cudaSuccess) err = cudaGetDeviceProperties(&prop, device);
        if (err != cudaSuccess) {
          cudaGetLastError();
          if (why) *why = cudaGetErrorString(err);
          return false;
        }
        *info = {.name = prop.name, .memory = int64_t(prop.totalGlobalMem), .count = count};
        return true;
      });
  return 1;
}();
}

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/adamw.cuh"

#include <cmath>

namespace loom::cuda {
namespace {

constexpr int kThreads = 256;

template <class Chunk>
__global__ void sum_squares_kernel(float* partials, const AdamWTensor* tensors, const Chunk* chunks, int64_t chunk) {
  __shared__ float sh[32];
  const Chunk ck = chunks[blockIdx.x];
  const AdamWTensor t = tensors[ck.tensor];
  const int64_t end = min(t.n, ck.start + chunk);
  float s = 0.f;
  for (int64_t i = ck.start + threadIdx.x; i < end; i += kThreads) {
    const float g = t.grad[i];
    s += g * g;
  }
  s = block_sum(s, sh);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

template <class Hyper>
__global__ void finalize_norm_kernel(float* stats, const float* partials, int64_t n, const Hyper* h) {
  __shared__ float sh[32];
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += partials[i];
  s = block_sum(s, sh);
  if (threadIdx.x == 0) {
    const bool given = !(h->global_norm < 0.f);  // (NaN and infinities included)
    const float norm = given ? h->global_norm : sqrtf(s) * h->grad_scale;
    float scale = h->grad_scale;
    if (h->max_norm > 0.f) scale *= fminf(1.f, h->max_norm / (norm + 1e-6f));
    stats[0] = norm;
    stats[1] = scale;
  }
}

// One element's update, in both paths of adamw_kernel with each rounding spelled out (so that the
// two give the same bits whatever the compiler would fuse):
//   g *= scale; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g g; p -= lr wd p;
//   p -= lr (m / bc1) / (sqrt(v / bc2) + eps).
template <class Hyper>
__device__ __forceinline__ void adamw_element(const Hyper& h, float scale, float wd, float g, float& p, float& m,
                                              float& v) {
  g = __fmul_rn(g, scale);
  m = fmaf(h.beta1, m, __fmul_rn(1.f - h.beta1, g));
  v = fmaf(h.beta2, v, __fmul_rn(__fmul_rn(1.f - h.beta2, g), g));
  p = fmaf(-__fmul_rn(h.lr, wd), p, p);
  const float step = __fdiv_rn(__fmul_rn(h.lr, __fdiv_rn(m, h.bc1)), __fadd_rn(sqrtf(__fdiv_rn(v, h.bc2)), h.eps));
  p = __fsub_rn(p, step);
}

__device__ __forceinline__ bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// A memory-bound pass (30 bytes per element with a 16-bit copy). Where the chunk's f32 arrays are
// 16-byte aligned (and its 16-bit copy 8-byte aligned), four elements per thread at a time with
// 16-byte accesses, then the rest one by one; elsewhere one by one.
template <class Chunk, class Hyper>
__global__ void adamw_kernel(const AdamWTensor* tensors, const Chunk* chunks, int64_t chunk, const Hyper* hp,
                             const float* stats) {
  const Chunk ck = chunks[blockIdx.x];
  const AdamWTensor t = tensors[ck.tensor];
  // A non-finite norm (an overflow or a NaN in some gradient) leaves parameters and moments as
  // they were, as the CPU optimizer refuses the step; the caller sees the norm and stops.
  if (!isfinite(stats[0])) return;
  const Hyper h = *hp;
  const float scale = stats[1];
  const int64_t end = min(t.n, ck.start + chunk);
  int64_t rest = ck.start;
  const int64_t s = ck.start;
  if (aligned(t.param + s, 16) && aligned(t.grad + s, 16) && aligned(t.m + s, 16) && aligned(t.v + s, 16) &&
      (!t.param_bf16 || aligned(t.param_bf16 + s, 8)) && (!t.param_f16 || aligned(t.param_f16 + s, 8))) {
    const int64_t quads = (end - s) / 4;
    for (int64_t q = threadIdx.x; q < quads; q += kThreads) {
      const int64_t i = s + 4 * q;
      const float4 g = *reinterpret_cast<const float4*>(t.grad + i);
      float4 p = *reinterpret_cast<const float4*>(t.param + i);
      float4 m = *reinterpret_cast<const float4*>(t.m + i);
      float4 v = *reinterpret_cast<const float4*>(t.v + i);
      adamw_element(h, scale, t.weight_decay, g.x, p.x, m.x, v.x);
      adamw_element(h, scale, t.weight_decay, g.y, p.y, m.y, v.y);
      adamw_element(h, scale, t.weight_decay, g.z, p.z, m.z, v.z);
      adamw_element(h, scale, t.weight_decay, g.w, p.w, m.w, v.w);
      *reinterpret_cast<float4*>(t.m + i) = m;
      *reinterpret_cast<float4*>(t.v + i) = v;
      *reinterpret_cast<float4*>(t.param + i) = p;
      if (t.param_bf16) {
        const __nv_bfloat162 lo = __floats2bfloat162_rn(p.x, p.y), hi = __floats2bfloat162_rn(p.z, p.w);
        uint2 u;
        u.x = *reinterpret_cast<const uint32_t*>(&lo);
        u.y = *reinterpret_cast<const uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(t.param_bf16 + i) = u;
      }
      if (t.param_f16) {
        const __half2 lo = __floats2half2_rn(p.x, p.y), hi = __floats2half2_rn(p.z, p.w);
        uint2 u;
        u.x = *reinterpret_cast<const uint32_t*>(&lo);
        u.y = *reinterpret_cast<const uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(t.param_f16 + i) = u;
      }
    }
    rest = s + 4 * quads;
  }
  for (int64_t i = rest + threadIdx.x; i < end; i += kThreads) {
    float p = t.param[i], m = t.m[i], v = t.v[i];
    adamw_element(h, scale, t.weight_decay, t.grad[i], p, m, v);
    t.m[i] = m;
    t.v[i] = v;
    t.param[i] = p;
    if (t.param_bf16) t.param_bf16[i] = __float2bfloat16(p);
    if (t.param_f16) t.param_f16[i] = __float2half(p);
  }
}

// One block's share of a range: elements [blockIdx.x * per, (blockIdx.x + 1) * per), summed in
// double over a fixed thread order.
__global__ void range_squares_kernel(double* partials, const float* x, int64_t n, int64_t per) {
  __shared__ double sh[kThreads];
  const int64_t begin = int64_t(blockIdx.x) * per, end = min(n, begin + per);
  double s = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) s += double(x[i]) * double(x[i]);
  sh[threadIdx.x] = s;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w /= 2) {
    if (int(threadIdx.x) < w) sh[threadIdx.x] += sh[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = sh[0];
}

}  // namespace

void sum_squares_ranges(const std::vector<const float*>& x, const std::vector<int64_t>& n, double* sums,
                        MemoryPool& pool, cudaStream_t stream) {
  LOOM_CHECK(x.size() == n.size(), "sum_squares: {} ranges with {} sizes", x.size(), n.size());
  constexpr int64_t kPer = int64_t(kThreads) * 64;  // elements per block
  std::vector<int64_t> first(x.size() + 1, 0);
  for (size_t i = 0; i < x.size(); ++i) {
    LOOM_CHECK(n[i] >= 0 && (n[i] == 0 || x[i]), "sum_squares: range {} of {} elements at {}", i, n[i],
               static_cast<const void*>(x[i]));
    first[i + 1] = first[i] + ceil_div(n[i], kPer);
  }
  for (size_t i = 0; i < x.size(); ++i) sums[i] = 0.0;
  if (first.back() == 0) return;
  const size_t bytes = size_t(first.back()) * sizeof(double);
  double* partials = static_cast<double*>(pool.allocate(bytes, MemTag::workspace));
  std::vector<double> host(size_t(first.back()));
  try {
    for (size_t i = 0; i < x.size(); ++i) {
      if (n[i] == 0) continue;
      range_squares_kernel<<<unsigned(first[i + 1] - first[i]), kThreads, 0, stream>>>(partials + first[i], x[i], n[i],
                                                                                      kPer);
      LOOM_CUDA_LAUNCH_CHECK();
    }
    LOOM_CUDA_CHECK(cudaMemcpyAsync(host.data(), partials, bytes, cudaMemcpyDeviceToHost, stream));
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  } catch (...) {
    pool.deallocate(partials, bytes, MemTag::workspace);
    throw;
  }
  pool.deallocate(partials, bytes, MemTag::workspace);
  for (size_t i = 0; i < x.size(); ++i) {
    double r = 0;
    for (int64_t k = first[i]; k < first[i + 1]; ++k) r += host[size_t(k)];
    sums[i] = r;
  }
}

MultiTensorAdamW::MultiTensorAdamW(std::vector<AdamWTensor> tensors, MemoryPool& pool)
    : pool_(pool), tensors_(std::move(tensors)) {
  LOOM_CHECK(pool_.device() == Device::cuda, "MultiTensorAdamW: pool '{}' is not a device pool", pool_.name().c_str());
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const AdamWTensor& t = tensors_[i];
    LOOM_CHECK(t.n >= 0, "MultiTensorAdamW: tensor {} has negative size {}", int64_t(i), t.n);
    LOOM_CHECK(t.n == 0 || (t.param && t.grad && t.m && t.v), "MultiTensorAdamW: tensor {} lacks a pointer", int64_t(i));
    for (int64_t s = 0; s < t.n; s += kChunk) chunks.push_back({int32_t(i), s});
    numel_ += t.n;
  }
  num_chunks_ = int64_t(chunks.size());
  bytes_tensors_ = std::max<size_t>(1, tensors_.size()) * sizeof(AdamWTensor);
  bytes_chunks_ = std::max<size_t>(1, chunks.size()) * sizeof(Chunk);
  bytes_partials_ = std::max<size_t>(1, chunks.size()) * sizeof(float);
  d_tensors_ = static_cast<AdamWTensor*>(pool_.allocate(bytes_tensors_, MemTag::optimizer));
  d_chunks_ = static_cast<Chunk*>(pool_.allocate(bytes_chunks_, MemTag::optimizer));
  partials_ = static_cast<float*>(pool_.allocate(bytes_partials_, MemTag::optimizer));
  stats_ = static_cast<float*>(pool_.allocate(2 * sizeof(float), MemTag::optimizer));
  d_hyper_ = static_cast<DeviceHyper*>(pool_.allocate(sizeof(DeviceHyper), MemTag::optimizer));
  LOOM_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&h_hyper_), sizeof(DeviceHyper)));
  if (!tensors_.empty())
    LOOM_CUDA_CHECK(cudaMemcpy(d_tensors_, tensors_.data(), tensors_.size() * sizeof(AdamWTensor), cudaMemcpyHostToDevice));
  if (!chunks.empty())
    LOOM_CUDA_CHECK(cudaMemcpy(d_chunks_, chunks.data(), chunks.size() * sizeof(Chunk), cudaMemcpyHostToDevice));
  set_hyper(AdamWHyper{});
  // The tables were copied on the legacy default stream; launches come on the caller's stream.
  LOOM_CUDA_CHECK(cudaDeviceSynchronize());
}

MultiTensorAdamW::~MultiTensorAdamW() {
  cudaFreeHost(h_hyper_);
  pool_.deallocate(d_hyper_, sizeof(DeviceHyper), MemTag::optimizer);
  pool_.deallocate(stats_, 2 * sizeof(float), MemTag::optimizer);
  pool_.deallocate(partials_, bytes_partials_, MemTag::optimizer);
  pool_.deallocate(d_chunks_, bytes_chunks_, MemTag::optimizer);
  pool_.deallocate(d_tensors_, bytes_tensors_, MemTag::optimizer);
}

void MultiTensorAdamW::set_hyper(const AdamWHyper& h) {
  LOOM_CHECK(h.step >= 1, "AdamW: step must be >= 1, got {}", h.step);
  LOOM_CHECK(h.beta1 >= 0.f && h.beta1 < 1.f && h.beta2 >= 0.f && h.beta2 < 1.f,
             "AdamW: betas must be in [0, 1), got {} and {}", h.beta1, h.beta2);
  // The norm is the scaled gradient's: sqrt(sum of squares) * grad_scale holds for grad_scale > 0.
  LOOM_CHECK(std::isfinite(h.grad_scale) && h.grad_scale > 0.f, "AdamW: grad_scale must be positive and finite, got {}",
             h.grad_scale);
  LOOM_CHECK(std::isfinite(h.lr) && h.lr >= 0.f, "AdamW: lr must be finite and >= 0, got {}", h.lr);
  LOOM_CHECK(std::isfinite(h.eps) && h.eps > 0.f, "AdamW: eps must be finite and > 0, got {}", h.eps);
  LOOM_CHECK(std::isfinite(h.max_norm), "AdamW: max_norm must be finite, got {}", h.max_norm);
  h_hyper_->lr = h.lr;
  h_hyper_->beta1 = h.beta1;
  h_hyper_->beta2 = h.beta2;
  h_hyper_->eps = h.eps;
  h_hyper_->bc1 = float(1.0 - std::pow(double(h.beta1), double(h.step)));
  h_hyper_->bc2 = float(1.0 - std::pow(double(h.beta2), double(h.step)));
  h_hyper_->max_norm = h.max_norm;
  h_hyper_->grad_scale = h.grad_scale;
  h_hyper_->global_norm = h.global_norm;
}

void MultiTensorAdamW::launch(cudaStream_t stream) {
  LOOM_CUDA_CHECK(cudaMemcpyAsync(d_hyper_, h_hyper_, sizeof(DeviceHyper), cudaMemcpyHostToDevice, stream));
  if (num_chunks_ == 0) return;
  // (A norm given by the caller is decided now: a captured launch keeps the choice.)
  const bool given = !(h_hyper_->global_norm < 0.f);
  if (!given) {
    sum_squares_kernel<<<unsigned(num_chunks_), kThreads, 0, stream>>>(partials_, d_tensors_, d_chunks_, kChunk);
    LOOM_CUDA_LAUNCH_CHECK();
  }
  finalize_norm_kernel<<<1, 1024, 0, stream>>>(stats_, partials_, given ? 0 : num_chunks_, d_hyper_);
  LOOM_CUDA_LAUNCH_CHECK();
  adamw_kernel<<<unsigned(num_chunks_), kThreads, 0, stream>>>(d_tensors_, d_chunks_, kChunk, d_hyper_, stats_);
  LOOM_CUDA_LAUNCH_CHECK();
}

}  // namespace loom::cuda

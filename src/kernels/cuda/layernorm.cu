#include "kernels/cuda/common.cuh"
#include "kernels/cuda/layernorm.cuh"

#include <map>
#include <mutex>
#include <tuple>
#include <utility>

namespace loom::cuda {
namespace {

constexpr int kWarps = 4;  // the forward's rows per block (one warp per row)

template <class T>
__device__ __forceinline__ void load8(float (&f)[8], const T* p) {
  Vec8<T> v = *reinterpret_cast<const Vec8<T>*>(p);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = to_f32(v.v[i]);
}

template <class T>
__device__ __forceinline__ void store8(T* p, const float (&f)[8]) {
  Vec8<T> v;
#pragma unroll
  for (int i = 0; i < 8; ++i) v.v[i] = from_f32<T>(f[i]);
  *reinterpret_cast<Vec8<T>*>(p) = v;
}

// One warp per row. With `a2` set the row is first formed as round(a + a2) to T and written to
// `residual`. Statistics in f32 over the (rounded) 16-bit row: mean first, then the centred variance.
template <class T>
__global__ void layernorm_forward_kernel(T* residual, T* out, float* mean_out,
                                         float* rstd_out, const T* a, const T* a2,
                                         const T* __restrict__ weight, const T* __restrict__ bias, int64_t N,
                                         int64_t C, float eps, bool rms) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= N) return;
  const T* x = a + row * C;
  const T* x2 = a2 ? a2 + row * C : nullptr;
  T* res = residual ? residual + row * C : nullptr;
  float sum = 0.f;
  for (int64_t c = lane * 8; c < C; c += 256) {
    float f[8];
    load8(f, x + c);
    if (x2) {
      float g[8];
      load8(g, x2 + c);
      Vec8<T> r;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        r.v[i] = from_f32<T>(f[i] + g[i]);
        f[i] = to_f32(r.v[i]);
      }
      *reinterpret_cast<Vec8<T>*>(res + c) = r;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += f[i];
  }
  const T* xr = x2 ? res : x;  // the row as normalised (written by this warp's own lanes)
  __syncwarp();
  const float mean = rms ? 0.f : warp_sum(sum) / float(C);  // RMSNorm: the mean of squares below
  float var = 0.f;
  for (int64_t c = lane * 8; c < C; c += 256) {
    float f[8];
    load8(f, xr + c);
#pragma unroll
    for (int i = 0; i < 8; ++i) var += (f[i] - mean) * (f[i] - mean);
  }
  const float rstd = rsqrtf(warp_sum(var) / float(C) + eps);
  for (int64_t c = lane * 8; c < C; c += 256) {
    float f[8], w[8], b[8] = {}, o[8];
    load8(f, xr + c);
    load8(w, weight + c);
    if (bias) load8(b, bias + c);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = (f[i] - mean) * rstd * w[i] + b[i];
    store8(out + row * C + c, o);
  }
  if (lane == 0) {
    if (mean_out) mean_out[row] = mean;
    if (rstd_out) rstd_out[row] = rstd;
  }
}

// The same for rows of at most 256 CH columns, held in registers: each lane loads its CH 16-byte
// groups of the row (and of a2) at once, so the row is read from memory once and the loads of a
// warp are all in flight together (the kernel above reads the row three times, a group at a time).
// Same arithmetic, in the same order per lane, as the kernel above.
template <class T, int CH>
__global__ void __launch_bounds__(kWarps * 32)
    layernorm_forward_cached_kernel(T* residual, T* out, float* mean_out, float* rstd_out, const T* a,
                                    const T* a2, const T* __restrict__ weight, const T* __restrict__ bias,
                                    int64_t N, int64_t C, float eps, bool rms) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= N) return;
  float f[CH][8];
#pragma unroll
  for (int k = 0; k < CH; ++k) {
    const int64_t c = (lane + 32 * k) * 8;
    if (c < C) load8(f[k], a + row * C + c);
  }
  if (a2) {
    float g[CH][8];
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      const int64_t c = (lane + 32 * k) * 8;
      if (c < C) load8(g[k], a2 + row * C + c);
    }
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      const int64_t c = (lane + 32 * k) * 8;
      if (c >= C) continue;
      Vec8<T> r;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        r.v[i] = from_f32<T>(f[k][i] + g[k][i]);
        f[k][i] = to_f32(r.v[i]);
      }
      *reinterpret_cast<Vec8<T>*>(residual + row * C + c) = r;
    }
  }
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < CH; ++k)
    if ((lane + 32 * k) * 8 < C)
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += f[k][i];
  const float mean = rms ? 0.f : warp_sum(sum) / float(C);
  float var = 0.f;
#pragma unroll
  for (int k = 0; k < CH; ++k)
    if ((lane + 32 * k) * 8 < C)
#pragma unroll
      for (int i = 0; i < 8; ++i) var += (f[k][i] - mean) * (f[k][i] - mean);
  const float rstd = rsqrtf(warp_sum(var) / float(C) + eps);
#pragma unroll
  for (int k = 0; k < CH; ++k) {
    const int64_t c = (lane + 32 * k) * 8;
    if (c >= C) continue;
    float w[8], b[8] = {}, o[8];
    load8(w, weight + c);
    if (bias) load8(b, bias + c);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = (f[k][i] - mean) * rstd * w[i] + b[i];
    store8(out + row * C + c, o);
  }
  if (lane == 0) {
    if (mean_out) mean_out[row] = mean;
    if (rstd_out) rstd_out[row] = rstd;
  }
}

// The backward kernel's shape: up to kBwdWarps warps per block (fewer where C is so wide that
// their partial sums would not fit in a block's shared memory), one warp per row, rows strided over
// the grid. Each warp keeps its own dweight (and, with a bias, dbias) partial sums in shared
// memory, f32 [warps][sums][C], stored "lane-major": the value of column c = 8 g + i (g the
// 8-column group a lane loads with one 16-byte access, i in 0..7) at index i * (C / 8) + g. A
// warp's 32 lanes then touch 32 consecutive words (no bank conflicts); in column order they would
// hit 4 banks, 8 lanes each. The block sums its warps in order into partial[block] (same index
// order); the reduce kernel maps back to columns.
constexpr int kBwdWarps = 8;

// The row is read twice, a 16-byte group at a time (L1 serves the second read). A variant that held
// the row in registers (as the forward does) ran 1.5x slower on an H200 at C = 576 and 768: its
// registers left one block per SM.
template <class T>
__global__ void __launch_bounds__(kBwdWarps * 32)
    layernorm_backward_kernel(T* dinp, float* __restrict__ partial, const T* __restrict__ dout,
                              const T* __restrict__ inp, const T* __restrict__ weight,
                              const float* __restrict__ mean, const float* __restrict__ rstd, int64_t N, int64_t C,
                              int sums, bool accumulate, bool rms) {
  extern __shared__ float sh[];  // [warps][sums][C], lane-major
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int64_t G = C / 8;
  float* dw = sh + int64_t(warp) * sums * C;
  float* db = dw + C;  // sums == 2
  for (int64_t c = lane; c < sums * C; c += 32) dw[c] = 0.f;
  __syncwarp();
  for (int64_t row = int64_t(blockIdx.x) * warps + warp; row < N; row += int64_t(gridDim.x) * warps) {
    const float m = rms ? 0.f : mean[row], rs = rstd[row];
    const T* x = inp + row * C;
    const T* dy = dout + row * C;
    float s_dy = 0.f, s_dyx = 0.f;
    for (int64_t c = lane * 8; c < C; c += 256) {
      float f[8], g[8], w[8];
      load8(f, x + c);
      load8(g, dy + c);
      load8(w, weight + c);
      const int64_t grp = c / 8;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float xh = (f[i] - m) * rs;
        const float dn = g[i] * w[i];
        s_dy += dn;
        s_dyx += dn * xh;
        dw[i * G + grp] += g[i] * xh;
        if (sums == 2) db[i * G + grp] += g[i];
      }
    }
    const float mean_dn = rms ? 0.f : warp_sum(s_dy) / float(C);
    const float mean_dnx = warp_sum(s_dyx) / float(C);
    T* dx = dinp + row * C;
    for (int64_t c = lane * 8; c < C; c += 256) {
      float f[8], g[8], w[8], o[8];
      load8(f, x + c);
      load8(g, dy + c);
      load8(w, weight + c);
      if (accumulate) load8(o, dx + c);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float xh = (f[i] - m) * rs;
        const float v = (g[i] * w[i] - mean_dn - xh * mean_dnx) * rs;
        o[i] = accumulate ? o[i] + v : v;
      }
      store8(dx + c, o);
    }
  }
  __syncthreads();
  for (int64_t c = threadIdx.x; c < sums * C; c += blockDim.x) {
    float s = 0.f;
    for (int w = 0; w < warps; ++w) s += sh[int64_t(w) * sums * C + c];
    partial[int64_t(blockIdx.x) * sums * C + c] = s;
  }
}

// Sums partial[blocks][sums C] over the blocks for every index: a block takes 32 consecutive
// indices (coalesced loads), its kReduceRows thread rows take the partial blocks r, r + kReduceRows,
// ..., and row 0 adds the rows' sums in order (a fixed order: deterministic). Writes dweight (and
// dbias) at their columns.
constexpr int kReduceRows = 16;

__global__ void layernorm_backward_reduce_kernel(float* dweight, float* dbias, const float* __restrict__ partial,
                                                 int64_t blocks, int64_t C, int sums) {
  __shared__ float rows[kReduceRows][33];
  const int64_t idx = int64_t(blockIdx.x) * 32 + threadIdx.x;
  const int64_t width = sums * C;
  float s = 0.f;
  if (idx < width)
    for (int64_t b = threadIdx.y; b < blocks; b += kReduceRows) s += partial[b * width + idx];
  rows[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || idx >= width) return;
  for (int r = 1; r < kReduceRows; ++r) s += rows[r][threadIdx.x];
  const int64_t k = idx < C ? idx : idx - C;  // lane-major index within dweight's or dbias's part
  const int64_t col = (k % (C / 8)) * 8 + k / (C / 8);
  if (idx < C) {
    if (dweight) dweight[col] += s;
  } else if (dbias) {
    dbias[col] += s;
  }
}

// Blocks per SM at most (32 warps per SM at 8 warps per block). On an H100 at C = 768, 2 blocks
// per SM (16 warps) moved 51% of the DRAM bandwidth with 24% occupancy
// achieved (Nsight Compute); more blocks add partial sums to reduce, a small cost next to the rows.
constexpr int kMaxBwdBlocksPerSm = 4;

struct BackwardShape {
  int warps = 0;          // per block
  int blocks_per_sm = 0;  // at most kMaxBwdBlocksPerSm
  size_t shmem = 0;       // bytes per block
};

// The backward's launch shape for C (and sums: 2 with dbias, else 1) on the current device, worked
// out once per device, C and sums (raising the kernel's shared memory limit there when the block
// needs more than 48 KiB).
template <class T>
BackwardShape backward_shape(int64_t C, int sums) {
  static std::mutex mu;
  static std::map<std::tuple<int, int64_t, int>, BackwardShape> shapes;
  int device = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard lk(mu);
  auto it = shapes.find({device, C, sums});
  if (it != shapes.end()) return it->second;
  int optin = 0;
  LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  const size_t per_warp = size_t(sums) * size_t(C) * sizeof(float);
  BackwardShape b;
  b.warps = int(std::min<size_t>(kBwdWarps, size_t(optin) / per_warp));
  LOOM_CHECK(b.warps >= 1,
             "layernorm_backward: C = {} needs {} bytes of shared memory for one warp's partial sums, more than the "
             "{} a block can have on this GPU",
             C, per_warp, optin);
  b.shmem = size_t(b.warps) * per_warp;
  if (b.shmem > 48 * 1024)
    LOOM_CUDA_CHECK(
        cudaFuncSetAttribute(layernorm_backward_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(b.shmem)));
  int n = 0;
  LOOM_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, layernorm_backward_kernel<T>, b.warps * 32, b.shmem));
  LOOM_CHECK(n > 0, "layernorm_backward: no block of {} warps with {} bytes of shared memory fits on an SM (C = {})",
             b.warps, b.shmem, C);
  b.blocks_per_sm = std::min(n, kMaxBwdBlocksPerSm);
  shapes.emplace(std::make_tuple(device, C, sums), b);
  return b;
}

// The forward for C: the register-cached kernel for its number of 256-column chunks (C up to
// 1024), else the uncached one. On an H200 the cached kernel took SmolLM-135M's 61 RMSNorms from
// 1.44 to 1.10 ms per step (C = 576) and GPT-2 124M's 25 LayerNorms from 0.71 to 0.58 ms (C = 768).
template <class T>
void launch_forward(T* residual, T* out, float* mean, float* rstd, const T* a, const T* a2,
                    const T* weight, const T* bias, int64_t N, int64_t C, float eps, bool rms,
                    cudaStream_t stream) {
  using Kernel = void (*)(T*, T*, float*, float*, const T*, const T*, const T*, const T*, int64_t,
                         int64_t, float, bool);
  constexpr Kernel cached[] = {layernorm_forward_cached_kernel<T, 1>, layernorm_forward_cached_kernel<T, 2>,
                               layernorm_forward_cached_kernel<T, 3>, layernorm_forward_cached_kernel<T, 4>};
  const int64_t chunks = (C + 255) / 256;
  const Kernel k = chunks <= 4 ? cached[chunks - 1] : layernorm_forward_kernel<T>;
  k<<<unsigned(ceil_div(N, kWarps)), kWarps * 32, 0, stream>>>(residual, out, mean, rstd, a, a2, weight, bias, N, C,
                                                                 eps, rms);
  LOOM_CUDA_LAUNCH_CHECK();
}

void check_sizes(const char* what, int64_t N, int64_t C) {
  LOOM_CHECK(N >= 0 && C > 0 && C % 8 == 0, "{}: C = {} must be a positive multiple of 8 (N = {})", what, C, N);
}

}  // namespace

template <class T>
void layernorm_forward(T* out, float* mean, float* rstd, const T* inp, const T* weight, const T* bias,
                       int64_t N, int64_t C, cudaStream_t stream, float eps, bool rms) {
  check_sizes("layernorm_forward", N, C);
  LOOM_CHECK(weight && (rms ? !bias && !mean : bias != nullptr),
             "layernorm_forward: weight and bias must be set (RMSNorm: weight only, no bias and no mean)");
  if (N == 0) return;
  launch_forward<T>(nullptr, out, mean, rstd, inp, nullptr, weight, bias, N, C, eps, rms, stream);
}

template <class T>
void residual_layernorm_forward(T* residual, T* out, float* mean, float* rstd, const T* a, const T* b,
                                const T* weight, const T* bias, int64_t N, int64_t C, cudaStream_t stream,
                                float eps, bool rms) {
  check_sizes("residual_layernorm_forward", N, C);
  LOOM_CHECK(residual && a && b, "residual_layernorm_forward: residual, a and b must be set");
  LOOM_CHECK(weight && (rms ? !bias && !mean : bias != nullptr),
             "residual_layernorm_forward: weight and bias must be set (RMSNorm: weight only, no bias and no mean)");
  if (N == 0) return;
  launch_forward<T>(residual, out, mean, rstd, a, b, weight, bias, N, C, eps, rms, stream);
}

int64_t layernorm_backward_scratch_floats(int64_t C) { return kMaxBwdBlocksPerSm * int64_t(num_sms()) * 2 * C; }

template <class T>
void layernorm_backward(T* dinp, float* dweight, float* dbias, const T* dout, const T* inp,
                        const T* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                        bool accumulate, float* scratch, cudaStream_t stream, bool rms) {
  check_sizes("layernorm_backward", N, C);
  LOOM_CHECK(dinp && scratch, "layernorm_backward: dinp and scratch must be set");
  LOOM_CHECK(rms ? !mean && !dbias : mean != nullptr,
             "layernorm_backward: mean must be set (RMSNorm: no mean and no dbias)");
  if (N == 0) return;
  const int sums = dbias ? 2 : 1;  // without a bias (RMSNorm) no dbias partial sums
  const BackwardShape shape = backward_shape<T>(C, sums);
  const int64_t blocks = std::min<int64_t>(ceil_div(N, shape.warps), int64_t(shape.blocks_per_sm) * num_sms());
  layernorm_backward_kernel<T><<<unsigned(blocks), shape.warps * 32, shape.shmem, stream>>>(
      dinp, scratch, dout, inp, weight, mean, rstd, N, C, sums, accumulate, rms);
  LOOM_CUDA_LAUNCH_CHECK();
  layernorm_backward_reduce_kernel<<<unsigned(ceil_div(sums * C, 32)), dim3(32, kReduceRows), 0, stream>>>(
      dweight, dbias, scratch, blocks, C, sums);
  LOOM_CUDA_LAUNCH_CHECK();
}

#define LOOM_LN_INSTANTIATE(T)                                                                                   \
  template void layernorm_forward<T>(T*, float*, float*, const T*, const T*, const T*, int64_t, int64_t, cudaStream_t, \
                                     float, bool);                                                                  \
  template void residual_layernorm_forward<T>(T*, T*, float*, float*, const T*, const T*, const T*, const T*, int64_t, \
                                              int64_t, cudaStream_t, float, bool);                                   \
  template void layernorm_backward<T>(T*, float*, float*, const T*, const T*, const T*, const float*, const float*,    \
                                      int64_t, int64_t, bool, float*, cudaStream_t, bool);
LOOM_LN_INSTANTIATE(bf16)
LOOM_LN_INSTANTIATE(f16)
#undef LOOM_LN_INSTANTIATE

}  // namespace loom::cuda

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/layernorm.cuh"

namespace loom::cuda {
namespace {

constexpr int kWarps = 4;  // rows in flight per block (one warp per row)

__device__ __forceinline__ void load8(float (&f)[8], const bf16* p) {
  bf16x8 v = *reinterpret_cast<const bf16x8*>(p);
#pragma unroll
  for (int i = 0; i < 8; ++i) f[i] = __bfloat162float(v.v[i]);
}

__device__ __forceinline__ void store8(bf16* p, const float (&f)[8]) {
  bf16x8 v;
#pragma unroll
  for (int i = 0; i < 8; ++i) v.v[i] = __float2bfloat16(f[i]);
  *reinterpret_cast<bf16x8*>(p) = v;
}

// One warp per row. With `a2` set the row is first formed as round_bf16(a + a2) and written to
// `residual`. Statistics in f32 over the (rounded) bf16 row: mean first, then the centred variance.
__global__ void layernorm_forward_kernel(bf16* residual, bf16* out, float* mean_out,
                                         float* rstd_out, const bf16* a, const bf16* a2,
                                         const bf16* __restrict__ weight, const bf16* __restrict__ bias, int64_t N,
                                         int64_t C, float eps) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (row >= N) return;
  const bf16* x = a + row * C;
  const bf16* x2 = a2 ? a2 + row * C : nullptr;
  bf16* res = residual ? residual + row * C : nullptr;
  float sum = 0.f;
  for (int64_t c = lane * 8; c < C; c += 256) {
    float f[8];
    load8(f, x + c);
    if (x2) {
      float g[8];
      load8(g, x2 + c);
      bf16x8 r;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        r.v[i] = __float2bfloat16(f[i] + g[i]);
        f[i] = __bfloat162float(r.v[i]);
      }
      *reinterpret_cast<bf16x8*>(res + c) = r;
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += f[i];
  }
  const bf16* xr = x2 ? res : x;  // the row as normalised (written by this warp's own lanes)
  __syncwarp();
  const float mean = warp_sum(sum) / float(C);
  float var = 0.f;
  for (int64_t c = lane * 8; c < C; c += 256) {
    float f[8];
    load8(f, xr + c);
#pragma unroll
    for (int i = 0; i < 8; ++i) var += (f[i] - mean) * (f[i] - mean);
  }
  const float rstd = rsqrtf(warp_sum(var) / float(C) + eps);
  for (int64_t c = lane * 8; c < C; c += 256) {
    float f[8], w[8], b[8], o[8];
    load8(f, xr + c);
    load8(w, weight + c);
    load8(b, bias + c);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = (f[i] - mean) * rstd * w[i] + b[i];
    store8(out + row * C + c, o);
  }
  if (lane == 0) {
    if (mean_out) mean_out[row] = mean;
    if (rstd_out) rstd_out[row] = rstd;
  }
}

// One warp per row, rows strided over the grid; each warp keeps its own dweight/dbias partials in
// shared memory (f32 [kWarps][2][C]); the block sums its warps in order into partial[block].
__global__ void layernorm_backward_kernel(bf16* dinp, float* __restrict__ partial, const bf16* __restrict__ dout,
                                          const bf16* __restrict__ inp, const bf16* __restrict__ weight,
                                          const float* __restrict__ mean, const float* __restrict__ rstd, int64_t N,
                                          int64_t C, bool accumulate) {
  extern __shared__ float sh[];  // [kWarps][2][C]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* dw = sh + int64_t(warp) * 2 * C;
  float* db = dw + C;
  for (int64_t c = lane; c < 2 * C; c += 32) dw[c] = 0.f;
  __syncwarp();
  for (int64_t row = int64_t(blockIdx.x) * kWarps + warp; row < N; row += int64_t(gridDim.x) * kWarps) {
    const float m = mean[row], rs = rstd[row];
    const bf16* x = inp + row * C;
    const bf16* dy = dout + row * C;
    float s_dy = 0.f, s_dyx = 0.f;
    for (int64_t c = lane * 8; c < C; c += 256) {
      float f[8], g[8], w[8];
      load8(f, x + c);
      load8(g, dy + c);
      load8(w, weight + c);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float xh = (f[i] - m) * rs;
        const float dn = g[i] * w[i];
        s_dy += dn;
        s_dyx += dn * xh;
        dw[c + i] += g[i] * xh;
        db[c + i] += g[i];
      }
    }
    const float mean_dn = warp_sum(s_dy) / float(C);
    const float mean_dnx = warp_sum(s_dyx) / float(C);
    bf16* dx = dinp + row * C;
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
  for (int64_t c = threadIdx.x; c < 2 * C; c += blockDim.x) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += sh[int64_t(w) * 2 * C + c];
    partial[int64_t(blockIdx.x) * 2 * C + c] = s;
  }
}

__global__ void layernorm_backward_reduce_kernel(float* dweight, float* dbias, const float* partial, int64_t blocks,
                                                 int64_t C) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= 2 * C) return;
  float s = 0.f;
  for (int64_t b = 0; b < blocks; ++b) s += partial[b * 2 * C + c];
  if (c < C) {
    if (dweight) dweight[c] += s;
  } else if (dbias) {
    dbias[c - C] += s;
  }
}

int64_t backward_blocks(int64_t N) { return std::min<int64_t>(ceil_div(N, kWarps), 2 * int64_t(num_sms())); }

void check_sizes(const char* what, int64_t N, int64_t C) {
  LOOM_CHECK(N >= 0 && C > 0 && C % 8 == 0, "{}: C = {} must be a positive multiple of 8 (N = {})", what, C, N);
}

}  // namespace

void layernorm_forward(bf16* out, float* mean, float* rstd, const bf16* inp, const bf16* weight, const bf16* bias,
                       int64_t N, int64_t C, cudaStream_t stream, float eps) {
  check_sizes("layernorm_forward", N, C);
  if (N == 0) return;
  layernorm_forward_kernel<<<unsigned(ceil_div(N, kWarps)), kWarps * 32, 0, stream>>>(
      nullptr, out, mean, rstd, inp, nullptr, weight, bias, N, C, eps);
  LOOM_CUDA_LAUNCH_CHECK();
}

void residual_layernorm_forward(bf16* residual, bf16* out, float* mean, float* rstd, const bf16* a, const bf16* b,
                                const bf16* weight, const bf16* bias, int64_t N, int64_t C, cudaStream_t stream,
                                float eps) {
  check_sizes("residual_layernorm_forward", N, C);
  LOOM_CHECK(residual && a && b, "residual_layernorm_forward: residual, a and b must be set");
  if (N == 0) return;
  layernorm_forward_kernel<<<unsigned(ceil_div(N, kWarps)), kWarps * 32, 0, stream>>>(
      residual, out, mean, rstd, a, b, weight, bias, N, C, eps);
  LOOM_CUDA_LAUNCH_CHECK();
}

int64_t layernorm_backward_scratch_floats(int64_t C) { return 2 * int64_t(num_sms()) * 2 * C; }

void layernorm_backward(bf16* dinp, float* dweight, float* dbias, const bf16* dout, const bf16* inp,
                        const bf16* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                        bool accumulate, float* scratch, cudaStream_t stream) {
  check_sizes("layernorm_backward", N, C);
  LOOM_CHECK(dinp && scratch, "layernorm_backward: dinp and scratch must be set");
  if (N == 0) return;
  const int64_t blocks = backward_blocks(N);
  const size_t shmem = size_t(kWarps) * 2 * size_t(C) * sizeof(float);
  if (shmem > 48 * 1024) {
    static size_t raised = 0;
    if (shmem > raised) {
      LOOM_CUDA_CHECK(cudaFuncSetAttribute(layernorm_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(shmem)));
      raised = shmem;
    }
  }
  layernorm_backward_kernel<<<unsigned(blocks), kWarps * 32, shmem, stream>>>(dinp, scratch, dout, inp, weight, mean,
                                                                             rstd, N, C, accumulate);
  LOOM_CUDA_LAUNCH_CHECK();
  layernorm_backward_reduce_kernel<<<unsigned(ceil_div(2 * C, 256)), 256, 0, stream>>>(dweight, dbias, scratch, blocks,
                                                                                      C);
  LOOM_CUDA_LAUNCH_CHECK();
}

}  // namespace loom::cuda

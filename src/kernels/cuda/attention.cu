// Flash attention forward and backward on tensor cores (mma.sync m16n8k16, bf16 or f16 in, f32
// accumulate), FlashAttention-2 work partitioning. Every kernel is a template over the 16-bit
// element type T (bf16 or f16; both the same fragment layouts, only the mma's input type and the
// f32 <-> 16-bit conversions differ):
//  - forward: one thread block per (batch*head, tile of 16*NW queries); each warp owns 16 query
//    rows whose Q fragments stay in registers; K/V tiles stream through shared memory with
//    cp.async double buffering; the online softmax runs in registers in base 2.
//  - backward: D = rowsum(dO * O) first (and the f32 dQ accumulator is zeroed); then one thread
//    block per (batch*head, tile of 16*NW keys), each warp owning 16 keys whose dK and dV stay in
//    f32 registers while Q/dO tiles stream past; dQ contributions go to the f32 accumulator with
//    atomics and a last kernel converts it to T.
// Shared-memory rows are padded by 16 bytes so that ldmatrix reads of 8 rows hit distinct banks.
#include "kernels/cuda/attention.cuh"

#include <cmath>
#include <type_traits>

namespace loom::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <class T>
struct FwdParams {
  T* out;
  float* lse;
  const T *q, *k, *v;
  int64_t NH, Tq, Tkv;
  int64_t q_stride, kv_stride, o_stride;
  int64_t q_pos0, kv_pos0;
  bool causal;
  float scale_log2;  // softmax scale * log2(e)
  int64_t group;     // query heads per key/value head (grouped-query attention; 1: multi-head)
};

template <class T>
struct BwdParams {
  T *dk, *dv;
  float* dq_acc;       // f32 [B*NH, Tq, HS], zeroed by the preprocessing kernel
  const float* dsum;   // f32 [B*NH, Tq]: D = rowsum(dout * out)
  const float* lse;    // f32 [B*NH, Tq], natural log
  const T *q, *k, *v, *dout;
  int64_t NH, Tq, Tkv;
  int64_t q_stride, kv_stride, o_stride;
  int64_t q_pos0, kv_pos0;
  bool causal;
  float scale, scale_log2;
  int64_t group;  // query heads per key/value head; a block runs all of its key/value head's
};

// ---------------------------------------------------------------------------------------------
// PTX wrappers.

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; with pred false the destination is zero-filled and nothing is read.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// ldmatrix moves b16 elements, whatever the 16-bit type (bf16 or f16) behind `p`.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

template <class T>
constexpr bool kIs16 = std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

// The packed pair of T (two elements in 32 bits, .x the low half).
template <class T>
struct Pair;
template <>
struct Pair<bf16> {
  using type = __nv_bfloat162;
};
template <>
struct Pair<f16> {
  using type = __half2;
};

__device__ __forceinline__ float2 to_f32x2(__nv_bfloat162 x) { return __bfloat1622float2(x); }
__device__ __forceinline__ float2 to_f32x2(__half2 x) { return __half22float2(x); }

// d (16x8 f32) += a (16x16 T, row) * b (16x8 T, col); the fragment layouts are the same for bf16
// and f16.
template <class T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  static_assert(kIs16<T>, "T is bf16 or f16");
  if constexpr (std::is_same_v<T, bf16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two f32 rounded to nearest T, packed (lo in the low 16 bits): one mma A/B register.
template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  static_assert(kIs16<T>, "T is bf16 or f16");
  if constexpr (std::is_same_v<T, bf16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void atomic_add2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(p), make_float2(a, b));
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

// Fragment addressing (per lane) for a 16x16 tile at (row0, col0) of a row-major shared tile with
// row pitch `pitch` (elements):
//  - A operand, rows = M, cols = K, stored [M][K]:            ldsm_x4 at a_off
//  - B operand of two n8 tiles, stored [N][K] (K contiguous): ldsm_x4 at bnk_off -> {b0,b1} n-tile 0, {b2,b3} n-tile 1
//  - B operand of two n8 tiles, stored [K][N] (N contiguous): ldsm_x4_t at bkn_off -> same
//  - A operand stored transposed [K][M]:                      ldsm_x4_t at at_off
__device__ __forceinline__ int a_off(int lane, int pitch) { return (lane & 15) * pitch + (lane >> 4) * 8; }
__device__ __forceinline__ int bnk_off(int lane, int pitch) {
  return ((lane & 7) + ((lane >> 4) << 3)) * pitch + ((lane >> 3) & 1) * 8;
}
__device__ __forceinline__ int bkn_off(int lane, int pitch) {
  return ((lane & 7) + (((lane >> 3) & 1) << 3)) * pitch + (lane >> 4) * 8;
}
__device__ __forceinline__ int at_off(int lane, int pitch) {
  return ((lane & 7) + (((lane >> 4) & 1) << 3)) * pitch + ((lane >> 3) & 1) * 8;
}

// Copies `rows` rows of HS elements of T (row r of global at g + r * stride) into shared rows of
// pitch P, zero-filling rows at or beyond `valid`.
template <int HS, int P, int NT, class T>
__device__ __forceinline__ void load_rows(T* s, const T* g, int64_t stride, int rows, int64_t valid, int tid) {
  constexpr int CH = HS / 8;
  for (int i = tid; i < rows * CH; i += NT) {
    const int r = i / CH, c = i % CH;
    const bool ok = r < valid;
    cp_async16(s + r * P + c * 8, ok ? g + r * stride + c * 8 : g, ok);
  }
}

// ---------------------------------------------------------------------------------------------
// Forward.

// Each of the NW warps owns MT 16-row query tiles (query tile BM = 16 * MT * NW). With MT = 1
// the warp's Q fragments stay in registers; with MT = 2 they are re-read from shared memory at
// each step, and every K/V fragment read from shared memory feeds twice as many mma.
template <class T, int HS, int BN, int NW, int MT>
constexpr int fwd_smem_bytes() {
  return (16 * MT * NW + 4 * BN) * (HS + 8) * int(sizeof(T));
}

template <class T, int HS, int BN, int NW, int MT>
__global__ void __launch_bounds__(NW * 32, MT == 1 ? 1 : 2) attn_fwd_kernel(const FwdParams<T> p) {
  constexpr int WM = 16 * MT, BM = WM * NW, P = HS + 8, NT = NW * 32;
  constexpr int KT = HS / 16;  // k16 steps over the head dimension
  constexpr int NS = BN / 8;   // n8 tiles of scores per key tile
  constexpr int DT = HS / 8;   // n8 tiles of the output
  constexpr bool kQInRegs = MT == 1;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);  // T [BM][P]
  T* sK = sQ + BM * P;                     // T [2][BN][P]
  T* sV = sK + 2 * BN * P;                 // T [2][BN][P]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t bh = blockIdx.x, b = bh / p.NH, h = bh % p.NH;
  const int64_t m0 = int64_t(gridDim.y - 1 - blockIdx.y) * BM;  // heaviest causal tiles first
  const T* qg = p.q + (b * p.Tq + m0) * p.q_stride + h * HS;
  const T* kg = p.k + b * p.Tkv * p.kv_stride + (h / p.group) * HS;
  const T* vg = p.v + b * p.Tkv * p.kv_stride + (h / p.group) * HS;

  int64_t kv_end = p.Tkv;
  if (p.causal) {
    const int64_t last_q = min(m0 + BM, p.Tq) - 1;
    kv_end = p.q_pos0 + last_q - p.kv_pos0 + 1;
    kv_end = kv_end < 0 ? 0 : (kv_end > p.Tkv ? p.Tkv : kv_end);
  }
  const int n_tiles = int((kv_end + BN - 1) / BN);

  load_rows<HS, P, NT>(sQ, qg, p.q_stride, BM, p.Tq - m0, tid);
  if (n_tiles > 0) {
    load_rows<HS, P, NT>(sK, kg, p.kv_stride, BN, p.Tkv, tid);
    load_rows<HS, P, NT>(sV, vg, p.kv_stride, BN, p.Tkv, tid);
  }
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  const T* wQ = sQ + warp * WM * P;  // this warp's query rows
  uint32_t qf[kQInRegs ? KT : 1][4];  // T Q fragments (MT = 1 only)
  if constexpr (kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) ldsm_x4(qf[kk], wQ + kk * 16 + a_off(lane, P));
  }

  float o[MT][DT][4];  // f32 [WM, HS] accumulator of this warp
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int t = 0; t < DT; ++t) o[mt][t][0] = o[mt][t][1] = o[mt][t][2] = o[mt][t][3] = 0.f;
  float row_max[MT][2], row_sum[MT][2];  // raw score maxima and partial exp sums of rows g, g + 8
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }
  const int g = lane >> 2, tig = lane & 3;

  for (int n = 0; n < n_tiles; ++n) {
    if (n > 0) {
      cp_async_wait_all();
      __syncthreads();  // tile n landed; every warp is done with tile n - 1's buffer
    }
    if (n + 1 < n_tiles) {
      const int64_t n1 = int64_t(n + 1) * BN;
      const int buf = (n + 1) & 1;
      load_rows<HS, P, NT>(sK + buf * BN * P, kg + n1 * p.kv_stride, p.kv_stride, BN, p.Tkv - n1, tid);
      load_rows<HS, P, NT>(sV + buf * BN * P, vg + n1 * p.kv_stride, p.kv_stride, BN, p.Tkv - n1, tid);
    }
    cp_async_commit();
    const T* cK = sK + (n & 1) * BN * P;
    const T* cV = sV + (n & 1) * BN * P;

    float s[MT][NS][4];  // f32 [WM, BN] scores
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < NS; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      uint32_t af[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (kQInRegs) {
#pragma unroll
          for (int r = 0; r < 4; ++r) af[mt][r] = qf[kk][r];
        } else {
          ldsm_x4(af[mt], wQ + mt * 16 * P + kk * 16 + a_off(lane, P));
        }
      }
#pragma unroll
      for (int j2 = 0; j2 < NS / 2; ++j2) {
        uint32_t bfr[4];
        ldsm_x4(bfr, cK + j2 * 16 * P + kk * 16 + bnk_off(lane, P));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(s[mt][2 * j2], af[mt], bfr[0], bfr[1]);
          mma16816<T>(s[mt][2 * j2 + 1], af[mt], bfr[2], bfr[3]);
        }
      }
    }

    const int64_t n0 = int64_t(n) * BN;
    const bool need_mask = n0 + BN > p.Tkv || (p.causal && p.kv_pos0 + n0 + BN - 1 > p.q_pos0 + m0);
    if (need_mask) {
      // In tile-local 32-bit terms: key j visible to row r iff j < kv_left and j <= r + shift.
      const int kv_left = p.Tkv - n0 < BN ? int(p.Tkv - n0) : BN;
      int64_t shift64 = p.causal ? p.q_pos0 + m0 - p.kv_pos0 - n0 : int64_t(BN);
      const int shift = int(shift64 < -BM ? -BM : (shift64 > BN ? BN : shift64));
      const int row0 = warp * WM + g;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int j = 0; j < NS; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = j * 8 + tig * 2 + (e & 1);
            const int row = row0 + mt * 16 + (e >> 1) * 8;
            if (key >= kv_left || key > row + shift) s[mt][j][e] = -INFINITY;
          }
        }
      }
    }

    // Online softmax: new maxima, rescale of the running sums and output, probabilities.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float mx[2] = {row_max[mt][0], row_max[mt][1]};
#pragma unroll
      for (int j = 0; j < NS; ++j) {
        mx[0] = fmaxf(mx[0], fmaxf(s[mt][j][0], s[mt][j][1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[mt][j][2], s[mt][j][3]));
      }
      float msc[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        msc[i] = mx[i] == -INFINITY ? 0.f : mx[i] * p.scale_log2;
        const float alpha = fast_exp2(row_max[mt][i] * p.scale_log2 - msc[i]);  // 0 while the row saw nothing
        row_max[mt][i] = mx[i];
        row_sum[mt][i] *= alpha;
#pragma unroll
        for (int t = 0; t < DT; ++t) {
          o[mt][t][2 * i] *= alpha;
          o[mt][t][2 * i + 1] *= alpha;
        }
      }
#pragma unroll
      for (int j = 0; j < NS; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[mt][j][e] = fast_exp2(fmaf(s[mt][j][e], p.scale_log2, -msc[e >> 1]));
          row_sum[mt][e >> 1] += s[mt][j][e];
        }
      }
    }

    // O += P V, P taken from the score registers as T A fragments.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int t2 = 0; t2 < DT / 2; ++t2) {
        uint32_t bfr[4];
        ldsm_x4_t(bfr, cV + kk * 16 * P + t2 * 16 + bkn_off(lane, P));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<T>(o[mt][2 * t2], a[mt], bfr[0], bfr[1]);
          mma16816<T>(o[mt][2 * t2 + 1], a[mt], bfr[2], bfr[3]);
        }
      }
    }
  }

  // Normalise, write lse and stage O through this warp's rows of sQ for 16-byte stores.
  __syncwarp();  // this warp's reads of its sQ rows are done
  T* sO = sQ + warp * WM * P;  // only this warp ever reads these rows
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    float inv[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float sum = row_sum[mt][i];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      inv[i] = sum > 0.f ? 1.f / sum : 0.f;
      const int64_t row = m0 + warp * WM + mt * 16 + g + i * 8;
      if (tig == 0 && row < p.Tq) {
        p.lse[bh * p.Tq + row] = sum > 0.f ? (row_max[mt][i] * p.scale_log2 + __log2f(sum)) * kLn2 : -INFINITY;
      }
    }
#pragma unroll
    for (int t = 0; t < DT; ++t) {
      *reinterpret_cast<uint32_t*>(sO + (mt * 16 + g) * P + t * 8 + tig * 2) =
          pack2<T>(o[mt][t][0] * inv[0], o[mt][t][1] * inv[0]);
      *reinterpret_cast<uint32_t*>(sO + (mt * 16 + g + 8) * P + t * 8 + tig * 2) =
          pack2<T>(o[mt][t][2] * inv[1], o[mt][t][3] * inv[1]);
    }
  }
  __syncwarp();
  T* og = p.out + (b * p.Tq + m0 + warp * WM) * p.o_stride + h * HS;
  for (int i = lane; i < WM * (HS / 8); i += 32) {
    const int r = i / (HS / 8), c = i % (HS / 8);
    if (m0 + warp * WM + r < p.Tq)
      *reinterpret_cast<uint4*>(og + r * p.o_stride + c * 8) = *reinterpret_cast<const uint4*>(sO + r * P + c * 8);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward.

// D[bh, t] = sum_d dout * out (f32), and zero the f32 dQ accumulator. One warp per (b, t, h) row.
template <class T, int HS>
__global__ void attn_bwd_pre_kernel(float* dsum, float* dq_acc, const T* dout, const T* out, int64_t B, int64_t NH,
                                    int64_t Tq, int64_t o_stride) {
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;  // over (bh, t)
  const int lane = threadIdx.x % 32;
  if (row >= B * NH * Tq) return;
  const int64_t bh = row / Tq, t = row % Tq, b = bh / NH, h = bh % NH;
  const T* dog = dout + (b * Tq + t) * o_stride + h * HS;
  const T* og = out + (b * Tq + t) * o_stride + h * HS;
  float acc = 0.f;
#pragma unroll
  for (int d = lane * 2; d < HS; d += 64) {
    const float2 x = to_f32x2(*reinterpret_cast<const typename Pair<T>::type*>(dog + d));
    const float2 y = to_f32x2(*reinterpret_cast<const typename Pair<T>::type*>(og + d));
    acc = fmaf(x.x, y.x, fmaf(x.y, y.y, acc));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (lane == 0) dsum[row] = acc;
  float4* z = reinterpret_cast<float4*>(dq_acc + row * HS);
  for (int i = lane; i < HS / 4; i += 32) z[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// dq (T, q_stride) = dq_acc * scale; one thread per 8 elements.
template <class T, int HS>
__global__ void attn_bwd_dq_kernel(T* dq, const float* dq_acc, int64_t B, int64_t NH, int64_t Tq,
                                   int64_t q_stride, float scale) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  constexpr int CH = HS / 8;
  if (i >= B * NH * Tq * CH) return;
  const int64_t row = i / CH, c = i % CH;
  const int64_t bh = row / Tq, t = row % Tq, b = bh / NH, h = bh % NH;
  const float4* src = reinterpret_cast<const float4*>(dq_acc + row * HS + c * 8);
  const float4 x = src[0], y = src[1];
  uint4 w;
  w.x = pack2<T>(x.x * scale, x.y * scale);
  w.y = pack2<T>(x.z * scale, x.w * scale);
  w.z = pack2<T>(y.x * scale, y.y * scale);
  w.w = pack2<T>(y.z * scale, y.w * scale);
  *reinterpret_cast<uint4*>(dq + (b * Tq + t) * q_stride + h * HS + c * 8) = w;
}

// Each of the NW warps owns KM 16-key tiles (key tile BN = 16 * KM * NW) whose dK and dV stay in
// f32 registers; with KM = 2 every Q/dO fragment read from shared memory feeds two key tiles.
template <class T, int HS, int BM, int NW, int KM>
constexpr int bwd_smem_bytes() {
  return (2 * 16 * KM * NW + 4 * BM) * (HS + 8) * int(sizeof(T)) + 16 * KM * NW * (BM + 8) * int(sizeof(T)) +
         4 * BM * int(sizeof(float));
}

// One block per (b, key/value head, tile of BN keys); loops over tiles of BM queries of each of the
// key/value head's `group` query heads (one under multi-head attention), so dK and dV sum every
// query head that reads the keys.
template <class T, int HS, int BM, int NW, int KM>
__global__ void __launch_bounds__(NW * 32, KM == 1 ? 1 : 2) attn_bwd_kernel(const BwdParams<T> p) {
  constexpr int WN = 16 * KM, BN = WN * NW, P = HS + 8, PS = BM + 8, NT = NW * 32;
  constexpr int KT = HS / 16, QS = BM / 8, DT = HS / 8;
  constexpr int RG = BM / 16;  // 16-row groups of the dQ tile
  static_assert(NW % RG == 0, "every warp takes one 16-row group and a slice of the head dimension");
  constexpr int CS = NW / RG;  // head-dimension slices of the dQ tile
  constexpr int DQT = DT / CS;  // n8 tiles of dQ per warp
  static_assert(DQT % 2 == 0, "dQ slices are whole 16-column steps");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);  // T [BN][P]
  T* sV = sK + BN * P;                     // T [BN][P]
  T* sQ = sV + BN * P;                     // T [2][BM][P]
  T* sdO = sQ + 2 * BM * P;                // T [2][BM][P]
  T* sdS = sdO + 2 * BM * P;               // T [BN][PS]: dS^T of the current tile
  float* sL = reinterpret_cast<float*>(sdS + BN * PS);  // f32 [2][BM]: lse * log2(e)
  float* sD = sL + 2 * BM;                               // f32 [2][BM]: D

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, tig = lane & 3;
  const int64_t NKV = p.NH / p.group;
  const int64_t bk = blockIdx.x, b = bk / NKV, hk = bk % NKV;  // (batch row, key/value head)
  const int64_t n0 = int64_t(blockIdx.y) * BN;
  // Query head j of the group: its rows of q, dout, lse, D and the dQ accumulator.
  auto head_of = [&](int64_t j) { return b * p.NH + hk * p.group + j; };  // index into B * NH
  auto q_of = [&](int64_t j) { return p.q + b * p.Tq * p.q_stride + (hk * p.group + j) * HS; };
  auto do_of = [&](int64_t j) { return p.dout + b * p.Tq * p.o_stride + (hk * p.group + j) * HS; };

  // First query that sees key n0.
  int64_t q_begin = 0;
  if (p.causal && p.kv_pos0 + n0 - p.q_pos0 > 0) q_begin = p.kv_pos0 + n0 - p.q_pos0;
  const int m_first = int(q_begin / BM);
  const int m_tiles = q_begin < p.Tq ? int((p.Tq + BM - 1) / BM) : m_first;
  // Iteration it: query head it / n_m of the group, query tile m_first + it % n_m.
  const int n_m = m_tiles - m_first, iters = n_m * int(p.group);

  auto load_q_tile = [&](int it, int buf) {
    const int64_t j = it / n_m, m0 = int64_t(m_first + it % n_m) * BM;
    load_rows<HS, P, NT>(sQ + buf * BM * P, q_of(j) + m0 * p.q_stride, p.q_stride, BM, p.Tq - m0, tid);
    load_rows<HS, P, NT>(sdO + buf * BM * P, do_of(j) + m0 * p.o_stride, p.o_stride, BM, p.Tq - m0, tid);
    const float* lseg = p.lse + head_of(j) * p.Tq;
    const float* dsg = p.dsum + head_of(j) * p.Tq;
    for (int i = tid; i < BM; i += NT) {
      const bool ok = m0 + i < p.Tq;
      sL[buf * BM + i] = ok ? lseg[m0 + i] * kLog2e : 0.f;
      sD[buf * BM + i] = ok ? dsg[m0 + i] : 0.f;
    }
  };

  load_rows<HS, P, NT>(sK, p.k + (b * p.Tkv + n0) * p.kv_stride + hk * HS, p.kv_stride, BN, p.Tkv - n0, tid);
  load_rows<HS, P, NT>(sV, p.v + (b * p.Tkv + n0) * p.kv_stride + hk * HS, p.kv_stride, BN, p.Tkv - n0, tid);
  if (iters > 0) load_q_tile(0, 0);
  cp_async_commit();

  float dk[KM][DT][4], dv[KM][DT][4];  // f32 [WN, HS] accumulators of this warp's keys
#pragma unroll
  for (int km = 0; km < KM; ++km)
#pragma unroll
    for (int t = 0; t < DT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[km][t][e] = dv[km][t][e] = 0.f;
  const T* wK = sK + warp * WN * P;  // this warp's keys
  const T* wV = sV + warp * WN * P;

  for (int it = 0; it < iters; ++it) {
    const int cur = it & 1, m = m_first + it % n_m;
    float* dqg = p.dq_acc + head_of(it / n_m) * p.Tq * HS;
    cp_async_wait_all();
    __syncthreads();  // tile it landed; the previous tile's buffers and sdS are free
    if (it + 1 < iters) load_q_tile(it + 1, cur ^ 1);
    cp_async_commit();
    const T* cQ = sQ + cur * BM * P;
    const T* cdO = sdO + cur * BM * P;
    const float* cL = sL + cur * BM;
    const float* cD = sD + cur * BM;
    const int64_t m0 = int64_t(m) * BM;

    // S^T = K Q^T for this warp's keys: f32 [WN, BM].
    float s[KM][QS][4];
#pragma unroll
    for (int km = 0; km < KM; ++km)
#pragma unroll
      for (int j = 0; j < QS; ++j) s[km][j][0] = s[km][j][1] = s[km][j][2] = s[km][j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
      uint32_t af[KM][4];
#pragma unroll
      for (int km = 0; km < KM; ++km) ldsm_x4(af[km], wK + km * 16 * P + kk * 16 + a_off(lane, P));
#pragma unroll
      for (int j2 = 0; j2 < QS / 2; ++j2) {
        uint32_t bfr[4];
        ldsm_x4(bfr, cQ + j2 * 16 * P + kk * 16 + bnk_off(lane, P));
#pragma unroll
        for (int km = 0; km < KM; ++km) {
          mma16816<T>(s[km][2 * j2], af[km], bfr[0], bfr[1]);
          mma16816<T>(s[km][2 * j2 + 1], af[km], bfr[2], bfr[3]);
        }
      }
    }
    // P^T = exp(S^T scale - lse[query]), zero where masked (tile-local 32-bit terms: key row r
    // sees query column c iff r < kv_left, c < q_left and r <= c + shift).
    const bool need_mask =
        m0 + BM > p.Tq || n0 + BN > p.Tkv || (p.causal && p.kv_pos0 + n0 + BN - 1 > p.q_pos0 + m0);
    const int q_left = p.Tq - m0 < BM ? int(p.Tq - m0) : BM;
    const int kv_left = p.Tkv - n0 < BN ? int(p.Tkv - n0) : BN;
    const int64_t shift64 = p.causal ? p.q_pos0 + m0 - p.kv_pos0 - n0 : int64_t(BN);
    const int shift = int(shift64 < -BM ? -BM : (shift64 > BN ? BN : shift64));
#pragma unroll
    for (int km = 0; km < KM; ++km) {
#pragma unroll
      for (int j = 0; j < QS; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = j * 8 + tig * 2 + (e & 1);
          float pv = fast_exp2(fmaf(s[km][j][e], p.scale_log2, -cL[col]));
          if (need_mask) {
            const int row = warp * WN + km * 16 + g + (e >> 1) * 8;
            if (col >= q_left || row >= kv_left || row > col + shift) pv = 0.f;
          }
          s[km][j][e] = pv;
        }
      }
    }
    // dV += P^T dO.
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      uint32_t a[KM][4];
#pragma unroll
      for (int km = 0; km < KM; ++km) {
        a[km][0] = pack2<T>(s[km][2 * kk][0], s[km][2 * kk][1]);
        a[km][1] = pack2<T>(s[km][2 * kk][2], s[km][2 * kk][3]);
        a[km][2] = pack2<T>(s[km][2 * kk + 1][0], s[km][2 * kk + 1][1]);
        a[km][3] = pack2<T>(s[km][2 * kk + 1][2], s[km][2 * kk + 1][3]);
      }
#pragma unroll
      for (int t2 = 0; t2 < DT / 2; ++t2) {
        uint32_t bfr[4];
        ldsm_x4_t(bfr, cdO + kk * 16 * P + t2 * 16 + bkn_off(lane, P));
#pragma unroll
        for (int km = 0; km < KM; ++km) {
          mma16816<T>(dv[km][2 * t2], a[km], bfr[0], bfr[1]);
          mma16816<T>(dv[km][2 * t2 + 1], a[km], bfr[2], bfr[3]);
        }
      }
    }
    // dP^T = V dO^T: f32 [WN, BM]; then dS^T = P^T (dP^T - D[query]) in place of P^T.
    {
      float dp[KM][QS][4];
#pragma unroll
      for (int km = 0; km < KM; ++km)
#pragma unroll
        for (int j = 0; j < QS; ++j) dp[km][j][0] = dp[km][j][1] = dp[km][j][2] = dp[km][j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < KT; ++kk) {
        uint32_t af[KM][4];
#pragma unroll
        for (int km = 0; km < KM; ++km) ldsm_x4(af[km], wV + km * 16 * P + kk * 16 + a_off(lane, P));
#pragma unroll
        for (int j2 = 0; j2 < QS / 2; ++j2) {
          uint32_t bfr[4];
          ldsm_x4(bfr, cdO + j2 * 16 * P + kk * 16 + bnk_off(lane, P));
#pragma unroll
          for (int km = 0; km < KM; ++km) {
            mma16816<T>(dp[km][2 * j2], af[km], bfr[0], bfr[1]);
            mma16816<T>(dp[km][2 * j2 + 1], af[km], bfr[2], bfr[3]);
          }
        }
      }
#pragma unroll
      for (int km = 0; km < KM; ++km)
#pragma unroll
        for (int j = 0; j < QS; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[km][j][e] *= dp[km][j][e] - cD[j * 8 + tig * 2 + (e & 1)];
    }
    // dK += dS^T Q (scaled at the end), and dS^T to shared memory for dQ.
#pragma unroll
    for (int kk = 0; kk < BM / 16; ++kk) {
      uint32_t a[KM][4];
#pragma unroll
      for (int km = 0; km < KM; ++km) {
        a[km][0] = pack2<T>(s[km][2 * kk][0], s[km][2 * kk][1]);
        a[km][1] = pack2<T>(s[km][2 * kk][2], s[km][2 * kk][3]);
        a[km][2] = pack2<T>(s[km][2 * kk + 1][0], s[km][2 * kk + 1][1]);
        a[km][3] = pack2<T>(s[km][2 * kk + 1][2], s[km][2 * kk + 1][3]);
        T* wdS = sdS + (warp * WN + km * 16) * PS + kk * 16 + tig * 2;
        *reinterpret_cast<uint32_t*>(wdS + g * PS) = a[km][0];
        *reinterpret_cast<uint32_t*>(wdS + (g + 8) * PS) = a[km][1];
        *reinterpret_cast<uint32_t*>(wdS + g * PS + 8) = a[km][2];
        *reinterpret_cast<uint32_t*>(wdS + (g + 8) * PS + 8) = a[km][3];
      }
#pragma unroll
      for (int t2 = 0; t2 < DT / 2; ++t2) {
        uint32_t bfr[4];
        ldsm_x4_t(bfr, cQ + kk * 16 * P + t2 * 16 + bkn_off(lane, P));
#pragma unroll
        for (int km = 0; km < KM; ++km) {
          mma16816<T>(dk[km][2 * t2], a[km], bfr[0], bfr[1]);
          mma16816<T>(dk[km][2 * t2 + 1], a[km], bfr[2], bfr[3]);
        }
      }
    }
    __syncthreads();  // dS^T of every warp is in sdS

    // dQ[rows of group rg, columns of slice cs] += dS K, accumulated into f32 global memory.
    {
      const int rg = warp % RG, cs = warp / RG;
      float dq[DQT][4];
#pragma unroll
      for (int t = 0; t < DQT; ++t) dq[t][0] = dq[t][1] = dq[t][2] = dq[t][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t af[4];
        ldsm_x4_t(af, sdS + kk * 16 * PS + rg * 16 + at_off(lane, PS));
#pragma unroll
        for (int t2 = 0; t2 < DQT / 2; ++t2) {
          uint32_t bfr[4];
          ldsm_x4_t(bfr, sK + kk * 16 * P + cs * (HS / CS) + t2 * 16 + bkn_off(lane, P));
          mma16816<T>(dq[2 * t2], af, bfr[0], bfr[1]);
          mma16816<T>(dq[2 * t2 + 1], af, bfr[2], bfr[3]);
        }
      }
      const int64_t r0 = m0 + rg * 16 + g;
#pragma unroll
      for (int t = 0; t < DQT; ++t) {
        const int col = cs * (HS / CS) + t * 8 + tig * 2;
        if (r0 < p.Tq) atomic_add2(dqg + r0 * HS + col, dq[t][0], dq[t][1]);
        if (r0 + 8 < p.Tq) atomic_add2(dqg + (r0 + 8) * HS + col, dq[t][2], dq[t][3]);
      }
    }
  }

  // Write dK (scaled) and dV through this warp's rows of sK / sV.
  cp_async_wait_all();
  __syncthreads();  // every warp is done reading sK and sV
  T* oK = sK + warp * WN * P;
  T* oV = sV + warp * WN * P;
#pragma unroll
  for (int km = 0; km < KM; ++km) {
#pragma unroll
    for (int t = 0; t < DT; ++t) {
      const int c = t * 8 + tig * 2, r = km * 16 + g;
      *reinterpret_cast<uint32_t*>(oK + r * P + c) = pack2<T>(dk[km][t][0] * p.scale, dk[km][t][1] * p.scale);
      *reinterpret_cast<uint32_t*>(oK + (r + 8) * P + c) = pack2<T>(dk[km][t][2] * p.scale, dk[km][t][3] * p.scale);
      *reinterpret_cast<uint32_t*>(oV + r * P + c) = pack2<T>(dv[km][t][0], dv[km][t][1]);
      *reinterpret_cast<uint32_t*>(oV + (r + 8) * P + c) = pack2<T>(dv[km][t][2], dv[km][t][3]);
    }
  }
  __syncwarp();
  const int64_t row0 = n0 + warp * WN;
  T* dkg = p.dk + (b * p.Tkv + row0) * p.kv_stride + hk * HS;
  T* dvg = p.dv + (b * p.Tkv + row0) * p.kv_stride + hk * HS;
  for (int i = lane; i < WN * (HS / 8); i += 32) {
    const int r = i / (HS / 8), c = i % (HS / 8);
    if (row0 + r < p.Tkv) {
      *reinterpret_cast<uint4*>(dkg + r * p.kv_stride + c * 8) = *reinterpret_cast<const uint4*>(oK + r * P + c * 8);
      *reinterpret_cast<uint4*>(dvg + r * p.kv_stride + c * 8) = *reinterpret_cast<const uint4*>(oV + r * P + c * 8);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers.

// Tile shapes per head size (forward: queries 16*MT*NW x keys BN; backward: keys 16*KM*NW x
// queries BM). LOOM_FLASH_FWD_MT (1 or 2) overrides the forward's m16 tiles per warp and
// LOOM_FLASH_FWD128_BN its key tile at HS = 128 (MT = 2), LOOM_FLASH_BWD128_NW the warps of the
// HS = 128 backward, LOOM_FLASH_BWD64_KM (1 or 2) the HS = 64 backward's 16-key tiles per
// warp: hooks for benchmarking tile shapes.
#ifndef LOOM_FLASH_FWD_MT
#define LOOM_FLASH_FWD_MT 2
#endif
#ifndef LOOM_FLASH_BWD128_NW
#define LOOM_FLASH_BWD128_NW 8
#endif
#ifndef LOOM_FLASH_FWD128_BN
#define LOOM_FLASH_FWD128_BN 64
#endif
#ifndef LOOM_FLASH_BWD64_KM
#define LOOM_FLASH_BWD64_KM 2
#endif
template <int HS> struct Tiles;
template <> struct Tiles<64> {
  static constexpr int kFwdMT = LOOM_FLASH_FWD_MT;
  static constexpr int kFwdNW = kFwdMT == 1 ? 8 : 4, kFwdBN = kFwdMT == 1 ? 128 : 64;
  static constexpr int kBwdKM = LOOM_FLASH_BWD64_KM;
  static constexpr int kBwdNW = kBwdKM == 1 ? 8 : 4, kBwdBM = kBwdKM == 1 ? 64 : 32;
};
template <> struct Tiles<128> {
  static constexpr int kFwdMT = LOOM_FLASH_FWD_MT;
  static constexpr int kFwdNW = kFwdMT == 1 ? 8 : 4, kFwdBN = kFwdMT == 1 ? 64 : LOOM_FLASH_FWD128_BN;
  static constexpr int kBwdKM = 1, kBwdNW = LOOM_FLASH_BWD128_NW, kBwdBM = 32;
};

void check_args(const AttnArgs& a, const void* const* ptrs, int n_ptrs, const char* what) {
  LOOM_CHECK(flash_head_size_supported(a.HS), "{}: head size HS = {} is not supported (64 or 128)", what, a.HS);
  LOOM_CHECK(a.B >= 0 && a.NH >= 0 && a.Tq >= 0 && a.Tkv >= 0, "{}: negative size (B {}, NH {}, Tq {}, Tkv {})",
             what, a.B, a.NH, a.Tq, a.Tkv);
  const int64_t C = a.NH * a.HS, NKV = a.NKV > 0 ? a.NKV : a.NH;
  LOOM_CHECK(NKV >= 1 && a.NH % NKV == 0, "{}: NKV = {} key/value heads must divide NH = {}", what, NKV, a.NH);
  LOOM_CHECK(a.q_stride >= C && a.kv_stride >= NKV * a.HS && a.o_stride >= C,
             "{}: row strides (q {}, kv {}, o {}) must be at least NH * HS = {} (kv: NKV * HS = {})", what, a.q_stride,
             a.kv_stride, a.o_stride, C, NKV * a.HS);
  LOOM_CHECK(a.q_stride % 8 == 0 && a.kv_stride % 8 == 0 && a.o_stride % 8 == 0,
             "{}: row strides (q {}, kv {}, o {}) must be multiples of 8 elements (16-byte rows)", what, a.q_stride,
             a.kv_stride, a.o_stride);
  for (int i = 0; i < n_ptrs; ++i)
    LOOM_CHECK(reinterpret_cast<uintptr_t>(ptrs[i]) % 16 == 0, "{}: tensor argument {} is not 16-byte aligned",
               what, i);
  LOOM_CHECK(a.B * a.NH <= int64_t(INT32_MAX), "{}: B * NH = {} is too large", what, a.B * a.NH);
  LOOM_CHECK(a.scale >= 0.f && std::isfinite(a.scale), "{}: scale {} must be finite and >= 0", what, a.scale);
}

float resolve_scale(const AttnArgs& a) { return a.scale > 0.f ? a.scale : 1.f / std::sqrt(float(a.HS)); }

// cudaFuncSetAttribute runs before every launch on the kernel of this (T, HS) instantiation.
template <class T, int HS>
void launch_fwd(const FwdParams<T>& p, int64_t BNH, int64_t Tq, cudaStream_t stream) {
  constexpr int NW = Tiles<HS>::kFwdNW, BN = Tiles<HS>::kFwdBN, MT = Tiles<HS>::kFwdMT, BM = 16 * MT * NW;
  constexpr int smem = fwd_smem_bytes<T, HS, BN, NW, MT>();
  auto kernel = attn_fwd_kernel<T, HS, BN, NW, MT>;
  LOOM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int64_t m_tiles = ceil_div(Tq, BM);
  LOOM_CHECK(m_tiles <= 65535, "attention_forward: Tq = {} is too long", Tq);
  kernel<<<dim3(unsigned(BNH), unsigned(m_tiles)), NW * 32, smem, stream>>>(p);
  LOOM_CUDA_LAUNCH_CHECK();
}

template <class T, int HS>
void launch_bwd(const BwdParams<T>& p, T* dq, float* dsum, float* dq_acc, const T* dout, const T* out, int64_t B,
                int64_t o_stride, cudaStream_t stream) {
  const int64_t rows = B * p.NH * p.Tq;
  if (rows > 0) {
    const int threads = 256;
    attn_bwd_pre_kernel<T, HS><<<unsigned(ceil_div(rows * 32, threads)), threads, 0, stream>>>(
        dsum, dq_acc, dout, out, B, p.NH, p.Tq, o_stride);
    LOOM_CUDA_LAUNCH_CHECK();
  }
  if (p.Tkv > 0 && B * p.NH > 0) {
    constexpr int NW = Tiles<HS>::kBwdNW, BM = Tiles<HS>::kBwdBM, KM = Tiles<HS>::kBwdKM, BN = 16 * KM * NW;
    constexpr int smem = bwd_smem_bytes<T, HS, BM, NW, KM>();
    auto kernel = attn_bwd_kernel<T, HS, BM, NW, KM>;
    LOOM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const int64_t n_tiles = ceil_div(p.Tkv, BN);
    LOOM_CHECK(n_tiles <= 65535, "attention_backward: Tkv = {} is too long", p.Tkv);
    kernel<<<dim3(unsigned(B * (p.NH / p.group)), unsigned(n_tiles)), NW * 32, smem, stream>>>(p);
    LOOM_CUDA_LAUNCH_CHECK();
  }
  if (rows > 0) {
    const int threads = 256;
    attn_bwd_dq_kernel<T, HS><<<unsigned(ceil_div(rows * (HS / 8), threads)), threads, 0, stream>>>(
        dq, dq_acc, B, p.NH, p.Tq, p.q_stride, p.scale);
    LOOM_CUDA_LAUNCH_CHECK();
  }
}

constexpr size_t kAlign = 256;
size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

template <class T>
void attention_forward(T* out, float* lse, const T* q, const T* k, const T* v, const AttnArgs& a,
                       cudaStream_t stream) {
  static_assert(kIs16<T>, "attention_forward: T is bf16 or f16");
  const void* ptrs[] = {out, q, k, v};
  check_args(a, ptrs, 4, "attention_forward");
  if (a.B * a.NH == 0 || a.Tq == 0) return;
  LOOM_CHECK(reinterpret_cast<uintptr_t>(lse) % 4 == 0, "attention_forward: lse is not 4-byte aligned");
  FwdParams<T> p{out, lse, q, k, v, a.NH, a.Tq, a.Tkv, a.q_stride, a.kv_stride, a.o_stride, a.q_pos0, a.kv_pos0,
                 a.causal, resolve_scale(a) * kLog2e, a.NH / (a.NKV > 0 ? a.NKV : a.NH)};
  if (a.HS == 64)
    launch_fwd<T, 64>(p, a.B * a.NH, a.Tq, stream);
  else
    launch_fwd<T, 128>(p, a.B * a.NH, a.Tq, stream);
}

size_t attention_backward_workspace_bytes(const AttnArgs& a) {
  const size_t rows = size_t(a.B * a.NH * a.Tq);
  return align_up(rows * sizeof(float)) + align_up(rows * size_t(a.HS) * sizeof(float));
}

template <class T>
void attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const T* out,
                        const float* lse, const AttnArgs& a, void* workspace, cudaStream_t stream) {
  static_assert(kIs16<T>, "attention_backward: T is bf16 or f16");
  const void* ptrs[] = {dq, dk, dv, dout, q, k, v, out, workspace};
  check_args(a, ptrs, 9, "attention_backward");
  if (a.B * a.NH == 0) return;
  const size_t rows = size_t(a.B * a.NH * a.Tq);
  float* dsum = static_cast<float*>(workspace);  // f32 [B*NH, Tq]
  float* dq_acc = reinterpret_cast<float*>(static_cast<char*>(workspace) + align_up(rows * sizeof(float)));
  const float scale = resolve_scale(a);
  BwdParams<T> p{dk, dv, dq_acc, dsum, lse, q, k, v, dout, a.NH, a.Tq, a.Tkv, a.q_stride, a.kv_stride, a.o_stride,
                 a.q_pos0, a.kv_pos0, a.causal, scale, scale * kLog2e, a.NH / (a.NKV > 0 ? a.NKV : a.NH)};
  if (a.HS == 64)
    launch_bwd<T, 64>(p, dq, dsum, dq_acc, dout, out, a.B, a.o_stride, stream);
  else
    launch_bwd<T, 128>(p, dq, dsum, dq_acc, dout, out, a.B, a.o_stride, stream);
}

// The two element types (explicit instantiation definitions of the header's extern declarations).
template void attention_forward<bf16>(bf16*, float*, const bf16*, const bf16*, const bf16*, const AttnArgs&,
                                      cudaStream_t);
template void attention_forward<f16>(f16*, float*, const f16*, const f16*, const f16*, const AttnArgs&, cudaStream_t);
template void attention_backward<bf16>(bf16*, bf16*, bf16*, const bf16*, const bf16*, const bf16*, const bf16*,
                                       const bf16*, const float*, const AttnArgs&, void*, cudaStream_t);
template void attention_backward<f16>(f16*, f16*, f16*, const f16*, const f16*, const f16*, const f16*, const f16*,
                                      const float*, const AttnArgs&, void*, cudaStream_t);

}  // namespace loom::cuda

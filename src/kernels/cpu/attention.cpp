// Multi-head self-attention on the CPU, FlashAttention-2 style: the scores are computed a tile at a
// time with an online softmax, and backward recomputes them per tile from the saved log-sum-exp.
//
// Every product of two tiles goes through one register-tiled kernel (tile_gemm) written with GCC/Clang
// vector extensions: eight f32 lanes (one AVX2 register with -march=x86-64-v3, two NEON registers
// elsewhere), 6 x 16 accumulators. Its B operand is always a tile packed contiguously with a width that
// is a multiple of 8 (zero padding), so there is no remainder code in the inner loop.
//
// Threads: forward splits (b, h, query tile); backward splits (b, h, group of key tiles), each unit
// owning the dK/dV of its key tiles. dQ of one (b, h) is summed by one unit when there are enough (b, h)
// pairs to keep the threads busy, otherwise per-group partials are added in a fixed order. Tile sizes
// and groups depend on the shapes only, so results do not depend on the thread count.
#include "kernels/cpu/attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>

#include "core/error.h"

#if defined(__x86_64__) && defined(__FMA__)
#include <immintrin.h>
#define LOOM_ATTN_X86_FMA 1
#endif

namespace loom::cpu {
namespace {

constexpr int64_t kTileQ = 64;  // query rows per tile
constexpr int64_t kTileK = 64;  // keys per tile; a multiple of 8
// Backward splits the key tiles of a (b, h) into groups until there are at least this many units.
constexpr int64_t kMinBackwardUnits = 32;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof v); }
inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }
inline v8i splati(int32_t x) { return v8i{x, x, x, x, x, x, x, x}; }
// Lane-wise mask ? a : b for a mask of all-ones / all-zeros lanes.
inline v8f select(v8i mask, v8f a, v8f b) { return (v8f)(((v8i)a & mask) | ((v8i)b & ~mask)); }
inline v8f fmadd(v8f a, v8f b, v8f c) {
#ifdef LOOM_ATTN_X86_FMA
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}
inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}
inline float hmax(v8f v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}

// e^x lane-wise, within ~2 ulp for x in [-87, 88]; 0 below -87 (so -inf gives 0), +inf saturates at
// e^88, NaN propagates. Range reduction x = n ln2 + r with |r| <= ln2 / 2, then a degree-7 polynomial
// (minimax coefficients as in the Cephes library) and 2^n built in the exponent bits.
inline v8f exp8(v8f x) {
  const v8f lo = splat(-87.f), hi = splat(88.f);
  const v8i underflow = x < lo;
  v8f xc = select(underflow, lo, x);
  xc = select(xc > hi, hi, xc);
  const v8f magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  const v8f t = fmadd(xc, splat(1.44269504088896341f), magic);
  const v8f n = t - magic;
  const v8i ni = (v8i)t - (v8i)magic;
  v8f r = fmadd(n, splat(-0.693359375f), xc);
  r = fmadd(n, splat(2.12194440e-4f), r);
  v8f p = splat(1.9875691500e-4f);
  p = fmadd(p, r, splat(1.3981999507e-3f));
  p = fmadd(p, r, splat(8.3334519073e-3f));
  p = fmadd(p, r, splat(4.1665795894e-2f));
  p = fmadd(p, r, splat(1.6666665459e-1f));
  p = fmadd(p, r, splat(5.0000001201e-1f));
  p = fmadd(p * r, r, r + splat(1.f));
  const v8f pow2n = (v8f)((ni + splati(127)) << 23);
  return select(underflow, splat(0.f), p * pow2n);
}

// C[MR, 8 NV] (row stride ldc) = or += sum_p A(r, p) B[p, 0 : 8 NV], with A(r, p) = A[r rsa + p csa]
// (any layout: A^T is a swap of the strides) and B rows contiguous with stride ldb.
template <int MR, int NV>
inline void micro_kernel(int64_t K, const float* A, int64_t rsa, int64_t csa, const float* B, int64_t ldb,
                         float* C, int64_t ldc, bool accumulate) {
  v8f c[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) c[r][v] = accumulate ? load8(C + r * ldc + 8 * v) : splat(0.f);
  for (int64_t p = 0; p < K; ++p) {
    const float* b = B + p * ldb;
    v8f bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = load8(b + 8 * v);
    const float* ap = A + p * csa;
    for (int r = 0; r < MR; ++r) {
      const v8f av = splat(ap[r * rsa]);
      for (int v = 0; v < NV; ++v) c[r][v] = fmadd(av, bv[v], c[r][v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) store8(C + r * ldc + 8 * v, c[r][v]);
}

template <int NV>
void gemm_rows(int64_t M, int64_t K, const float* A, int64_t rsa, int64_t csa, const float* B, int64_t ldb,
               float* C, int64_t ldc, bool accumulate) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6)
    micro_kernel<6, NV>(K, A + m * rsa, rsa, csa, B, ldb, C + m * ldc, ldc, accumulate);
  const float* Am = A + m * rsa;
  float* Cm = C + m * ldc;
  switch (M - m) {
    case 5: micro_kernel<5, NV>(K, Am, rsa, csa, B, ldb, Cm, ldc, accumulate); break;
    case 4: micro_kernel<4, NV>(K, Am, rsa, csa, B, ldb, Cm, ldc, accumulate); break;
    case 3: micro_kernel<3, NV>(K, Am, rsa, csa, B, ldb, Cm, ldc, accumulate); break;
    case 2: micro_kernel<2, NV>(K, Am, rsa, csa, B, ldb, Cm, ldc, accumulate); break;
    case 1: micro_kernel<1, NV>(K, Am, rsa, csa, B, ldb, Cm, ldc, accumulate); break;
    default: break;
  }
}

// C[M, N] (ldc) = or += A(M x K; A(r, p) = A[r rsa + p csa]) B[K, N] (ldb). N is a multiple of 8.
void tile_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa, int64_t csa, const float* B,
               int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) gemm_rows<2>(M, K, A, rsa, csa, B + n, ldb, C + n, ldc, accumulate);
  if (n < N) gemm_rows<1>(M, K, A, rsa, csa, B + n, ldb, C + n, ldc, accumulate);
}

int64_t round_up8(int64_t n) { return (n + 7) / 8 * 8; }

// Scratch memory of one thread for one call: 64-byte aligned, uninitialised.
struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using Scratch = std::unique_ptr<float[], FreeDeleter>;
Scratch scratch(int64_t n) {
  const size_t bytes = (size_t(std::max<int64_t>(n, 1)) * sizeof(float) + 63) / 64 * 64;
  auto* p = static_cast<float*>(std::aligned_alloc(64, bytes));
  if (!p) throw std::bad_alloc();
  return Scratch(p);
}

// The first/last tensor row of head h in batch b: element (b, t, h, d) is at
// X[(b T + t) stride + h HS + d].
struct Rows {
  const float* p;
  int64_t stride;
  const float* row(int64_t t) const { return p + t * stride; }
};

// dst[t, 0 : HSp] = src row t (HS values) then zeros, for n rows.
void pack_rows(float* dst, int64_t HSp, Rows src, int64_t n, int64_t HS) {
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(dst + t * HSp, src.row(t), size_t(HS) * sizeof(float));
    std::fill(dst + t * HSp + HS, dst + (t + 1) * HSp, 0.f);
  }
}

// dst[d, 0 : np] = src[0 : n, d] (the transpose of n rows), zero columns n..np.
void pack_transposed(float* dst, int64_t np, Rows src, int64_t n, int64_t HS) {
  for (int64_t t = 0; t < n; ++t) {
    const float* s = src.row(t);
    for (int64_t d = 0; d < HS; ++d) dst[d * np + t] = s[d];
  }
  if (n < np)
    for (int64_t d = 0; d < HS; ++d) std::fill(dst + d * np + n, dst + (d + 1) * np, 0.f);
}

// Number of keys k0 .. k0 + kn - 1 of a tile that the query at global position qpos sees.
inline int64_t visible_keys(const AttnArgs& a, int64_t qpos, int64_t k0, int64_t kn) {
  if (!a.causal) return kn;
  return std::clamp<int64_t>(qpos - (a.kv_pos0 + k0) + 1, 0, kn);
}

float resolve_scale(const AttnArgs& a) { return a.scale != 0.f ? a.scale : 1.f / std::sqrt(float(a.HS)); }

void check_args(const AttnArgs& a, const char* fn) {
  LOOM_CHECK(a.B >= 0 && a.Tq >= 0 && a.Tkv >= 0,
             "{}: AttnArgs.B, Tq and Tkv must not be negative (B={}, Tq={}, Tkv={})", fn, a.B, a.Tq, a.Tkv);
  LOOM_CHECK(a.NH > 0 && a.HS > 0, "{}: AttnArgs.NH and AttnArgs.HS must be positive (NH={}, HS={})", fn,
             a.NH, a.HS);
  const int64_t C = a.NH * a.HS;
  LOOM_CHECK(a.q_stride >= C, "{}: AttnArgs.q_stride={} is smaller than NH*HS={}", fn, a.q_stride, C);
  LOOM_CHECK(a.kv_stride >= C, "{}: AttnArgs.kv_stride={} is smaller than NH*HS={}", fn, a.kv_stride, C);
  LOOM_CHECK(a.o_stride >= C, "{}: AttnArgs.o_stride={} is smaller than NH*HS={}", fn, a.o_stride, C);
  LOOM_CHECK(std::isfinite(a.scale), "{}: AttnArgs.scale={} is not finite", fn, a.scale);
}

}  // namespace

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const AttnArgs& a) {
  check_args(a, "attention_forward");
  if (a.B == 0 || a.Tq == 0) return;
  LOOM_CHECK(out && lse && q, "attention_forward: out, lse and q must not be null");
  LOOM_CHECK(a.Tkv == 0 || (k && v), "attention_forward: k and v must not be null when Tkv={} > 0", a.Tkv);

  const int64_t B = a.B, NH = a.NH, HS = a.HS, Tq = a.Tq, Tkv = a.Tkv;
  const int64_t HSp = round_up8(HS);
  const float scale = resolve_scale(a);
  const int64_t nqt = (Tq + kTileQ - 1) / kTileQ;
  const int64_t units = B * NH * nqt;

#pragma omp parallel
  {
    Scratch kt_buf = scratch(HS * kTileK);       // f32 [HS, knp]     K tile transposed
    Scratch v_buf = scratch(kTileK * HSp);       // f32 [kn, HSp]     V tile
    Scratch s_buf = scratch(kTileQ * kTileK);    // f32 [qn, kTileK]  scores, then probabilities
    Scratch o_buf = scratch(kTileQ * HSp);       // f32 [qn, HSp]     unnormalised output
    float row_max[kTileQ], row_sum[kTileQ];      // running max and sum of exp per query row
    float* kt = kt_buf.get();
    float* vp = v_buf.get();
    float* s = s_buf.get();
    float* o = o_buf.get();
    const v8i iota{0, 1, 2, 3, 4, 5, 6, 7};

    // Later query tiles see more keys under the causal mask: hand them out first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t qt = nqt - 1 - u / (B * NH);
      const int64_t bh = u % (B * NH);
      const int64_t b = bh / NH, h = bh % NH;
      const int64_t q0 = qt * kTileQ, qn = std::min(kTileQ, Tq - q0);
      const Rows qr{q + (b * Tq + q0) * a.q_stride + h * HS, a.q_stride};
      const int64_t qpos_last = a.q_pos0 + q0 + qn - 1;
      // Keys beyond kend are masked for every row of this tile.
      const int64_t kend = a.causal ? std::clamp<int64_t>(qpos_last - a.kv_pos0 + 1, 0, Tkv) : Tkv;

      std::fill(o, o + qn * HSp, 0.f);
      std::fill(row_max, row_max + qn, kNegInf);
      std::fill(row_sum, row_sum + qn, 0.f);
      for (int64_t k0 = 0; k0 < kend; k0 += kTileK) {
        const int64_t kn = std::min(kTileK, kend - k0), knp = round_up8(kn);
        const Rows kr{k + (b * Tkv + k0) * a.kv_stride + h * HS, a.kv_stride};
        const Rows vr{v + (b * Tkv + k0) * a.kv_stride + h * HS, a.kv_stride};
        pack_transposed(kt, knp, kr, kn, HS);
        pack_rows(vp, HSp, vr, kn, HS);
        // s [qn, knp] = q [qn, HS] k^T
        tile_gemm(qn, knp, HS, qr.p, a.q_stride, 1, kt, knp, s, kTileK, false);
        for (int64_t r = 0; r < qn; ++r) {
          float* sr = s + r * kTileK;
          const int64_t nvis = visible_keys(a, a.q_pos0 + q0 + r, k0, kn);
          if (nvis == 0) {
            std::fill(sr, sr + knp, 0.f);
            continue;
          }
          v8f mx = splat(kNegInf);
          for (int64_t j = 0; j < knp; j += 8) {
            const v8i keep = (iota + splati(int32_t(j))) < splati(int32_t(nvis));
            const v8f x = select(keep, load8(sr + j) * splat(scale), splat(kNegInf));
            store8(sr + j, x);
            mx = select(x > mx, x, mx);
          }
          const float m_new = std::max(row_max[r], hmax(mx));
          v8f sum = splat(0.f);
          for (int64_t j = 0; j < knp; j += 8) {
            const v8f p = exp8(load8(sr + j) - splat(m_new));
            store8(sr + j, p);
            sum += p;
          }
          const float alpha = row_max[r] == kNegInf ? 0.f : std::exp(row_max[r] - m_new);
          row_sum[r] = row_sum[r] * alpha + hsum(sum);
          row_max[r] = m_new;
          if (alpha != 1.f) {
            float* orow = o + r * HSp;
            for (int64_t d = 0; d < HSp; d += 8) store8(orow + d, load8(orow + d) * splat(alpha));
          }
        }
        // o [qn, HSp] += p [qn, kn] v [kn, HSp]
        tile_gemm(qn, HSp, kn, s, kTileK, 1, vp, HSp, o, HSp, true);
      }
      for (int64_t r = 0; r < qn; ++r) {
        float* dst = out + (b * Tq + q0 + r) * a.o_stride + h * HS;
        float* l = lse + (b * NH + h) * Tq + q0 + r;
        if (row_sum[r] == 0.f) {  // no visible key
          std::fill(dst, dst + HS, 0.f);
          *l = kNegInf;
          continue;
        }
        const float inv = 1.f / row_sum[r];
        const float* orow = o + r * HSp;
        for (int64_t d = 0; d < HS; ++d) dst[d] = orow[d] * inv;
        *l = row_max[r] + std::log(row_sum[r]);
      }
    }
  }
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                        const float* v, const float* out, const float* lse, const AttnArgs& a,
                        bool accumulate) {
  check_args(a, "attention_backward");
  if (a.B == 0) return;
  LOOM_CHECK(a.Tq == 0 || (dq && dout && q && out && lse),
             "attention_backward: dq, dout, q, out and lse must not be null when Tq={} > 0", a.Tq);
  LOOM_CHECK(a.Tkv == 0 || (dk && dv && k && v),
             "attention_backward: dk, dv, k and v must not be null when Tkv={} > 0", a.Tkv);

  const int64_t B = a.B, NH = a.NH, HS = a.HS, Tq = a.Tq, Tkv = a.Tkv;
  const int64_t BNH = B * NH;
  const int64_t HSp = round_up8(HS);
  const float scale = resolve_scale(a);
  const int64_t nkt = (Tkv + kTileK - 1) / kTileK;
  // Key tiles of a (b, h) are dealt round-robin to G groups (balanced under the causal mask).
  const int64_t G =
      BNH >= kMinBackwardUnits ? 1 : std::clamp<int64_t>((kMinBackwardUnits + BNH - 1) / BNH, 1, std::max<int64_t>(nkt, 1));
  const int64_t units = BNH * G;

  // D f32 [B, NH, Tq] = rowsum(dout * out)
  Scratch dsum_buf = scratch(BNH * Tq);
  float* dsum = dsum_buf.get();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < BNH * Tq; ++i) {
    const int64_t bh = i / Tq, t = i % Tq, b = bh / NH, h = bh % NH;
    const float* o = out + (b * Tq + t) * a.o_stride + h * HS;
    const float* g = dout + (b * Tq + t) * a.o_stride + h * HS;
    float acc = 0.f;
    for (int64_t d = 0; d < HS; ++d) acc += o[d] * g[d];
    dsum[i] = acc;
  }

  // With G > 1, each group's dQ goes to its own slice: f32 [G, B, NH, Tq, HSp].
  Scratch dq_part = G > 1 ? scratch(G * BNH * Tq * HSp) : Scratch();

#pragma omp parallel
  {
    Scratch kt_buf = scratch(HS * kTileK);     // f32 [HS, knp]    K tile transposed
    Scratch vt_buf = scratch(HS * kTileK);     // f32 [HS, knp]    V tile transposed
    Scratch k_buf = scratch(kTileK * HSp);     // f32 [kn, HSp]    K tile
    Scratch q_buf = scratch(kTileQ * HSp);     // f32 [qn, HSp]    Q tile
    Scratch do_buf = scratch(kTileQ * HSp);    // f32 [qn, HSp]    dO tile
    Scratch p_buf = scratch(kTileQ * kTileK);  // f32 [qn, kTileK] probabilities
    Scratch ds_buf = scratch(kTileQ * kTileK); // f32 [qn, kTileK] dP, then dS * scale
    Scratch dk_buf = scratch(kTileK * HSp);    // f32 [kn, HSp]    dK of the key tile
    Scratch dv_buf = scratch(kTileK * HSp);    // f32 [kn, HSp]    dV of the key tile
    Scratch dq_own = G == 1 ? scratch(Tq * HSp) : Scratch();  // f32 [Tq, HSp] dQ of the (b, h)
    float *kt = kt_buf.get(), *vt = vt_buf.get(), *kp = k_buf.get(), *qp = q_buf.get(), *dop = do_buf.get();
    float *p = p_buf.get(), *ds = ds_buf.get(), *dkt = dk_buf.get(), *dvt = dv_buf.get();
    const v8i iota{0, 1, 2, 3, 4, 5, 6, 7};

#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t bh = u / G, g = u % G;
      const int64_t b = bh / NH, h = bh % NH;
      float* dqa = G == 1 ? dq_own.get() : dq_part.get() + (g * BNH + bh) * Tq * HSp;  // f32 [Tq, HSp]
      std::fill(dqa, dqa + Tq * HSp, 0.f);
      const float* lse_bh = lse + bh * Tq;
      const float* dsum_bh = dsum + bh * Tq;

      for (int64_t kt_i = g; kt_i < nkt; kt_i += G) {
        const int64_t k0 = kt_i * kTileK, kn = std::min(kTileK, Tkv - k0), knp = round_up8(kn);
        const Rows kr{k + (b * Tkv + k0) * a.kv_stride + h * HS, a.kv_stride};
        const Rows vr{v + (b * Tkv + k0) * a.kv_stride + h * HS, a.kv_stride};
        pack_transposed(kt, knp, kr, kn, HS);
        pack_transposed(vt, knp, vr, kn, HS);
        pack_rows(kp, HSp, kr, kn, HS);
        std::fill(dkt, dkt + kn * HSp, 0.f);
        std::fill(dvt, dvt + kn * HSp, 0.f);
        // The first query that sees a key of this tile.
        const int64_t qstart = a.causal ? std::clamp<int64_t>(a.kv_pos0 + k0 - a.q_pos0, 0, Tq) : 0;

        for (int64_t q0 = qstart; q0 < Tq; q0 += kTileQ) {
          const int64_t qn = std::min(kTileQ, Tq - q0);
          const Rows qr{q + (b * Tq + q0) * a.q_stride + h * HS, a.q_stride};
          const Rows dor{dout + (b * Tq + q0) * a.o_stride + h * HS, a.o_stride};
          pack_rows(qp, HSp, qr, qn, HS);
          pack_rows(dop, HSp, dor, qn, HS);
          // s [qn, knp] = q k^T (into p), dp [qn, knp] = dout v^T (into ds)
          tile_gemm(qn, knp, HS, qr.p, a.q_stride, 1, kt, knp, p, kTileK, false);
          tile_gemm(qn, knp, HS, dor.p, a.o_stride, 1, vt, knp, ds, kTileK, false);
          for (int64_t r = 0; r < qn; ++r) {
            float* pr = p + r * kTileK;
            float* dsr = ds + r * kTileK;
            const float l = lse_bh[q0 + r];
            const int64_t nvis = l == kNegInf ? 0 : visible_keys(a, a.q_pos0 + q0 + r, k0, kn);
            const v8f lv = splat(l), dv_ = splat(dsum_bh[q0 + r]), sc = splat(scale);
            for (int64_t j = 0; j < knp; j += 8) {
              const v8i keep = (iota + splati(int32_t(j))) < splati(int32_t(nvis));
              // p = exp(s scale - lse) where visible, else 0; ds = p (dp - D) scale
              const v8f pj = select(keep, exp8(fmadd(load8(pr + j), sc, -lv)), splat(0.f));
              store8(pr + j, pj);
              store8(dsr + j, pj * (load8(dsr + j) - dv_) * sc);
            }
          }
          // dv [kn, HSp] += p^T dout; dk [kn, HSp] += ds^T q; dq [qn, HSp] += ds k
          tile_gemm(kn, HSp, qn, p, 1, kTileK, dop, HSp, dvt, HSp, true);
          tile_gemm(kn, HSp, qn, ds, 1, kTileK, qp, HSp, dkt, HSp, true);
          tile_gemm(qn, HSp, kn, ds, kTileK, 1, kp, HSp, dqa + q0 * HSp, HSp, true);
        }
        for (int64_t j = 0; j < kn; ++j) {
          float* dkr = dk + (b * Tkv + k0 + j) * a.kv_stride + h * HS;
          float* dvr = dv + (b * Tkv + k0 + j) * a.kv_stride + h * HS;
          const float* sk = dkt + j * HSp;
          const float* sv = dvt + j * HSp;
          if (accumulate) {
            for (int64_t d = 0; d < HS; ++d) dkr[d] += sk[d], dvr[d] += sv[d];
          } else {
            std::memcpy(dkr, sk, size_t(HS) * sizeof(float));
            std::memcpy(dvr, sv, size_t(HS) * sizeof(float));
          }
        }
      }
      if (G == 1) {
        for (int64_t t = 0; t < Tq; ++t) {
          float* dst = dq + (b * Tq + t) * a.q_stride + h * HS;
          const float* src = dqa + t * HSp;
          if (accumulate) {
            for (int64_t d = 0; d < HS; ++d) dst[d] += src[d];
          } else {
            std::memcpy(dst, src, size_t(HS) * sizeof(float));
          }
        }
      }
    }
  }

  if (G > 1) {
    // dq = (accumulate ? dq : 0) + part[0] + part[1] + ... in this order.
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < BNH * Tq; ++i) {
      const int64_t bh = i / Tq, t = i % Tq, b = bh / NH, h = bh % NH;
      float* dst = dq + (b * Tq + t) * a.q_stride + h * HS;
      for (int64_t d = 0; d < HS; ++d) {
        float acc = accumulate ? dst[d] : 0.f;
        for (int64_t gi = 0; gi < G; ++gi) acc += dq_part[((gi * BNH + bh) * Tq + t) * HSp + d];
        dst[d] = acc;
      }
    }
  }
}

}  // namespace loom::cpu

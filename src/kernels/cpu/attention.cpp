// Multi-head self-attention on the CPU, FlashAttention-2 style: the scores are computed a tile at a
// time with an online softmax, and backward recomputes them per tile from the saved log-sum-exp.
//
// Every product of two tiles goes through one register-tiled kernel (tile_gemm) written with GCC/Clang
// vector extensions: eight f32 lanes (one AVX2 register with -march=x86-64-v3, two NEON registers
// elsewhere), 6 x 16 accumulators. Its B operand is always a tile packed contiguously with a width that
// is a multiple of 8 (zero padding), so there is no remainder code in the inner loop.
//
// Threads: forward splits (b, h, set of query tiles); backward splits (b, h, group of key tiles), each
// unit owning the dK/dV of its key tiles. dQ of one (b, h) is summed by one unit when there are enough (b, h)
// pairs to keep the threads busy, otherwise per-group partials are added in a fixed order. Tile sizes
// and groups depend on the shapes only, so results do not depend on the thread count.
//
// Memory: a call's scratch (each thread's tiles and packed K/V or Q/dO panels, and backward's partial
// dQ sums) is one block of attention_workspace_bytes, computed from the same plan: the caller's
// (AttnArgs.scratch, usually an AttnWorkspace kept across calls) or, without one, taken from
// AttnArgs.pool under tag workspace for the call.
#include "kernels/cpu/attention.h"

#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#include "core/error.h"
#include "core/memory.h"

// Without AVX (a -march below x86-64-v3) GCC notes that 32-byte vectors change the ABI of the helpers
// below; they are all internal to this file.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

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
// Lane-wise max and min; a NaN in x propagates.
inline v8f max_with(v8f lo, v8f x) {
#ifdef LOOM_ATTN_X86_FMA
  return _mm256_max_ps(lo, x);
#else
  return select(x < lo, lo, x);
#endif
}
inline v8f min_with(v8f hi, v8f x) {
#ifdef LOOM_ATTN_X86_FMA
  return _mm256_min_ps(hi, x);
#else
  return select(x > hi, hi, x);
#endif
}
inline float hsum(v8f v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// e^x lane-wise, within ~2 ulp for x in [-87, 88]; 0 below -87 (so -inf gives 0), +inf saturates at
// e^88, NaN propagates. Range reduction x = n ln2 + r with |r| <= ln2 / 2, then a degree-7 polynomial
// (minimax coefficients as in the Cephes library) and 2^n built in the exponent bits.
inline v8f exp8(v8f x) {
  const v8f lo = splat(-87.f), hi = splat(88.f);
  const v8i underflow = x < lo;
  const v8f xc = min_with(hi, max_with(lo, x));
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

// Causal structure of a tile product, as offsets from the row index r (the defaults: none).
// Row r of the result is needed only in columns [r + col_lo, r + col_hi]; row r of A is nonzero only
// in the contraction range [r + k_lo, r + k_hi]. Register blocks that are entirely outside are
// skipped; an unneeded block of C is left unwritten when not accumulating, so the caller must mask it.
struct Band {
  static constexpr int64_t kNone = int64_t(1) << 60;
  int64_t col_lo = -kNone, col_hi = kNone, k_lo = -kNone, k_hi = kNone;
};

template <int MR, int NV>
inline void block(int64_t m, int64_t n, int64_t K, const float* A, int64_t rsa, int64_t csa, const float* B,
                  int64_t ldb, float* C, int64_t ldc, bool accumulate, const Band& band) {
  if (n > m + MR - 1 + band.col_hi || n + 8 * NV - 1 < m + band.col_lo) return;
  const int64_t kb = std::clamp<int64_t>(m + band.k_lo, 0, K);
  const int64_t ke = std::clamp<int64_t>(m + MR + band.k_hi, kb, K);
  micro_kernel<MR, NV>(ke - kb, A + m * rsa + kb * csa, rsa, csa, B + kb * ldb + n, ldb, C + m * ldc + n, ldc,
                       accumulate);
}

template <int NV>
void gemm_rows(int64_t M, int64_t n, int64_t K, const float* A, int64_t rsa, int64_t csa, const float* B,
               int64_t ldb, float* C, int64_t ldc, bool accumulate, const Band& band) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) block<6, NV>(m, n, K, A, rsa, csa, B, ldb, C, ldc, accumulate, band);
  switch (M - m) {
    case 5: block<5, NV>(m, n, K, A, rsa, csa, B, ldb, C, ldc, accumulate, band); break;
    case 4: block<4, NV>(m, n, K, A, rsa, csa, B, ldb, C, ldc, accumulate, band); break;
    case 3: block<3, NV>(m, n, K, A, rsa, csa, B, ldb, C, ldc, accumulate, band); break;
    case 2: block<2, NV>(m, n, K, A, rsa, csa, B, ldb, C, ldc, accumulate, band); break;
    case 1: block<1, NV>(m, n, K, A, rsa, csa, B, ldb, C, ldc, accumulate, band); break;
    default: break;
  }
}

// C[M, N] (ldc) = or += A(M x K; A(r, p) = A[r rsa + p csa]) B[K, N] (ldb). N is a multiple of 8.
void tile_gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t rsa, int64_t csa, const float* B,
               int64_t ldb, float* C, int64_t ldc, bool accumulate, const Band& band = {}) {
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) gemm_rows<2>(M, n, K, A, rsa, csa, B, ldb, C, ldc, accumulate, band);
  if (n < N) gemm_rows<1>(M, n, K, A, rsa, csa, B, ldb, C, ldc, accumulate, band);
}

int64_t round_up8(int64_t n) { return (n + 7) / 8 * 8; }

// Floats one buffer of n floats takes in a call's workspace: rounded up to 16 (64 bytes), so that
// every buffer starts on a cache line and no two threads' buffers share one.
int64_t padded(int64_t n) { return (n + 15) / 16 * 16; }

template <size_t N>
int64_t padded_sum(const std::array<int64_t, N>& sizes) {
  int64_t total = 0;
  for (int64_t n : sizes) total += padded(n);
  return total;
}

// N f32 buffers of the given sizes carved from p, in order.
template <size_t N>
std::array<float*, N> carve(float* p, const std::array<int64_t, N>& sizes) {
  std::array<float*, N> out;
  for (size_t i = 0; i < N; ++i) {
    out[i] = p;
    p += padded(sizes[i]);
  }
  return out;
}

// How a call splits its work and lays out its workspace; a function of the shapes and the thread
// count only, shared by the kernels and attention_workspace_bytes so the two cannot disagree.
// The workspace is `shared` floats used by the whole call, then `team` blocks of `per_thread`
// floats, one per thread of the OpenMP team.
template <size_t N>
struct Plan {
  int64_t split = 1;  // forward: query-tile chunks per (b, h); backward: key-tile groups G
  int64_t units = 0;  // work items of the parallel loop
  int team = 1;       // threads the call runs on: no more than there are units
  std::array<int64_t, N> sizes{};  // each thread's buffers, in floats
  int64_t per_thread = 0, shared = 0;
  int64_t bytes() const { return (shared + int64_t(team) * per_thread) * int64_t(sizeof(float)); }
};

int64_t kv_heads(const AttnArgs& a) { return a.NKV > 0 ? a.NKV : a.NH; }

int team_for(int threads, int64_t units) { return int(std::clamp<int64_t>(units, 1, threads)); }

Plan<5> forward_plan(const AttnArgs& a, int threads) {
  const int64_t HS = a.HS, HSp = round_up8(HS), Tq = a.Tq, Tkv = a.Tkv;
  const int64_t nqt = (Tq + kTileQ - 1) / kTileQ;
  // A unit is every chunks-th query tile of one (b, h) (interleaved: balanced under the causal mask),
  // so that K and V are packed once per unit. Enough units for about 4 per thread; the split does not
  // change any result (each query tile is computed the same way whoever computes it).
  const int64_t BNH = a.B * a.NH;
  Plan<5> p;
  p.split = std::clamp<int64_t>((4 * int64_t(threads) + BNH - 1) / BNH, 1, std::max<int64_t>(nqt, 1));
  p.units = BNH * p.split;
  p.team = team_for(threads, p.units);
  // qt f32 [HS, qnp]: (q scale)^T; kall, vall f32 [Tkv, HSp]: K and V of the (b, h), packed as
  // needed; st f32 [kn, kTileQ]: scores^T, then probabilities^T; o f32 [qn, HSp]: unnormalised output
  p.sizes = {HS * kTileQ, Tkv * HSp, Tkv * HSp, kTileK * kTileQ, kTileQ * HSp};
  p.per_thread = padded_sum(p.sizes);
  return p;
}

Plan<11> backward_plan(const AttnArgs& a, int threads) {
  const int64_t HS = a.HS, HSp = round_up8(HS), Tq = a.Tq, Tkv = a.Tkv;
  const int64_t BNH = a.B * a.NH, BNKV = a.B * kv_heads(a);
  const int64_t nkt = (Tkv + kTileK - 1) / kTileK;
  Plan<11> p;
  // Key tiles of a (b, kv head) are dealt round-robin to G groups (balanced under the causal mask).
  p.split = BNKV >= kMinBackwardUnits
                ? 1
                : std::clamp<int64_t>((kMinBackwardUnits + BNKV - 1) / BNKV, 1, std::max<int64_t>(nkt, 1));
  const int64_t G = p.split;
  p.units = BNKV * G;
  p.team = team_for(threads, p.units);
  // kt, vt f32 [HS, knp]: K and V tile transposed; kp f32 [kn, HSp]: K tile * scale;
  // qall, doall f32 [Tq, HSp]: Q * scale and dO of the (b, h); dsum_bh f32 [Tq]: D = rowsum(dO * O);
  // p f32 [qn, kTileK]: probabilities; ds f32 [qn, kTileK]: dP, then dS; dkt, dvt f32 [kn, HSp]: dK
  // and dV of the key tile; dq_own f32 [Tq, HSp]: dQ of the (b, h) when G == 1
  p.sizes = {HS * kTileK,    HS * kTileK,     kTileK * HSp, Tq * HSp,     Tq * HSp, Tq,
             kTileQ * kTileK, kTileQ * kTileK, kTileK * HSp, kTileK * HSp, G == 1 ? Tq * HSp : 0};
  p.per_thread = padded_sum(p.sizes);
  // With G > 1, each group's dQ goes to its own slice: f32 [G, B, NH, Tq, HSp].
  p.shared = G > 1 ? padded(G * BNH * Tq * HSp) : 0;
  return p;
}

void check_pool(const MemoryPool& pool, const char* fn, const char* field) {
  LOOM_CHECK(host_memory(pool.device()), "{}: {} '{}' holds {} memory; the CPU kernel needs a host pool", fn, field,
             pool.name(), device_name(pool.device()));
}

// The OpenMP team a call may use: the calling thread's omp_get_max_threads().
int max_threads() { return std::max(1, omp_get_max_threads()); }

// The scratch of a call that needs `need` bytes: the caller's (AttnArgs.scratch), or one taken
// into `own` from AttnArgs.pool for this call only.
float* call_scratch(const AttnArgs& a, int64_t need, std::optional<AttnWorkspace>& own, const char* fn) {
  if (a.scratch) {
    LOOM_CHECK(a.scratch_bytes >= need,
               "{}: AttnArgs.scratch_bytes = {} is smaller than the {} bytes this call needs "
               "(attention_workspace_bytes at {} threads)",
               fn, a.scratch_bytes, need, max_threads());
    return a.scratch;
  }
  LOOM_CHECK(a.scratch_bytes == 0, "{}: AttnArgs.scratch_bytes = {} but AttnArgs.scratch is null", fn,
             a.scratch_bytes);
  MemoryPool& pool = a.pool ? *a.pool : default_cpu_pool();
  check_pool(pool, fn, "AttnArgs.pool");
  if (need == 0) return nullptr;
  own.emplace(pool);
  own->reserve(need);
  return own->args(AttnArgs{}).scratch;
}

// Rows of one head in a row-strided tensor: row t starts at p + t stride (p points at (b, t0, h, 0)).
struct Rows {
  const float* p;
  int64_t stride;
  const float* row(int64_t t) const { return p + t * stride; }
};

// dst[t, 0 : HSp] = src row t (HS values) mul, then zeros, for n rows.
void pack_rows(float* dst, int64_t HSp, Rows src, int64_t n, int64_t HS, float mul = 1.f) {
  for (int64_t t = 0; t < n; ++t) {
    const float* s = src.row(t);
    float* d = dst + t * HSp;
    if (mul == 1.f) {
      std::memcpy(d, s, size_t(HS) * sizeof(float));
    } else {
      for (int64_t i = 0; i < HS; ++i) d[i] = s[i] * mul;
    }
    std::fill(d + HS, d + HSp, 0.f);
  }
}

// dst[d, 0 : np] = src[0 : n, d] mul (the transpose of n rows), zero columns n..np.
void pack_transposed(float* dst, int64_t np, Rows src, int64_t n, int64_t HS, float mul = 1.f) {
  for (int64_t t = 0; t < n; ++t) {
    const float* s = src.row(t);
    for (int64_t d = 0; d < HS; ++d) dst[d * np + t] = s[d] * mul;
  }
  if (n < np)
    for (int64_t d = 0; d < HS; ++d) std::fill(dst + d * np + n, dst + (d + 1) * np, 0.f);
}

// sum_d x[d] y[d] over n values.
float dot(const float* x, const float* y, int64_t n) {
  v8f acc = splat(0.f);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) acc = fmadd(load8(x + d), load8(y + d), acc);
  float r = hsum(acc);
  for (; d < n; ++d) r += x[d] * y[d];
  return r;
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
  LOOM_CHECK(a.NKV >= 0 && (a.NKV == 0 || a.NH % a.NKV == 0),
             "{}: AttnArgs.NKV={} must divide NH={} (grouped-query attention)", fn, a.NKV, a.NH);
  const int64_t C = a.NH * a.HS, Ckv = kv_heads(a) * a.HS;
  LOOM_CHECK(a.q_stride >= C, "{}: AttnArgs.q_stride={} is smaller than NH*HS={}", fn, a.q_stride, C);
  LOOM_CHECK(a.kv_stride >= Ckv, "{}: AttnArgs.kv_stride={} is smaller than NKV*HS={}", fn, a.kv_stride, Ckv);
  LOOM_CHECK(a.o_stride >= C, "{}: AttnArgs.o_stride={} is smaller than NH*HS={}", fn, a.o_stride, C);
  LOOM_CHECK(std::isfinite(a.scale), "{}: AttnArgs.scale={} is not finite", fn, a.scale);
}

}  // namespace

int64_t attention_workspace_bytes(const AttnArgs& a, bool backward, int threads) {
  check_args(a, "attention_workspace_bytes");
  LOOM_CHECK(threads > 0, "attention_workspace_bytes: threads={} must be positive", threads);
  if (backward) return a.B == 0 ? 0 : backward_plan(a, threads).bytes();
  return a.B == 0 || a.Tq == 0 ? 0 : forward_plan(a, threads).bytes();
}

int64_t attention_training_workspace_bytes(const AttnArgs& a, int threads) {
  return std::max(attention_workspace_bytes(a, false, threads), attention_workspace_bytes(a, true, threads));
}

void AttnWorkspace::reserve(int64_t bytes) {
  LOOM_CHECK(bytes >= 0, "attention workspace: cannot reserve {} bytes", bytes);
  if (bytes <= bytes_) return;
  check_pool(pool_, "attention workspace", "pool");
  release();
  p_ = static_cast<float*>(pool_.allocate(size_t(bytes), MemTag::workspace));
  bytes_ = bytes;
}

AttnArgs AttnWorkspace::args(AttnArgs a) const {
  LOOM_CHECK(p_ != nullptr, "attention workspace (pool '{}'): nothing reserved", pool_.name());
  a.scratch = p_;
  a.scratch_bytes = bytes_;
  a.pool = &pool_;
  return a;
}

AttnArgs AttnWorkspace::use(const AttnArgs& a, bool backward) {
  const int64_t need = attention_workspace_bytes(a, backward, max_threads());
  reserve(need);
  return need > 0 ? args(a) : a;
}

void AttnWorkspace::release() {
  if (p_) pool_.deallocate(p_, size_t(bytes_), MemTag::workspace);
  p_ = nullptr;
  bytes_ = 0;
}

void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                       const AttnArgs& a) {
  check_args(a, "attention_forward");
  if (a.B == 0 || a.Tq == 0) return;
  LOOM_CHECK(out && lse && q, "attention_forward: out, lse and q must not be null");
  LOOM_CHECK(a.Tkv == 0 || (k && v), "attention_forward: k and v must not be null when Tkv={} > 0", a.Tkv);

  const int64_t NH = a.NH, HS = a.HS, Tq = a.Tq, Tkv = a.Tkv, group = NH / kv_heads(a);
  const int64_t HSp = round_up8(HS);
  const float scale = resolve_scale(a);
  const int64_t nqt = (Tq + kTileQ - 1) / kTileQ;
  const Plan<5> plan = forward_plan(a, max_threads());
  const int64_t chunks = plan.split, units = plan.units;
  std::optional<AttnWorkspace> own;
  float* const ws = call_scratch(a, plan.bytes(), own, "attention_forward");

  // The scores are kept transposed, s^T [keys, queries], so that the online softmax runs down the
  // columns with eight queries per vector (no horizontal reductions); q^T is packed once per query
  // tile and K, V once per unit.
#pragma omp parallel num_threads(plan.team)
  {
    // The buffers of forward_plan: qt, kall, vall, st, o
    const std::array<float*, 5> w = carve(ws + omp_get_thread_num() * plan.per_thread, plan.sizes);
    float *qt = w[0], *kall = w[1], *vall = w[2], *st = w[3], *o = w[4];
    alignas(32) float row_max[kTileQ], row_sum[kTileQ], alpha[kTileQ];  // per query
    const v8i iota{0, 1, 2, 3, 4, 5, 6, 7};
    const v8f neg_inf = splat(kNegInf), zero = splat(0.f);

#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t bh = u / chunks;
      const int64_t b = bh / NH, h = bh % NH, hk = h / group;
      int64_t packed = 0;  // rows of kall / vall filled
      for (int64_t qti = u % chunks; qti < nqt; qti += chunks) {
        const int64_t q0 = qti * kTileQ, qn = std::min(kTileQ, Tq - q0), qnp = round_up8(qn);
        const Rows qr{q + b * a.q_batch_stride() + q0 * a.q_stride + h * HS, a.q_stride};
        pack_transposed(qt, qnp, qr, qn, HS, scale);
        const int64_t qpos0 = a.q_pos0 + q0;  // position of query lane 0
        // Keys beyond kend are masked for every query of this tile.
        const int64_t kend = a.causal ? std::clamp<int64_t>(qpos0 + qn - 1 - a.kv_pos0 + 1, 0, Tkv) : Tkv;

        if (packed < kend) {
          const Rows kr{k + b * a.kv_batch_stride() + packed * a.kv_stride + hk * HS, a.kv_stride};
          const Rows vr{v + b * a.kv_batch_stride() + packed * a.kv_stride + hk * HS, a.kv_stride};
          pack_rows(kall + packed * HSp, HSp, kr, kend - packed, HS);
          pack_rows(vall + packed * HSp, HSp, vr, kend - packed, HS);
          packed = kend;
        }
        std::fill(o, o + qn * HSp, 0.f);
        std::fill(row_max, row_max + qnp, kNegInf);
        std::fill(row_sum, row_sum + qnp, 0.f);
        for (int64_t k0 = 0; k0 < kend; k0 += kTileK) {
          const int64_t kn = std::min(kTileK, kend - k0);
          const float* kp = kall + k0 * HSp;  // f32 [kn, HSp]
          const float* vp = vall + k0 * HSp;  // f32 [kn, HSp]
          // Key j is visible to query lanes i >= j + first0.
          const int64_t first0 = a.kv_pos0 + k0 - qpos0;
          const Band s_band = a.causal ? Band{.col_lo = first0} : Band{};
          const Band pv_band = a.causal ? Band{.k_hi = -first0} : Band{};
          // s^T [kn, qnp] = k (q scale)^T; blocks left of the band stay unwritten and are masked below
          tile_gemm(kn, qnp, HS, kp, HSp, 1, qt, qnp, st, kTileQ, false, s_band);
          // Mask (key j is visible to query lanes i >= first[j]) and the column maxima.
          for (int64_t c = 0; c < qnp; c += 8) {
            v8f mx = neg_inf;
            for (int64_t j = 0; j < kn; ++j) {
              float* sj = st + j * kTileQ + c;
              v8f x = load8(sj);
              if (a.causal) {
                const int64_t first = first0 + j;
                if (first > c) {
                  x = select((iota + splati(int32_t(c))) >= splati(int32_t(std::min<int64_t>(first, c + 8))), x,
                             neg_inf);
                  store8(sj, x);
                }
              }
              mx = select(x > mx, x, mx);
            }
            const v8f m_old = load8(row_max + c);
            const v8f m_new = select(mx > m_old, mx, m_old);
            // Columns with no visible key so far keep max -inf: subtract 0 instead so exp gives 0, not NaN.
            const v8f m_sub = select(m_new == neg_inf, zero, m_new);
            v8f sum = zero;
            for (int64_t j = 0; j < kn; ++j) {
              float* sj = st + j * kTileQ + c;
              const v8f pj = exp8(load8(sj) - m_sub);
              store8(sj, pj);
              sum += pj;
            }
            const v8f al = select(m_old == neg_inf, zero, exp8(m_old - m_sub));
            store8(alpha + c, al);
            store8(row_sum + c, load8(row_sum + c) * al + sum);
            store8(row_max + c, m_new);
          }
          for (int64_t i = 0; i < qn; ++i) {
            if (alpha[i] == 1.f) continue;
            float* orow = o + i * HSp;
            const v8f al = splat(alpha[i]);
            for (int64_t d = 0; d < HSp; d += 8) store8(orow + d, load8(orow + d) * al);
          }
          // o [qn, HSp] += p [qn, kn] v [kn, HSp], p read through the transposed buffer
          tile_gemm(qn, HSp, kn, st, 1, kTileQ, vp, HSp, o, HSp, true, pv_band);
        }
        for (int64_t i = 0; i < qn; ++i) {
          float* dst = out + b * a.o_batch_stride() + (q0 + i) * a.o_stride + h * HS;
          float* l = lse + b * a.lse_batch_stride() + h * Tq + q0 + i;
          if (row_sum[i] == 0.f) {  // no visible key
            std::fill(dst, dst + HS, 0.f);
            *l = kNegInf;
            continue;
          }
          const float inv = 1.f / row_sum[i];
          const float* orow = o + i * HSp;
          for (int64_t d = 0; d < HS; ++d) dst[d] = orow[d] * inv;
          *l = row_max[i] + std::log(row_sum[i]);
        }
      }
    }
  }
}

void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                        const float* v, const float* out, const float* lse, const AttnArgs& a) {
  check_args(a, "attention_backward");
  if (a.B == 0) return;
  LOOM_CHECK(a.Tq == 0 || (dq && dout && q && out && lse),
             "attention_backward: dq, dout, q, out and lse must not be null when Tq={} > 0", a.Tq);
  LOOM_CHECK(a.Tkv == 0 || (dk && dv && k && v),
             "attention_backward: dk, dv, k and v must not be null when Tkv={} > 0", a.Tkv);

  const int64_t B = a.B, NH = a.NH, HS = a.HS, Tq = a.Tq, Tkv = a.Tkv;
  const int64_t NKV = kv_heads(a), group = NH / NKV;
  const int64_t BNH = B * NH;
  const int64_t HSp = round_up8(HS);
  const float scale = resolve_scale(a);
  const int64_t nkt = (Tkv + kTileK - 1) / kTileK;
  const Plan<11> plan = backward_plan(a, max_threads());
  const int64_t G = plan.split, units = plan.units;
  std::optional<AttnWorkspace> own;
  float* const ws = call_scratch(a, plan.bytes(), own, "attention_backward");

  // With G > 1, each group's dQ goes to its own slice: f32 [G, B, NH, Tq, HSp].
  float* dq_part = G > 1 ? ws : nullptr;

#pragma omp parallel num_threads(plan.team)
  {
    // The buffers of backward_plan: kt, vt, kp, qall, doall, dsum_bh, p, ds, dkt, dvt, dq_own
    const std::array<float*, 11> w =
        carve(ws + plan.shared + omp_get_thread_num() * plan.per_thread, plan.sizes);
    float *kt = w[0], *vt = w[1], *kp = w[2], *qall = w[3], *doall = w[4], *dsum_bh = w[5];
    float *p = w[6], *ds = w[7], *dkt = w[8], *dvt = w[9], *dq_own = w[10];
    const v8i iota{0, 1, 2, 3, 4, 5, 6, 7};

#pragma omp for schedule(dynamic, 1)
    for (int64_t u = 0; u < units; ++u) {
      // A unit owns key tiles g, g + G, ... of one (b, kv head) and runs the query heads that read
      // them one after another: the first writes dK and dV, the others
      // add, in head order, so the sums do not depend on the thread count.
      const int64_t bhk = u / G, g = u % G;
      const int64_t b = bhk / NKV, hk = bhk % NKV;
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        const bool first_head = h == hk * group;
        const int64_t bh = b * NH + h;
        float* dqa = G == 1 ? dq_own : dq_part + (g * BNH + bh) * Tq * HSp;  // f32 [Tq, HSp]
        std::fill(dqa, dqa + Tq * HSp, 0.f);
        const float* lse_bh = lse + b * a.lse_batch_stride() + h * Tq;
        pack_rows(qall, HSp, Rows{q + b * a.q_batch_stride() + h * HS, a.q_stride}, Tq, HS, scale);
        const Rows dor{dout + b * a.o_batch_stride() + h * HS, a.o_stride};
        const Rows outr{out + b * a.o_batch_stride() + h * HS, a.o_stride};
        pack_rows(doall, HSp, dor, Tq, HS);
        for (int64_t t = 0; t < Tq; ++t) dsum_bh[t] = dot(doall + t * HSp, outr.row(t), HS);

        for (int64_t kt_i = g; kt_i < nkt; kt_i += G) {
          const int64_t k0 = kt_i * kTileK, kn = std::min(kTileK, Tkv - k0), knp = round_up8(kn);
          const Rows kr{k + b * a.kv_batch_stride() + k0 * a.kv_stride + hk * HS, a.kv_stride};
          const Rows vr{v + b * a.kv_batch_stride() + k0 * a.kv_stride + hk * HS, a.kv_stride};
          pack_transposed(kt, knp, kr, kn, HS);
          pack_transposed(vt, knp, vr, kn, HS);
          pack_rows(kp, HSp, kr, kn, HS, scale);
          std::fill(dkt, dkt + kn * HSp, 0.f);
          std::fill(dvt, dvt + kn * HSp, 0.f);
          // The first query that sees a key of this tile.
          const int64_t qstart = a.causal ? std::clamp<int64_t>(a.kv_pos0 + k0 - a.q_pos0, 0, Tq) : 0;

          for (int64_t q0 = qstart; q0 < Tq; q0 += kTileQ) {
            const int64_t qn = std::min(kTileQ, Tq - q0);
            const float* qp = qall + q0 * HSp;    // f32 [qn, HSp]
            const float* dop = doall + q0 * HSp;  // f32 [qn, HSp]
            // Query i sees keys j <= i + last0. Blocks right of the band stay unwritten and are masked.
            const int64_t last0 = a.q_pos0 + q0 - a.kv_pos0 - k0;
            const Band s_band = a.causal ? Band{.col_hi = last0} : Band{};
            const Band kv_band = a.causal ? Band{.k_lo = -last0} : Band{};
            const Band q_band = a.causal ? Band{.k_hi = last0} : Band{};
            // s [qn, knp] = (q scale) k^T (into p), dp [qn, knp] = dout v^T (into ds)
            tile_gemm(qn, knp, HS, qp, HSp, 1, kt, knp, p, kTileK, false, s_band);
            tile_gemm(qn, knp, HS, dop, HSp, 1, vt, knp, ds, kTileK, false, s_band);
            for (int64_t r = 0; r < qn; ++r) {
              float* pr = p + r * kTileK;
              float* dsr = ds + r * kTileK;
              const float l = lse_bh[q0 + r];
              const int64_t nvis = l == kNegInf ? 0 : visible_keys(a, a.q_pos0 + q0 + r, k0, kn);
              const v8f lv = splat(l), dr = splat(dsum_bh[q0 + r]);
              for (int64_t j = 0; j < knp; j += 8) {
                const v8i keep = (iota + splati(int32_t(j))) < splati(int32_t(nvis));
                // p = exp(s - lse) where visible, else 0; ds = p (dp - D) (the scale is in the packed q and k)
                const v8f pj = select(keep, exp8(load8(pr + j) - lv), splat(0.f));
                store8(pr + j, pj);
                store8(dsr + j, select(keep, pj * (load8(dsr + j) - dr), splat(0.f)));
              }
            }
            // dv [kn, HSp] += p^T dout; dk [kn, HSp] += ds^T (q scale); dq [qn, HSp] += ds (k scale)
            tile_gemm(kn, HSp, qn, p, 1, kTileK, dop, HSp, dvt, HSp, true, kv_band);
            tile_gemm(kn, HSp, qn, ds, 1, kTileK, qp, HSp, dkt, HSp, true, kv_band);
            tile_gemm(qn, HSp, kn, ds, kTileK, 1, kp, HSp, dqa + q0 * HSp, HSp, true, q_band);
          }
          for (int64_t j = 0; j < kn; ++j) {
            float* dkr = dk + b * a.kv_batch_stride() + (k0 + j) * a.kv_stride + hk * HS;
            float* dvr = dv + b * a.kv_batch_stride() + (k0 + j) * a.kv_stride + hk * HS;
            const float* sk = dkt + j * HSp;
            const float* sv = dvt + j * HSp;
            if (!first_head) {
              for (int64_t d = 0; d < HS; ++d) dkr[d] += sk[d], dvr[d] += sv[d];
            } else {
              std::memcpy(dkr, sk, size_t(HS) * sizeof(float));
              std::memcpy(dvr, sv, size_t(HS) * sizeof(float));
            }
          }
        }
        if (G == 1) {
          for (int64_t t = 0; t < Tq; ++t) {
            float* dst = dq + b * a.q_batch_stride() + t * a.q_stride + h * HS;
            std::memcpy(dst, dqa + t * HSp, size_t(HS) * sizeof(float));
          }
        }
      }  // query heads of the kv head
    }
  }

  if (G > 1) {
    // dq = part[0] + part[1] + ... in this order.
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < BNH * Tq; ++i) {
      const int64_t bh = i / Tq, t = i % Tq, b = bh / NH, h = bh % NH;
      float* dst = dq + b * a.q_batch_stride() + t * a.q_stride + h * HS;
      for (int64_t d = 0; d < HS; ++d) {
        float acc = 0.f;
        for (int64_t gi = 0; gi < G; ++gi) acc += dq_part[((gi * BNH + bh) * Tq + t) * HSp + d];
        dst[d] = acc;
      }
    }
  }
}

}  // namespace loom::cpu

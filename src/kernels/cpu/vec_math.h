// AVX2 helpers shared by the CPU kernels: a vectorised exp, horizontal reductions and masked
// loads/stores for row tails. The build baseline is x86-64-v3 (AVX2 + FMA), so these are always
// available; wider paths, where they matter (GEMM), are chosen at run time by oneDNN.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace loom::cpu::vec {

constexpr int kWidth = 8;  // floats per __m256

// exp(x) for 8 floats: range reduction x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial for
// e^r (Cephes coefficients, max relative error about 2 ulp on the reduced range) and 2^n built
// in the exponent field. Inputs are clamped to [-87.33, 88.72], so exp(-inf) gives about 1e-38
// (never 0) and large inputs give about 3.4e38 (never inf).
inline __m256 exp(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.7228393f);
  const __m256 lo = _mm256_set1_ps(-87.3365479f);
  const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f);
  const __m256 ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, ln2_hi, x);
  r = _mm256_fnmadd_ps(n, ln2_lo, r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  __m256 r2 = _mm256_mul_ps(r, r);
  p = _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n: n in [-126, 128]; n = 128 only at the upper clamp, so split the scale in two factors.
  __m256i ni = _mm256_cvtps_epi32(n);
  __m256i half = _mm256_srai_epi32(ni, 1);
  __m256i rest = _mm256_sub_epi32(ni, half);
  const __m256i bias = _mm256_set1_epi32(127);
  __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
  __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane mask with the first n (0..8) lanes set, for _mm256_maskload_ps/_mm256_maskstore_ps.
inline __m256i tail_mask(int64_t n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), idx);
}

// Loads n (< 8) floats, filling the other lanes with `fill`.
inline __m256 load_tail(const float* p, int64_t n, float fill) {
  __m256i m = tail_mask(n);
  __m256 v = _mm256_maskload_ps(p, m);
  return _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(m));
}

inline void store_tail(float* p, __m256 v, int64_t n) { _mm256_maskstore_ps(p, tail_mask(n), v); }

}  // namespace loom::cpu::vec

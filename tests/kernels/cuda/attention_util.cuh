// Shared by the GPU attention tests (attention_test.cu: loom's flash kernels;
// cudnn_attention_test.cu: cuDNN's fused attention): the test case, its buffer layout, bf16 inputs,
// the CPU reference (kernels/cpu/attention.h) and the comparisons against it.
//
// Tolerances (bf16 operands, f32 accumulation, bf16 outputs):
//  - out:        ||gpu - ref|| / ||ref|| <= 5e-3 and every |gpu - ref| <= 2e-2 * max|ref|
//  - dq, dk, dv: ||gpu - ref|| / ||ref|| <= 1e-2 and every |gpu - ref| <= 3e-2 * max|ref|
//    (P and dS are rounded to bf16 before their products, as in FlashAttention-2)
//  - lse (f32):  |gpu - ref| <= 1e-4 * (1 + |ref|); rows with no visible key are -inf in both.
// Seeds are fresh per run (time); LOOM_TEST_SEED=<n> repeats a run.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/rng.h"
#include "kernels/cpu/attention.h"
#include "cuda_test_util.h"
#include "kernels/cuda/attention.cuh"

namespace loom::test {

inline uint64_t attn_test_seed() {
  if (const char* s = std::getenv("LOOM_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return uint64_t(std::chrono::high_resolution_clock::now().time_since_epoch().count());
}

struct AttnCase {
  std::string name;
  int64_t B, NH, HS, Tq, Tkv;
  bool causal = true;
  bool packed = false;  // q|k|v (and dq|dk|dv) interleaved in one [B, T, 3C] buffer (Tq == Tkv)
  int64_t pad = 0;      // extra elements per row of every separate tensor (stride C + pad)
  int64_t q_pos0 = 0, kv_pos0 = 0;
  float scale = 0.f;
  // Every row sees exactly one key (Tkv = 1): dq and dk are zero in exact arithmetic, so they are
  // checked absolutely (|x| <= 1e-5) rather than against a rounding-noise reference.
  bool zero_dqdk = false;
  int64_t NKV = 0;  // key/value heads (grouped-query attention); 0: NH
};

// Grouped-query attention, the cases loom's flash kernels and cuDNN's graphs both take: 8 query
// heads on 2 key/value heads with row padding and in a Llama block's packed q|k|v rows (each dK/dV
// sums 4 query heads), HS 128 with groups of 2, SmolLM-135M's 9 on 3 (packed), and one key/value
// head for all (MQA), non-causal with Tq != Tkv.
inline std::vector<AttnCase> gqa_cases() {
  AttnCase padded{"hs64 gqa 8/2 causal T=333 padded", 2, 8, 64, 333, 333, true};
  padded.NKV = 2, padded.pad = 8;
  AttnCase packed{"hs64 gqa 8/2 causal packed T=200", 2, 8, 64, 200, 200, true};
  packed.NKV = 2, packed.packed = true;
  AttnCase hs128{"hs128 gqa 4/2 causal T=130", 1, 4, 128, 130, 130, true};
  hs128.NKV = 2;
  AttnCase smollm{"hs64 gqa 9/3 causal packed T=256 (SmolLM-135M's heads)", 2, 9, 64, 256, 256, true};
  smollm.NKV = 3, smollm.packed = true;
  AttnCase mqa{"hs64 mqa 6/1 non-causal Tq=70 Tkv=90", 2, 6, 64, 70, 90, false};
  mqa.NKV = 1;
  return {padded, packed, hs128, smollm, mqa};
}

// Row strides and element counts of a case's buffers: q (the whole q|k|v buffer when packed), k
// and v, out and dout, lse f32 [B, NH, Tq].
struct AttnLayout {
  int64_t C, q_stride, kv_stride, o_stride, nq, nkv, no, nlse;
  int64_t Ckv;  // NKV * HS: the width of k and v
};

inline AttnLayout attn_layout(const AttnCase& cs) {
  AttnLayout l;
  l.C = cs.NH * cs.HS;
  l.Ckv = (cs.NKV > 0 ? cs.NKV : cs.NH) * cs.HS;
  l.q_stride = cs.packed ? l.C + 2 * l.Ckv : l.C + cs.pad;
  l.kv_stride = cs.packed ? l.C + 2 * l.Ckv : l.Ckv + cs.pad;
  l.o_stride = l.C + cs.pad;
  l.nq = cs.B * cs.Tq * l.q_stride;
  l.nkv = cs.B * cs.Tkv * l.kv_stride;
  l.no = cs.B * cs.Tq * l.o_stride;
  l.nlse = cs.B * cs.NH * cs.Tq;
  return l;
}

inline cpu::AttnArgs attn_cpu_args(const AttnCase& cs, const AttnLayout& l) {
  cpu::AttnArgs a;
  a.B = cs.B, a.NH = cs.NH, a.HS = cs.HS, a.Tq = cs.Tq, a.Tkv = cs.Tkv;
  a.q_stride = l.q_stride, a.kv_stride = l.kv_stride, a.o_stride = l.o_stride;
  a.q_pos0 = cs.q_pos0, a.kv_pos0 = cs.kv_pos0, a.causal = cs.causal, a.scale = cs.scale, a.NKV = cs.NKV;
  return a;
}

inline cuda::AttnArgs attn_gpu_args(const AttnCase& cs, const AttnLayout& l) {
  cuda::AttnArgs a;
  a.B = cs.B, a.NH = cs.NH, a.HS = cs.HS, a.Tq = cs.Tq, a.Tkv = cs.Tkv;
  a.q_stride = l.q_stride, a.kv_stride = l.kv_stride, a.o_stride = l.o_stride;
  a.q_pos0 = cs.q_pos0, a.kv_pos0 = cs.kv_pos0, a.causal = cs.causal, a.scale = cs.scale, a.NKV = cs.NKV;
  return a;
}

// Uniform values in [lo, hi) rounded to bf16 (host and device see the same numbers).
inline std::vector<float> attn_uniform_bf16(int64_t n, uint64_t seed, uint64_t stream, float lo, float hi) {
  std::vector<float> v(static_cast<size_t>(n));
  fill_uniform(v.data(), n, lo, hi, seed, stream, 0);
  for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}

// The inputs: q and k in [-2, 2), v and dout in [-1, 1). Packed: q is the whole q|k|v buffer (v's
// third of each row drawn in [-1, 1) as in the separate case); k and v are empty.
struct AttnInputs {
  std::vector<float> q, k, v, dout;
};

inline AttnInputs attn_inputs(const AttnCase& cs, const AttnLayout& l, uint64_t seed) {
  AttnInputs in;
  in.q = attn_uniform_bf16(l.nq, seed, 1, -2.f, 2.f);
  if (cs.packed) {
    const std::vector<float> v = attn_uniform_bf16(l.nq, seed, 3, -1.f, 1.f);
    for (int64_t r = 0; r < cs.B * cs.Tq; ++r)
      for (int64_t c = l.C + l.Ckv; c < l.C + 2 * l.Ckv; ++c)
        in.q[size_t(r * l.q_stride + c)] = v[size_t(r * l.q_stride + c)];
  } else {
    in.k = attn_uniform_bf16(l.nkv, seed, 2, -2.f, 2.f);
    in.v = attn_uniform_bf16(l.nkv, seed, 3, -1.f, 1.f);
  }
  in.dout = attn_uniform_bf16(l.no, seed, 4, -1.f, 1.f);
  return in;
}

// The CPU op in f32 on the bf16 inputs. Packed: dq holds dq|dk|dv, dk and dv are empty.
struct AttnReference {
  std::vector<float> out, lse, dq, dk, dv;
};

inline AttnReference attn_reference(const AttnCase& cs, const AttnLayout& l, const AttnInputs& in) {
  const cpu::AttnArgs a = attn_cpu_args(cs, l);
  const float* q = in.q.data();
  const float* k = cs.packed ? q + l.C : in.k.data();
  const float* v = cs.packed ? q + l.C + l.Ckv : in.v.data();
  AttnReference r;
  r.out.assign(size_t(l.no), 0.f);
  r.lse.assign(size_t(l.nlse), 0.f);
  cpu::attention_forward(r.out.data(), r.lse.data(), q, k, v, a);
  r.dq.assign(size_t(l.nq), 0.f);
  r.dk.assign(cs.packed ? 0 : size_t(l.nkv), 0.f);
  r.dv.assign(cs.packed ? 0 : size_t(l.nkv), 0.f);
  float* dk = cs.packed ? r.dq.data() + l.C : r.dk.data();
  float* dv = cs.packed ? r.dq.data() + l.C + l.Ckv : r.dv.data();
  cpu::attention_backward(r.dq.data(), dk, dv, in.dout.data(), q, k, v, r.out.data(), r.lse.data(), a);
  return r;
}

// Elements (b, t, h, d) of a [B, T, stride] buffer whose tensor starts `off` elements into each row.
inline std::vector<int64_t> attn_elements(int64_t B, int64_t T, int64_t stride, int64_t off, int64_t C) {
  std::vector<int64_t> idx;
  idx.reserve(size_t(B * T * C));
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t c = 0; c < C; ++c) idx.push_back(r * stride + off + c);
  return idx;
}

// Relative Frobenius error and the worst element over the elements `idx`.
struct AttnCmp {
  double rel = 0, worst = 0, ref_max = 0;
  int64_t nonfinite = 0, n = 0;
};

inline AttnCmp attn_compare(const std::vector<float>& got, const std::vector<float>& ref,
                            const std::vector<int64_t>& idx) {
  AttnCmp c;
  double num = 0, den = 0;
  for (int64_t i : idx) {
    const double g = got[size_t(i)], r = ref[size_t(i)];
    ++c.n;
    if (!std::isfinite(g)) {
      ++c.nonfinite;
      continue;
    }
    num += (g - r) * (g - r);
    den += r * r;
    c.worst = std::max(c.worst, std::fabs(g - r));
    c.ref_max = std::max(c.ref_max, std::fabs(r));
  }
  c.rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return c;
}

// rel <= rel_tol and the worst element <= elem_frac * max|ref|; a non-finite element is one the
// op did not write (the poison).
inline void attn_expect_close(const char* what, const AttnCmp& c, double rel_tol, double elem_frac) {
  EXPECT_EQ(c.nonfinite, 0) << what << ": " << c.nonfinite << " of " << c.n << " elements not written (poison)";
  EXPECT_LE(c.rel, rel_tol) << what << ": relative error";
  EXPECT_LE(c.worst, elem_frac * c.ref_max + 1e-6) << what << ": worst element error (max |ref| " << c.ref_max
                                                   << ")";
  std::printf("    %-4s rel %.2e  worst %.2e  (max|ref| %.2e, %lld elements)\n", what, c.rel, c.worst, c.ref_max,
              (long long)c.n);
}

// out, dq, dk and dv (host f32 of the op's bf16 outputs, in the case's layout; packed: dq holds
// dq|dk|dv and dk, dv are unused) against the reference, with the tolerances above.
inline void attn_expect_outputs(const AttnCase& cs, const AttnLayout& l, const AttnReference& ref,
                                const std::vector<float>& out, const std::vector<float>& dq,
                                const std::vector<float>& dk, const std::vector<float>& dv) {
  const std::vector<int64_t> q_idx = attn_elements(cs.B, cs.Tq, l.q_stride, 0, l.C);
  const std::vector<int64_t> k_idx = attn_elements(cs.B, cs.Tkv, l.kv_stride, cs.packed ? l.C : 0, l.Ckv);
  const std::vector<int64_t> v_idx = attn_elements(cs.B, cs.Tkv, l.kv_stride, cs.packed ? l.C + l.Ckv : 0, l.Ckv);
  const std::vector<int64_t> o_idx = attn_elements(cs.B, cs.Tq, l.o_stride, 0, l.C);
  const std::vector<float>& gdk = cs.packed ? dq : dk;
  const std::vector<float>& gdv = cs.packed ? dq : dv;
  const std::vector<float>& rdk = cs.packed ? ref.dq : ref.dk;
  const std::vector<float>& rdv = cs.packed ? ref.dq : ref.dv;
  attn_expect_close("out", attn_compare(out, ref.out, o_idx), 5e-3, 2e-2);
  if (cs.zero_dqdk) {
    const std::vector<float> zeros(std::max(dq.size(), gdk.size()), 0.f);
    const AttnCmp cq = attn_compare(dq, zeros, q_idx), ck = attn_compare(gdk, zeros, k_idx);
    EXPECT_EQ(cq.nonfinite + ck.nonfinite, 0) << "dq/dk not written";
    EXPECT_LE(cq.worst, 1e-5) << "dq of single-key rows";
    EXPECT_LE(ck.worst, 1e-5) << "dk of single-key rows";
    std::printf("    dq, dk (zero in exact arithmetic): max |x| %.2e, %.2e\n", cq.worst, ck.worst);
  } else {
    attn_expect_close("dq", attn_compare(dq, ref.dq, q_idx), 1e-2, 3e-2);
    attn_expect_close("dk", attn_compare(gdk, rdk, k_idx), 1e-2, 3e-2);
  }
  attn_expect_close("dv", attn_compare(gdv, rdv, v_idx), 1e-2, 3e-2);
}

// lse: finite rows within 1e-4 * (1 + |ref|), rows with no visible key -inf in both.
inline void attn_expect_lse(const std::vector<float>& lse, const std::vector<float>& ref) {
  ASSERT_EQ(lse.size(), ref.size());
  int64_t bad = 0, first_bad = -1;
  double worst = 0;
  for (size_t i = 0; i < lse.size(); ++i) {
    const float g = lse[i], r = ref[i];
    bool ok;
    if (std::isinf(r) && r < 0)
      ok = std::isinf(g) && g < 0;
    else
      ok = std::isfinite(g) && std::fabs(g - r) <= 1e-4 * (1.0 + std::fabs(r));
    if (std::isfinite(g) && std::isfinite(r)) worst = std::max(worst, double(std::fabs(g - r)));
    if (!ok && bad++ == 0) first_bad = int64_t(i);
  }
  EXPECT_EQ(bad, 0) << "lse: " << bad << " bad rows, first " << first_bad << ": got "
                    << (first_bad >= 0 ? lse[size_t(first_bad)] : 0.f) << ", want "
                    << (first_bad >= 0 ? ref[size_t(first_bad)] : 0.f);
  std::printf("    lse  worst abs err %.2e\n", worst);
}

// Elements of the row padding (columns used..stride-1 of each row) of a bf16 output, read back as
// f32, that no longer hold the poison (all bits set: bf16 0xffff, f32 0xffff0000).
inline int64_t attn_padding_written(const std::vector<float>& x, int64_t rows, int64_t stride, int64_t used) {
  int64_t n = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = used; c < stride; ++c) {
      uint32_t u;
      std::memcpy(&u, &x[size_t(r * stride + c)], 4);
      n += u != 0xffff0000u;
    }
  return n;
}

// Bitwise equality of the elements `idx` (all elements when idx is empty) of two read-backs.
inline bool attn_same_bits(const std::vector<float>& a, const std::vector<float>& b,
                           const std::vector<int64_t>& idx = {}) {
  if (a.size() != b.size()) return false;
  if (idx.empty()) return a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  for (int64_t i : idx)
    if (std::memcmp(&a[size_t(i)], &b[size_t(i)], sizeof(float)) != 0) return false;
  return true;
}

// One case on the GPU: the inputs uploaded, room for every output and a workspace of ws_bytes,
// the q/k/v and dq/dk/dv pointers of the case's layout (packed: the thirds of one [B, T, 3C]
// buffer each), and the outputs fetched by run(). run() first poisons every output and the
// workspace, so an element the kernels leave unwritten shows as NaN.
struct AttnDevice {
  AttnDevice(const AttnCase& cs, const AttnLayout& l, const AttnInputs& in, size_t ws_bytes)
      : packed(cs.packed),
        q(size_t(l.nq)), k(nkv(cs, l)), v(nkv(cs, l)), out(size_t(l.no)), dout(size_t(l.no)), dq(size_t(l.nq)),
        dk(nkv(cs, l)), dv(nkv(cs, l)), lse(size_t(l.nlse)), ws(std::max<size_t>(ws_bytes, 1)) {
    upload_bf16(q, in.q);
    if (!packed) {
      upload_bf16(k, in.k);
      upload_bf16(v, in.v);
    }
    upload_bf16(dout, in.dout);
    gq = q.get();
    gk = packed ? gq + l.C : k.get();
    gv = packed ? gq + l.C + l.Ckv : v.get();
    gdq = dq.get();
    gdk = packed ? gdq + l.C : dk.get();
    gdv = packed ? gdq + l.C + l.Ckv : dv.get();
  }
  // Poisons the outputs and the workspace, runs kernels() (the forward and backward calls),
  // synchronises and downloads out, lse, dq and (not packed) dk, dv into the host vectors.
  template <class Kernels>
  void run(Kernels&& kernels) {
    for (auto* b : {&out, &dq, &dk, &dv}) b->poison();
    lse.poison();
    ws.poison();
    kernels();
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
    h_out = download_bf16(out);
    h_lse = lse.download();
    h_dq = download_bf16(dq);
    if (!packed) {
      h_dk = download_bf16(dk);
      h_dv = download_bf16(dv);
    }
  }

  bool packed;
  DeviceBuffer<dbf16> q, k, v, out, dout, dq, dk, dv;
  DeviceBuffer<float> lse;
  DeviceBuffer<char> ws;
  const dbf16 *gq = nullptr, *gk = nullptr, *gv = nullptr;
  dbf16 *gdq = nullptr, *gdk = nullptr, *gdv = nullptr;
  std::vector<float> h_out, h_lse, h_dq, h_dk, h_dv;

 private:
  static size_t nkv(const AttnCase& cs, const AttnLayout& l) { return size_t(cs.packed ? 1 : l.nkv); }
};

}  // namespace loom::test

// Flash attention on the GPU against the CPU op (kernels/cpu/attention.h) on fresh random bf16
// inputs: forward output and log-sum-exp, backward dq, dk, dv. Outputs are poisoned with NaN
// before every run (and row padding must stay poisoned), so an element the kernel fails to write,
// or writes outside its row, fails the test.
//
// Tolerances (bf16 operands, f32 accumulation, bf16 outputs):
//  - out:        ||gpu - ref|| / ||ref|| <= 5e-3 and every |gpu - ref| <= 2e-2 * max|ref|
//  - dq, dk, dv: ||gpu - ref|| / ||ref|| <= 1e-2 and every |gpu - ref| <= 3e-2 * max|ref|
//    (P and dS are rounded to bf16 before their products, as in FlashAttention-2)
//  - lse (f32):  |gpu - ref| <= 1e-4 * (1 + |ref|); rows with no visible key are -inf in both.
// The seed is fresh per run (time); LOOM_TEST_SEED=<n> repeats a run.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/attention.cuh"

namespace {

using loom::cuda::bf16;

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device: GPU attention tests skipped"

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(cudaGetLastError())

uint64_t test_seed() {
  if (const char* s = std::getenv("LOOM_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return uint64_t(std::chrono::high_resolution_clock::now().time_since_epoch().count());
}

constexpr uint16_t kPoison = 0xffff;  // bf16 NaN

// Host buffer of bf16 bits with an f32 copy of the same (rounded) values.
struct HostBf16 {
  std::vector<uint16_t> bits;
  std::vector<float> f32;
};

HostBf16 random_bf16(int64_t n, uint64_t seed, uint64_t stream, float lo, float hi) {
  HostBf16 h;
  h.f32.resize(size_t(n));
  h.bits.resize(size_t(n));
  loom::fill_uniform(h.f32.data(), n, lo, hi, seed, stream, 0);
  for (int64_t i = 0; i < n; ++i) {
    const loom::bf16 b = loom::f32_to_bf16(h.f32[size_t(i)]);
    h.bits[size_t(i)] = b.bits;
    h.f32[size_t(i)] = loom::bf16_to_f32(b);
  }
  return h;
}

float bits_to_f32(uint16_t b) { return loom::bf16_to_f32(loom::bf16{b}); }

template <class T>
struct DeviceBuf {
  T* p = nullptr;
  size_t n = 0;
  explicit DeviceBuf(size_t count) : n(count) {
    if (cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  ~DeviceBuf() { cudaFree(p); }
  DeviceBuf(const DeviceBuf&) = delete;
  DeviceBuf& operator=(const DeviceBuf&) = delete;
};

struct Case {
  std::string name;
  int64_t B, NH, HS, Tq, Tkv;
  bool causal = true;
  bool packed = false;   // q, k, v (and dq, dk, dv) interleaved in one [B, T, 3C] buffer
  int64_t pad = 0;       // extra elements per row of every separate tensor (stride C + pad)
  int64_t q_pos0 = 0, kv_pos0 = 0;
  float scale = 0.f;
  // Every row sees exactly one key (Tkv = 1): dq and dk are exactly zero in exact arithmetic, so
  // they are checked absolutely (|x| <= 1e-5) rather than relative to a rounding-noise reference.
  bool zero_dqdk = false;
};

// Relative Frobenius error and the worst element against `max_frac` * max|ref|, over the
// elements selected by `elem` (index list).
struct Cmp {
  double rel = 0, worst = 0, ref_max = 0;
  int64_t nonfinite = 0, n = 0;
};

Cmp compare(const std::vector<float>& got, const std::vector<float>& ref, const std::vector<int64_t>& idx) {
  Cmp c;
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

void expect_close(const char* what, const Cmp& c, double rel_tol, double elem_frac) {
  EXPECT_EQ(c.nonfinite, 0) << what << ": " << c.nonfinite << " of " << c.n << " elements not written (poison)";
  EXPECT_LE(c.rel, rel_tol) << what << ": relative error";
  EXPECT_LE(c.worst, elem_frac * c.ref_max + 1e-6) << what << ": worst element error (max |ref| " << c.ref_max
                                                   << ")";
  std::printf("    %-4s rel %.2e  worst %.2e  (max|ref| %.2e, %lld elements)\n", what, c.rel, c.worst, c.ref_max,
              (long long)c.n);
}

void run_case(const Case& cs) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(cs.name + " seed " + std::to_string(seed) + " (LOOM_TEST_SEED to repeat)");
  std::printf("  case %s (seed %llu)\n", cs.name.c_str(), (unsigned long long)seed);
  const int64_t C = cs.NH * cs.HS;
  ASSERT_TRUE(!cs.packed || cs.Tq == cs.Tkv);

  // Buffer layout: packed -> one [B, T, 3C] buffer for q|k|v and one for dq|dk|dv; otherwise
  // separate [B, T, C + pad] buffers.
  const int64_t q_stride = cs.packed ? 3 * C : C + cs.pad;
  const int64_t kv_stride = cs.packed ? 3 * C : C + cs.pad;
  const int64_t o_stride = C + cs.pad;
  const int64_t nq = cs.B * cs.Tq * q_stride, nkv = cs.B * cs.Tkv * kv_stride, no = cs.B * cs.Tq * o_stride;
  const int64_t nlse = cs.B * cs.NH * cs.Tq;

  HostBf16 hq, hk, hv;
  if (cs.packed) {
    hq = random_bf16(nq, seed, 1, -2.f, 2.f);  // the whole qkv buffer; k and v are offsets into it
    // v's third of each row drawn in [-1, 1] like the separate case.
    HostBf16 tmp = random_bf16(nq, seed, 3, -1.f, 1.f);
    for (int64_t r = 0; r < cs.B * cs.Tq; ++r)
      for (int64_t c = 2 * C; c < 3 * C; ++c) {
        hq.bits[size_t(r * q_stride + c)] = tmp.bits[size_t(r * q_stride + c)];
        hq.f32[size_t(r * q_stride + c)] = tmp.f32[size_t(r * q_stride + c)];
      }
  } else {
    hq = random_bf16(nq, seed, 1, -2.f, 2.f);
    hk = random_bf16(nkv, seed, 2, -2.f, 2.f);
    hv = random_bf16(nkv, seed, 3, -1.f, 1.f);
  }
  HostBf16 hdo = random_bf16(no, seed, 4, -1.f, 1.f);

  // Element lists: which entries of each buffer are (b, t, h, d) elements of q / k / v / out.
  auto elems = [&](int64_t T, int64_t stride, int64_t off) {
    std::vector<int64_t> idx;
    idx.reserve(size_t(cs.B * T * C));
    for (int64_t r = 0; r < cs.B * T; ++r)
      for (int64_t c = 0; c < C; ++c) idx.push_back(r * stride + off + c);
    return idx;
  };
  const std::vector<int64_t> q_idx = elems(cs.Tq, q_stride, 0);
  const std::vector<int64_t> k_idx = elems(cs.Tkv, kv_stride, cs.packed ? C : 0);
  const std::vector<int64_t> v_idx = elems(cs.Tkv, kv_stride, cs.packed ? 2 * C : 0);
  const std::vector<int64_t> o_idx = elems(cs.Tq, o_stride, 0);

  // CPU reference (f32 on the bf16-rounded inputs).
  loom::cpu::AttnArgs ca;
  ca.B = cs.B, ca.NH = cs.NH, ca.HS = cs.HS, ca.Tq = cs.Tq, ca.Tkv = cs.Tkv;
  ca.q_stride = q_stride, ca.kv_stride = kv_stride, ca.o_stride = o_stride;
  ca.q_pos0 = cs.q_pos0, ca.kv_pos0 = cs.kv_pos0, ca.causal = cs.causal, ca.scale = cs.scale;
  const float* rq = hq.f32.data();
  const float* rk = cs.packed ? hq.f32.data() + C : hk.f32.data();
  const float* rv = cs.packed ? hq.f32.data() + 2 * C : hv.f32.data();
  std::vector<float> ref_out(static_cast<size_t>(no), 0.f), ref_lse(static_cast<size_t>(nlse), 0.f);
  loom::cpu::attention_forward(ref_out.data(), ref_lse.data(), rq, rk, rv, ca);
  std::vector<float> ref_dq(static_cast<size_t>(nq), 0.f), ref_dkv(cs.packed ? 0 : size_t(nkv), 0.f),
      ref_dv(cs.packed ? 0 : size_t(nkv), 0.f);
  float* rdq = ref_dq.data();
  float* rdk = cs.packed ? ref_dq.data() + C : ref_dkv.data();
  float* rdv = cs.packed ? ref_dq.data() + 2 * C : ref_dv.data();
  loom::cpu::attention_backward(rdq, rdk, rdv, hdo.f32.data(), rq, rk, rv, ref_out.data(), ref_lse.data(), ca);

  // GPU.
  loom::cuda::AttnArgs ga;
  ga.B = cs.B, ga.NH = cs.NH, ga.HS = cs.HS, ga.Tq = cs.Tq, ga.Tkv = cs.Tkv;
  ga.q_stride = q_stride, ga.kv_stride = kv_stride, ga.o_stride = o_stride;
  ga.q_pos0 = cs.q_pos0, ga.kv_pos0 = cs.kv_pos0, ga.causal = cs.causal, ga.scale = cs.scale;
  DeviceBuf<uint16_t> dq_in{size_t(nq)}, dk_in{size_t(cs.packed ? 1 : nkv)}, dv_in{size_t(cs.packed ? 1 : nkv)};
  DeviceBuf<uint16_t> d_out{size_t(no)}, d_dout{size_t(no)};
  DeviceBuf<float> d_lse{size_t(nlse)};
  DeviceBuf<uint16_t> d_dq{size_t(nq)}, d_dk{size_t(cs.packed ? 1 : nkv)}, d_dv{size_t(cs.packed ? 1 : nkv)};
  const size_t ws_bytes = loom::cuda::attention_backward_workspace_bytes(ga);
  DeviceBuf<char> d_ws(ws_bytes);
  ASSERT_TRUE(dq_in.p && dk_in.p && dv_in.p && d_out.p && d_dout.p && d_lse.p && d_dq.p && d_dk.p && d_dv.p && d_ws.p);
  CUDA_OK(cudaMemcpy(dq_in.p, hq.bits.data(), size_t(nq) * 2, cudaMemcpyHostToDevice));
  if (!cs.packed) {
    CUDA_OK(cudaMemcpy(dk_in.p, hk.bits.data(), size_t(nkv) * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dv_in.p, hv.bits.data(), size_t(nkv) * 2, cudaMemcpyHostToDevice));
  }
  CUDA_OK(cudaMemcpy(d_dout.p, hdo.bits.data(), size_t(no) * 2, cudaMemcpyHostToDevice));
  const bf16* gq = reinterpret_cast<const bf16*>(dq_in.p);
  const bf16* gk = cs.packed ? gq + C : reinterpret_cast<const bf16*>(dk_in.p);
  const bf16* gv = cs.packed ? gq + 2 * C : reinterpret_cast<const bf16*>(dv_in.p);
  bf16* gdq = reinterpret_cast<bf16*>(d_dq.p);
  bf16* gdk = cs.packed ? gdq + C : reinterpret_cast<bf16*>(d_dk.p);
  bf16* gdv = cs.packed ? gdq + 2 * C : reinterpret_cast<bf16*>(d_dv.p);

  auto poison = [&]() {
    CUDA_OK(cudaMemset(d_out.p, 0xff, size_t(no) * 2));
    CUDA_OK(cudaMemset(d_lse.p, 0xff, size_t(nlse) * 4));
    CUDA_OK(cudaMemset(d_dq.p, 0xff, size_t(nq) * 2));
    if (!cs.packed) {
      CUDA_OK(cudaMemset(d_dk.p, 0xff, size_t(nkv) * 2));
      CUDA_OK(cudaMemset(d_dv.p, 0xff, size_t(nkv) * 2));
    }
    CUDA_OK(cudaMemset(d_ws.p, 0xff, ws_bytes));
  };
  std::vector<uint16_t> o_bits(static_cast<size_t>(no)), dq_bits(static_cast<size_t>(nq)),
      dk_bits(static_cast<size_t>(cs.packed ? 0 : nkv)),
      dv_bits(static_cast<size_t>(cs.packed ? 0 : nkv));
  std::vector<float> lse(static_cast<size_t>(nlse));
  auto run_and_fetch = [&]() {
    poison();
    loom::cuda::attention_forward(reinterpret_cast<bf16*>(d_out.p), d_lse.p, gq, gk, gv, ga, nullptr);
    loom::cuda::attention_backward(gdq, gdk, gdv, reinterpret_cast<const bf16*>(d_dout.p), gq, gk, gv,
                                   reinterpret_cast<const bf16*>(d_out.p), d_lse.p, ga, d_ws.p, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(o_bits.data(), d_out.p, size_t(no) * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(lse.data(), d_lse.p, size_t(nlse) * 4, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(dq_bits.data(), d_dq.p, size_t(nq) * 2, cudaMemcpyDeviceToHost));
    if (!cs.packed) {
      CUDA_OK(cudaMemcpy(dk_bits.data(), d_dk.p, size_t(nkv) * 2, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(dv_bits.data(), d_dv.p, size_t(nkv) * 2, cudaMemcpyDeviceToHost));
    }
  };
  ASSERT_NO_FATAL_FAILURE(run_and_fetch());

  auto to_f32 = [](const std::vector<uint16_t>& b) {
    std::vector<float> f(b.size());
    for (size_t i = 0; i < b.size(); ++i) f[i] = bits_to_f32(b[i]);
    return f;
  };
  const std::vector<float> out = to_f32(o_bits), dq = to_f32(dq_bits);
  expect_close("out", compare(out, ref_out, o_idx), 5e-3, 2e-2);
  if (cs.zero_dqdk) {
    std::vector<float> zeros(dq.size(), 0.f);
    const Cmp cq = compare(dq, zeros, q_idx);
    const Cmp ck = compare(cs.packed ? dq : to_f32(dk_bits), zeros, k_idx);
    EXPECT_EQ(cq.nonfinite + ck.nonfinite, 0) << "dq/dk not written";
    EXPECT_LE(cq.worst, 1e-5) << "dq of single-key rows";
    EXPECT_LE(ck.worst, 1e-5) << "dk of single-key rows";
    std::printf("    dq, dk (exactly zero in exact arithmetic): max |x| %.2e, %.2e\n", cq.worst, ck.worst);
  } else {
    expect_close("dq", compare(dq, ref_dq, q_idx), 1e-2, 3e-2);
  }
  if (cs.zero_dqdk) {
    expect_close("dv", compare(cs.packed ? dq : to_f32(dv_bits), cs.packed ? ref_dq : ref_dv, v_idx), 1e-2, 3e-2);
  } else if (cs.packed) {
    expect_close("dk", compare(dq, ref_dq, k_idx), 1e-2, 3e-2);
    expect_close("dv", compare(dq, ref_dq, v_idx), 1e-2, 3e-2);
  } else {
    expect_close("dk", compare(to_f32(dk_bits), ref_dkv, k_idx), 1e-2, 3e-2);
    expect_close("dv", compare(to_f32(dv_bits), ref_dv, v_idx), 1e-2, 3e-2);
  }

  // lse: finite rows within 1e-4 relative, rows with no visible key -inf in both.
  int64_t bad_lse = 0, first_bad = -1;
  double worst_lse = 0;
  for (int64_t i = 0; i < nlse; ++i) {
    const float g = lse[size_t(i)], r = ref_lse[size_t(i)];
    bool ok;
    if (std::isinf(r) && r < 0)
      ok = std::isinf(g) && g < 0;
    else
      ok = std::isfinite(g) && std::fabs(g - r) <= 1e-4 * (1.0 + std::fabs(r));
    if (std::isfinite(g) && std::isfinite(r)) worst_lse = std::max(worst_lse, double(std::fabs(g - r)));
    if (!ok && bad_lse++ == 0) first_bad = i;
  }
  EXPECT_EQ(bad_lse, 0) << "lse: first bad row " << first_bad << ": got " << (first_bad >= 0 ? lse[size_t(first_bad)] : 0)
                        << ", want " << (first_bad >= 0 ? ref_lse[size_t(first_bad)] : 0);
  std::printf("    lse  worst abs err %.2e\n", worst_lse);

  // Row padding (and, for packed buffers, nothing else) must still hold the poison.
  auto untouched = [&](const std::vector<uint16_t>& bits, int64_t T, int64_t stride, int64_t used) {
    int64_t n = 0;
    for (int64_t r = 0; r < cs.B * T; ++r)
      for (int64_t c = used; c < stride; ++c) n += bits[size_t(r * stride + c)] != kPoison;
    return n;
  };
  EXPECT_EQ(untouched(o_bits, cs.Tq, o_stride, C), 0) << "out: elements written in the row padding";
  EXPECT_EQ(untouched(dq_bits, cs.Tq, q_stride, cs.packed ? 3 * C : C), 0) << "dq: elements written in the padding";
  if (!cs.packed) {
    EXPECT_EQ(untouched(dk_bits, cs.Tkv, kv_stride, C), 0) << "dk: elements written in the padding";
    EXPECT_EQ(untouched(dv_bits, cs.Tkv, kv_stride, C), 0) << "dv: elements written in the padding";
  }

  // A second run must give the same forward bits and the same dk, dv bits (dq accumulates with
  // atomics in any order, so it may differ by rounding): a moving result means a race.
  const std::vector<uint16_t> o1 = o_bits, dk1 = cs.packed ? dq_bits : dk_bits, dv1 = dv_bits;
  const std::vector<float> lse1 = lse;
  ASSERT_NO_FATAL_FAILURE(run_and_fetch());
  EXPECT_TRUE(o1 == o_bits) << "forward output differs between two runs";
  EXPECT_EQ(std::memcmp(lse1.data(), lse.data(), lse.size() * 4), 0) << "lse differs between two runs";
  if (cs.packed) {
    int64_t diff = 0;
    for (int64_t i : k_idx) diff += dk1[size_t(i)] != dq_bits[size_t(i)];
    for (int64_t i : v_idx) diff += dk1[size_t(i)] != dq_bits[size_t(i)];
    EXPECT_EQ(diff, 0) << "dk/dv differ between two runs";
  } else {
    EXPECT_TRUE(dk1 == dk_bits) << "dk differs between two runs";
    EXPECT_TRUE(dv1 == dv_bits) << "dv differs between two runs";
  }
}

TEST(CudaAttention, CausalHs64OddLength) {
  SKIP_WITHOUT_GPU();
  run_case({"hs64 causal T=333", 2, 3, 64, 333, 333, true});
}

TEST(CudaAttention, CausalHs128PackedQkv) {
  SKIP_WITHOUT_GPU();
  Case c{"hs128 causal packed qkv T=300", 2, 2, 128, 300, 300, true};
  c.packed = true;
  run_case(c);
}

TEST(CudaAttention, CausalHs64PackedQkvLong) {
  SKIP_WITHOUT_GPU();
  Case c{"hs64 causal packed qkv T=1100", 1, 2, 64, 1100, 1100, true};
  c.packed = true;
  run_case(c);
}

TEST(CudaAttention, NonCausalCrossLengthsPadded) {
  SKIP_WITHOUT_GPU();
  Case c{"hs64 non-causal Tq=150 Tkv=290 padded", 1, 2, 64, 150, 290, false};
  c.pad = 24;
  run_case(c);
  Case d{"hs128 non-causal Tq=77 Tkv=200 padded", 2, 1, 128, 77, 200, false};
  d.pad = 8;
  run_case(d);
}

TEST(CudaAttention, QueryChunkAfterKeys) {
  SKIP_WITHOUT_GPU();
  // A chunk of queries at positions 256.. attending causally to keys at positions 0..455
  // (context-parallel style): some key tiles are fully visible, the last ones partly.
  Case c{"hs128 causal q_pos0=256 Tq=200 Tkv=456", 1, 2, 128, 200, 456, true};
  c.q_pos0 = 256;
  c.pad = 16;
  run_case(c);
  Case d{"hs64 causal q_pos0=100 Tq=190 Tkv=290", 2, 2, 64, 190, 290, true};
  d.q_pos0 = 100;
  run_case(d);
}

TEST(CudaAttention, RowsWithNoVisibleKey) {
  SKIP_WITHOUT_GPU();
  // Keys start at position 60: queries 0..59 see nothing (out 0, lse -inf, dq 0).
  Case c{"hs64 causal kv_pos0=60 Tq=140 Tkv=100", 1, 2, 64, 140, 100, true};
  c.kv_pos0 = 60;
  run_case(c);
  Case d{"hs128 causal kv_pos0=130 Tq=300 Tkv=170", 1, 1, 128, 300, 170, true};
  d.kv_pos0 = 130;
  run_case(d);
}

TEST(CudaAttention, ExplicitScaleAndShortSequence) {
  SKIP_WITHOUT_GPU();
  Case c{"hs128 causal scale=0.2 T=1030", 1, 1, 128, 1030, 1030, true};
  c.scale = 0.2f;
  run_case(c);
  run_case({"hs64 causal T=5", 3, 8, 64, 5, 5, true});
  Case one{"hs128 causal T=1", 2, 2, 128, 1, 1, true};
  one.zero_dqdk = true;
  run_case(one);
}

TEST(CudaAttention, RejectsBadArguments) {
  // Argument checks run before any device work, so this needs no GPU.
  alignas(16) static uint16_t buf[64];
  float lse[4];
  bf16* p = reinterpret_cast<bf16*>(buf);
  loom::cuda::AttnArgs a;
  a.B = 1, a.NH = 1, a.HS = 96, a.Tq = 1, a.Tkv = 1, a.q_stride = a.kv_stride = a.o_stride = 96;
  EXPECT_THROW(loom::cuda::attention_forward(p, lse, p, p, p, a, nullptr), loom::Error);
  a.HS = 64, a.q_stride = a.kv_stride = a.o_stride = 60;  // shorter than NH * HS
  EXPECT_THROW(loom::cuda::attention_forward(p, lse, p, p, p, a, nullptr), loom::Error);
  a.q_stride = a.kv_stride = a.o_stride = 68;  // not a multiple of 8 elements
  EXPECT_THROW(loom::cuda::attention_forward(p, lse, p, p, p, a, nullptr), loom::Error);
  a.q_stride = a.kv_stride = a.o_stride = 64;
  EXPECT_THROW(loom::cuda::attention_forward(p + 1, lse, p, p, p, a, nullptr), loom::Error);  // misaligned
  try {
    a.HS = 32;
    loom::cuda::attention_backward(p, p, p, p, p, p, p, p, lse, a, p, nullptr);
    ADD_FAILURE() << "HS = 32 accepted";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("HS = 32"), std::string::npos) << e.what();
  }
}

}  // namespace

// cuDNN fused attention (kernels/cuda/cudnn_attention.cuh) against the CPU op
// (kernels/cpu/attention.h, the reference attention_test.cu uses) on fresh random bf16 inputs:
// forward output and log-sum-exp, backward dq, dk, dv. Outputs and the workspace are poisoned
// with NaN before every run, and row padding must stay poisoned.
//
// Tolerances, the same as attention_test.cu's for loom's own kernels (bf16 operands, f32
// accumulation, bf16 outputs):
//  - out:        ||gpu - ref|| / ||ref|| <= 5e-3 and every |gpu - ref| <= 2e-2 * max|ref|
//  - dq, dk, dv: ||gpu - ref|| / ||ref|| <= 1e-2 and every |gpu - ref| <= 3e-2 * max|ref|
//  - lse (f32):  |gpu - ref| <= 1e-4 * (1 + |ref|)
// The seed is fresh per run (time); LOOM_TEST_SEED=<n> repeats a run. Without a GPU (or without
// cuDNN in the build) the GPU tests skip; the argument checks run everywhere.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/cudnn_attention.cuh"
#include "kernels/cuda/cuda_test_util.h"

namespace {

using loom::cuda::bf16;
using loom::test::DeviceBuffer;

#define REQUIRE_GPU_AND_CUDNN()                                                                     \
  do {                                                                                              \
    LOOM_REQUIRE_GPU();                                                                             \
    if (!loom::cuda::cudnn_available()) GTEST_SKIP() << "loom built without cuDNN: skipped";       \
  } while (0)

uint64_t test_seed() {
  if (const char* s = std::getenv("LOOM_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  return uint64_t(std::chrono::high_resolution_clock::now().time_since_epoch().count());
}

// Uniform values in [lo, hi), rounded to bf16 (host and device see the same numbers).
std::vector<float> uniform_bf16(size_t n, uint64_t seed, float lo, float hi) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = loom::test::round_bf16(d(g));
  return v;
}

struct Case {
  std::string name;
  int64_t B, NH, HS, Tq, Tkv;
  bool causal = true;
  bool packed = false;  // q|k|v (and dq|dk|dv) interleaved in one [B, T, 3C] buffer
  int64_t pad = 0;      // extra elements per row of every separate tensor (stride C + pad)
  float scale = 0.f;
  // Every row sees exactly one key (Tkv = 1): dq and dk are zero in exact arithmetic, so they are
  // checked absolutely (|x| <= 1e-5) rather than against a rounding-noise reference.
  bool zero_dqdk = false;
};

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
  EXPECT_EQ(c.nonfinite, 0) << what << ": " << c.nonfinite << " of " << c.n << " elements not written (NaN)";
  EXPECT_LE(c.rel, rel_tol) << what << ": relative error";
  EXPECT_LE(c.worst, elem_frac * c.ref_max + 1e-6) << what << ": worst element error (max |ref| " << c.ref_max << ")";
  std::printf("    %-4s rel %.2e  worst %.2e  (max|ref| %.2e, %lld elements)\n", what, c.rel, c.worst, c.ref_max,
              (long long)c.n);
}

// Elements (b, t, h, d) of a [B, T, stride] buffer whose tensor starts `off` elements into each row.
std::vector<int64_t> elements(int64_t B, int64_t T, int64_t stride, int64_t off, int64_t C) {
  std::vector<int64_t> idx;
  idx.reserve(size_t(B * T * C));
  for (int64_t r = 0; r < B * T; ++r)
    for (int64_t c = 0; c < C; ++c) idx.push_back(r * stride + off + c);
  return idx;
}

// Elements of the row padding (columns used..stride-1) that no longer hold the NaN poison.
int64_t padding_written(const std::vector<float>& x, int64_t rows, int64_t stride, int64_t used) {
  int64_t n = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = used; c < stride; ++c) n += !std::isnan(x[size_t(r * stride + c)]);
  return n;
}

void run_case(const Case& cs) {
  const uint64_t seed = test_seed();
  SCOPED_TRACE(cs.name + " seed " + std::to_string(seed) + " (LOOM_TEST_SEED to repeat)");
  std::printf("  case %s (seed %llu)\n", cs.name.c_str(), (unsigned long long)seed);
  ASSERT_TRUE(!cs.packed || cs.Tq == cs.Tkv);
  const int64_t C = cs.NH * cs.HS;
  const int64_t q_stride = cs.packed ? 3 * C : C + cs.pad, kv_stride = q_stride, o_stride = C + cs.pad;
  const int64_t nq = cs.B * cs.Tq * q_stride, nkv = cs.B * cs.Tkv * kv_stride, no = cs.B * cs.Tq * o_stride;
  const int64_t nlse = cs.B * cs.NH * cs.Tq;

  // Inputs: q, k in [-2, 2), v and dout in [-1, 1). Packed: one buffer, v's third redrawn.
  std::vector<float> hq = uniform_bf16(size_t(nq), seed, -2.f, 2.f), hk, hv;
  if (cs.packed) {
    const std::vector<float> v = uniform_bf16(size_t(nq), seed + 3, -1.f, 1.f);
    for (int64_t r = 0; r < cs.B * cs.Tq; ++r)
      for (int64_t c = 2 * C; c < 3 * C; ++c) hq[size_t(r * q_stride + c)] = v[size_t(r * q_stride + c)];
  } else {
    hk = uniform_bf16(size_t(nkv), seed + 2, -2.f, 2.f);
    hv = uniform_bf16(size_t(nkv), seed + 3, -1.f, 1.f);
  }
  const std::vector<float> hdo = uniform_bf16(size_t(no), seed + 4, -1.f, 1.f);
  const std::vector<int64_t> q_idx = elements(cs.B, cs.Tq, q_stride, 0, C);
  const std::vector<int64_t> k_idx = elements(cs.B, cs.Tkv, kv_stride, cs.packed ? C : 0, C);
  const std::vector<int64_t> v_idx = elements(cs.B, cs.Tkv, kv_stride, cs.packed ? 2 * C : 0, C);
  const std::vector<int64_t> o_idx = elements(cs.B, cs.Tq, o_stride, 0, C);

  // CPU reference in f32 on the bf16-rounded inputs.
  loom::cpu::AttnArgs ca;
  ca.B = cs.B, ca.NH = cs.NH, ca.HS = cs.HS, ca.Tq = cs.Tq, ca.Tkv = cs.Tkv;
  ca.q_stride = q_stride, ca.kv_stride = kv_stride, ca.o_stride = o_stride;
  ca.causal = cs.causal, ca.scale = cs.scale;
  const float* rq = hq.data();
  const float* rk = cs.packed ? hq.data() + C : hk.data();
  const float* rv = cs.packed ? hq.data() + 2 * C : hv.data();
  std::vector<float> ref_out(size_t(no), 0.f), ref_lse(size_t(nlse), 0.f);
  loom::cpu::attention_forward(ref_out.data(), ref_lse.data(), rq, rk, rv, ca);
  std::vector<float> ref_dq(size_t(nq), 0.f), ref_dk(cs.packed ? 0 : size_t(nkv), 0.f),
      ref_dv(cs.packed ? 0 : size_t(nkv), 0.f);
  float* rdk = cs.packed ? ref_dq.data() + C : ref_dk.data();
  float* rdv = cs.packed ? ref_dq.data() + 2 * C : ref_dv.data();
  loom::cpu::attention_backward(ref_dq.data(), rdk, rdv, hdo.data(), rq, rk, rv, ref_out.data(), ref_lse.data(), ca);

  // cuDNN.
  loom::cuda::AttnArgs ga;
  ga.B = cs.B, ga.NH = cs.NH, ga.HS = cs.HS, ga.Tq = cs.Tq, ga.Tkv = cs.Tkv;
  ga.q_stride = q_stride, ga.kv_stride = kv_stride, ga.o_stride = o_stride;
  ga.causal = cs.causal, ga.scale = cs.scale;
  loom::cuda::CudnnAttention att(ga);
  std::printf("    %s\n", att.describe().c_str());
  const size_t ws_bytes = std::max(att.forward_workspace_bytes(), att.backward_workspace_bytes());

  DeviceBuffer<bf16> d_q{size_t(nq)}, d_k{size_t(cs.packed ? 1 : nkv)}, d_v{size_t(cs.packed ? 1 : nkv)};
  DeviceBuffer<bf16> d_out{size_t(no)}, d_dout{size_t(no)};
  DeviceBuffer<float> d_lse{size_t(nlse)};
  DeviceBuffer<bf16> d_dq{size_t(nq)}, d_dk{size_t(cs.packed ? 1 : nkv)}, d_dv{size_t(cs.packed ? 1 : nkv)};
  DeviceBuffer<char> d_ws{std::max<size_t>(ws_bytes, 1)};
  loom::test::upload_bf16(d_q, hq);
  if (!cs.packed) {
    loom::test::upload_bf16(d_k, hk);
    loom::test::upload_bf16(d_v, hv);
  }
  loom::test::upload_bf16(d_dout, hdo);
  const bf16* gq = d_q.get();
  const bf16* gk = cs.packed ? gq + C : d_k.get();
  const bf16* gv = cs.packed ? gq + 2 * C : d_v.get();
  bf16* gdq = d_dq.get();
  bf16* gdk = cs.packed ? gdq + C : d_dk.get();
  bf16* gdv = cs.packed ? gdq + 2 * C : d_dv.get();

  std::vector<float> out, lse, dq, dk, dv;
  auto run_and_fetch = [&]() {
    for (auto* b : {&d_out, &d_dq, &d_dk, &d_dv}) b->poison();
    d_lse.poison();
    d_ws.poison();
    att.forward(d_out.get(), d_lse.get(), gq, gk, gv, d_ws.get(), nullptr);
    att.backward(gdq, gdk, gdv, d_dout.get(), gq, gk, gv, d_out.get(), d_lse.get(), d_ws.get(), nullptr);
    LOOM_CUDA_CHECK(cudaDeviceSynchronize());
    out = loom::test::download_bf16(d_out);
    lse = d_lse.download();
    dq = loom::test::download_bf16(d_dq);
    if (!cs.packed) {
      dk = loom::test::download_bf16(d_dk);
      dv = loom::test::download_bf16(d_dv);
    }
  };
  ASSERT_NO_THROW(run_and_fetch());

  expect_close("out", compare(out, ref_out, o_idx), 5e-3, 2e-2);
  const std::vector<float>& gdk_h = cs.packed ? dq : dk;
  const std::vector<float>& gdv_h = cs.packed ? dq : dv;
  const std::vector<float>& rdk_h = cs.packed ? ref_dq : ref_dk;
  const std::vector<float>& rdv_h = cs.packed ? ref_dq : ref_dv;
  if (cs.zero_dqdk) {
    const std::vector<float> zeros(std::max(dq.size(), gdk_h.size()), 0.f);
    const Cmp cq = compare(dq, zeros, q_idx), ck = compare(gdk_h, zeros, k_idx);
    EXPECT_EQ(cq.nonfinite + ck.nonfinite, 0) << "dq/dk not written";
    EXPECT_LE(cq.worst, 1e-5) << "dq of single-key rows";
    EXPECT_LE(ck.worst, 1e-5) << "dk of single-key rows";
    std::printf("    dq, dk (zero in exact arithmetic): max |x| %.2e, %.2e\n", cq.worst, ck.worst);
  } else {
    expect_close("dq", compare(dq, ref_dq, q_idx), 1e-2, 3e-2);
    expect_close("dk", compare(gdk_h, rdk_h, k_idx), 1e-2, 3e-2);
  }
  expect_close("dv", compare(gdv_h, rdv_h, v_idx), 1e-2, 3e-2);

  int64_t bad_lse = 0, first_bad = -1;
  double worst_lse = 0;
  for (int64_t i = 0; i < nlse; ++i) {
    const double g = lse[size_t(i)], r = ref_lse[size_t(i)];
    const bool ok = std::isfinite(g) && std::fabs(g - r) <= 1e-4 * (1.0 + std::fabs(r));
    if (std::isfinite(g)) worst_lse = std::max(worst_lse, std::fabs(g - r));
    if (!ok && bad_lse++ == 0) first_bad = i;
  }
  EXPECT_EQ(bad_lse, 0) << "lse: " << bad_lse << " bad rows, first " << first_bad << ": got "
                        << (first_bad >= 0 ? lse[size_t(first_bad)] : 0.f) << ", want "
                        << (first_bad >= 0 ? ref_lse[size_t(first_bad)] : 0.f);
  std::printf("    lse  worst abs err %.2e\n", worst_lse);

  // Nothing written outside the tensors' columns.
  EXPECT_EQ(padding_written(out, cs.B * cs.Tq, o_stride, C), 0) << "out: row padding written";
  if (!cs.packed) {
    EXPECT_EQ(padding_written(dq, cs.B * cs.Tq, q_stride, C), 0) << "dq: row padding written";
    EXPECT_EQ(padding_written(dk, cs.B * cs.Tkv, kv_stride, C), 0) << "dk: row padding written";
    EXPECT_EQ(padding_written(dv, cs.B * cs.Tkv, kv_stride, C), 0) << "dv: row padding written";
  }

  // The forward pass is deterministic: a second run gives the same bits.
  const std::vector<float> out1 = out, lse1 = lse;
  ASSERT_NO_THROW(run_and_fetch());
  EXPECT_EQ(std::memcmp(out1.data(), out.data(), out.size() * sizeof(float)), 0) << "out differs between runs";
  EXPECT_EQ(std::memcmp(lse1.data(), lse.data(), lse.size() * sizeof(float)), 0) << "lse differs between runs";
}

TEST(CudnnAttention, CausalHs64OddLength) {
  REQUIRE_GPU_AND_CUDNN();
  run_case({"hs64 causal B=2 T=333", 2, 3, 64, 333, 333, true});
}

TEST(CudnnAttention, CausalHs128Packed) {
  REQUIRE_GPU_AND_CUDNN();
  Case c{"hs128 causal packed qkv B=2 T=300", 2, 2, 128, 300, 300, true};
  c.packed = true;
  run_case(c);
}

TEST(CudnnAttention, CausalMultiplesOf128) {
  REQUIRE_GPU_AND_CUDNN();
  Case c{"hs64 causal packed qkv B=1 T=1024", 1, 2, 64, 1024, 1024, true};
  c.packed = true;
  run_case(c);
  run_case({"hs128 causal B=4 T=256", 4, 2, 128, 256, 256, true});
}

TEST(CudnnAttention, CausalLongOddLengthPadded) {
  REQUIRE_GPU_AND_CUDNN();
  Case c{"hs128 causal B=1 T=1100 padded", 1, 2, 128, 1100, 1100, true};
  c.pad = 16;
  run_case(c);
}

TEST(CudnnAttention, CausalUnequalLengths) {
  REQUIRE_GPU_AND_CUDNN();
  // Top-left aligned: query t sees keys 0..t; queries past the last key see every key.
  run_case({"hs64 causal Tq=200 Tkv=130", 2, 2, 64, 200, 130, true});
  run_case({"hs128 causal Tq=100 Tkv=256", 1, 2, 128, 100, 256, true});
}

TEST(CudnnAttention, NonCausalCrossLengthsPadded) {
  REQUIRE_GPU_AND_CUDNN();
  Case c{"hs64 non-causal Tq=150 Tkv=290 padded", 1, 2, 64, 150, 290, false};
  c.pad = 24;
  run_case(c);
  Case d{"hs128 non-causal Tq=77 Tkv=200 padded", 2, 1, 128, 77, 200, false};
  d.pad = 8;
  run_case(d);
}

TEST(CudnnAttention, ExplicitScaleAndShortSequences) {
  REQUIRE_GPU_AND_CUDNN();
  Case c{"hs128 causal scale=0.2 T=513", 1, 1, 128, 513, 513, true};
  c.scale = 0.2f;
  run_case(c);
  run_case({"hs64 causal B=3 NH=8 T=5", 3, 8, 64, 5, 5, true});
  Case one{"hs128 causal T=1", 2, 2, 128, 1, 1, true};
  one.zero_dqdk = true;
  run_case(one);
}

TEST(CudnnAttention, RefusesMisalignedPointersAndMissingWorkspace) {
  REQUIRE_GPU_AND_CUDNN();
  loom::cuda::AttnArgs a;
  a.B = 1, a.NH = 1, a.HS = 64, a.Tq = a.Tkv = 128, a.q_stride = a.kv_stride = a.o_stride = 64;
  loom::cuda::CudnnAttention att(a);
  EXPECT_GT(att.backward_workspace_bytes(), 0u);  // at least Dsum and the dQ accumulator
  DeviceBuffer<bf16> x{size_t(128 * 64 + 8)};
  DeviceBuffer<float> lse{size_t(128 + 4)};
  DeviceBuffer<char> ws{std::max<size_t>(att.backward_workspace_bytes(), 1)};
  try {
    att.forward(x.get() + 1, lse.get(), x.get(), x.get(), x.get(), ws.get(), nullptr);
    ADD_FAILURE() << "misaligned out accepted";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("16-byte aligned"), std::string::npos) << e.what();
  }
  EXPECT_THROW(att.backward(x.get(), x.get(), x.get(), x.get(), x.get(), x.get(), x.get(), x.get(), lse.get(), nullptr,
                            nullptr),
               loom::Error);
  LOOM_CUDA_CHECK(cudaDeviceSynchronize());
}

// Argument checks run before any device work, so they need no GPU (and no cuDNN).
TEST(CudnnAttention, RefusesUnsupportedArguments) {
  auto message = [](const loom::cuda::AttnArgs& a) -> std::string {
    try {
      loom::cuda::cudnn_attention_check(a);
    } catch (const loom::Error& e) {
      return e.what();
    }
    return "";
  };
  loom::cuda::AttnArgs a;
  a.B = 1, a.NH = 2, a.HS = 64, a.Tq = a.Tkv = 100, a.q_stride = a.kv_stride = a.o_stride = 128;
  EXPECT_EQ(message(a), "");

  loom::cuda::AttnArgs b = a;
  b.HS = 96, b.q_stride = b.kv_stride = b.o_stride = 192;
  EXPECT_NE(message(b).find("HS = 96"), std::string::npos) << message(b);
  try {  // the constructor checks first too (before looking for cuDNN or a device)
    loom::cuda::CudnnAttention refused{b};
    ADD_FAILURE() << "HS = 96 was accepted";
  } catch (const loom::Error& e) {
    EXPECT_NE(std::string(e.what()).find("HS = 96"), std::string::npos) << e.what();
  }

  b = a;
  b.q_pos0 = 64;  // a shifted causal chunk (context parallel): loom's own kernels only
  EXPECT_NE(message(b).find("q_pos0 = 64"), std::string::npos) << message(b);
  b.causal = false;  // without a mask the positions do not matter
  EXPECT_EQ(message(b), "");

  b = a;
  b.kv_stride = 120;  // shorter than NH * HS
  EXPECT_NE(message(b).find("kv_stride = 120"), std::string::npos) << message(b);
  b.kv_stride = 132;  // not a multiple of 8 elements
  EXPECT_NE(message(b).find("multiples of 8"), std::string::npos) << message(b);

  b = a;
  b.Tkv = 0;
  EXPECT_NE(message(b).find("Tkv = 0"), std::string::npos) << message(b);
  b = a;
  b.scale = INFINITY;
  EXPECT_NE(message(b).find("scale"), std::string::npos) << message(b);
}

}  // namespace

// Flash attention on the GPU against the CPU op (kernels/cpu/attention.h) on fresh random bf16
// inputs: forward output and log-sum-exp, backward dq, dk, dv. Outputs are poisoned with NaN
// before every run (and row padding must stay poisoned), so an element the kernel fails to write,
// or writes outside its row, fails the test. Cases, inputs, the reference and the tolerances are
// attention_util.cuh's (shared with cudnn_attention_test.cu); LOOM_TEST_SEED=<n> repeats a run.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "attention_util.cuh"
#include "core/error.h"
#include "cuda_test_util.h"
#include "kernels/cuda/attention.cuh"

namespace {

using loom::cuda::bf16;
using loom::test::AttnCase;
using loom::test::DeviceBuffer;

void run_case(const AttnCase& cs) {
  using namespace loom::test;
  const uint64_t seed = attn_test_seed();
  SCOPED_TRACE(cs.name + " seed " + std::to_string(seed) + " (LOOM_TEST_SEED to repeat)");
  std::printf("  case %s (seed %llu)\n", cs.name.c_str(), (unsigned long long)seed);
  ASSERT_TRUE(!cs.packed || cs.Tq == cs.Tkv);
  const AttnLayout l = attn_layout(cs);
  const int64_t C = l.C;
  const AttnInputs in = attn_inputs(cs, l, seed);
  const AttnReference ref = attn_reference(cs, l, in);

  // GPU: packed -> one [B, T, 3C] buffer for q|k|v and one for dq|dk|dv; otherwise separate
  // [B, T, C + pad] buffers.
  const loom::cuda::AttnArgs ga = attn_gpu_args(cs, l);
  const size_t ws_bytes = loom::cuda::attention_backward_workspace_bytes(ga);
  AttnDevice d(cs, l, in, ws_bytes);
  const std::vector<float>& out = d.h_out;
  const std::vector<float>& lse = d.h_lse;
  const std::vector<float>& dq = d.h_dq;
  const std::vector<float>& dk = d.h_dk;
  const std::vector<float>& dv = d.h_dv;
  auto run_and_fetch = [&]() {
    d.run([&] {
      loom::cuda::attention_forward(d.out.get(), d.lse.get(), d.gq, d.gk, d.gv, ga, nullptr);
      loom::cuda::attention_backward(d.gdq, d.gdk, d.gdv, d.dout.get(), d.gq, d.gk, d.gv, d.out.get(), d.lse.get(), ga,
                                     d.ws.get(), nullptr);
    });
  };
  ASSERT_NO_THROW(run_and_fetch());

  attn_expect_outputs(cs, l, ref, out, dq, dk, dv);
  attn_expect_lse(lse, ref.lse);

  // Row padding (and, for packed buffers, nothing else) must still hold the poison.
  EXPECT_EQ(attn_padding_written(out, cs.B * cs.Tq, l.o_stride, C), 0) << "out: elements written in the row padding";
  if (!cs.packed) {
    EXPECT_EQ(attn_padding_written(dq, cs.B * cs.Tq, l.q_stride, C), 0) << "dq: elements written in the padding";
    EXPECT_EQ(attn_padding_written(dk, cs.B * cs.Tkv, l.kv_stride, l.Ckv), 0) << "dk: elements written in the padding";
    EXPECT_EQ(attn_padding_written(dv, cs.B * cs.Tkv, l.kv_stride, l.Ckv), 0) << "dv: elements written in the padding";
  }

  // A second run must give the same forward bits and the same dk, dv bits (dq accumulates with
  // atomics in any order, so it may differ by rounding): a moving result means a race.
  const std::vector<float> out1 = out, lse1 = lse, dq1 = dq, dk1 = dk, dv1 = dv;
  ASSERT_NO_THROW(run_and_fetch());
  EXPECT_TRUE(attn_same_bits(out1, out)) << "forward output differs between two runs";
  EXPECT_TRUE(attn_same_bits(lse1, lse)) << "lse differs between two runs";
  if (cs.packed) {
    std::vector<int64_t> kv = attn_elements(cs.B, cs.Tkv, l.kv_stride, C, 2 * l.Ckv);  // k and v
    EXPECT_TRUE(attn_same_bits(dq1, dq, kv)) << "dk/dv differ between two runs";
  } else {
    EXPECT_TRUE(attn_same_bits(dk1, dk)) << "dk differs between two runs";
    EXPECT_TRUE(attn_same_bits(dv1, dv)) << "dv differs between two runs";
  }
}

TEST(CudaAttention, CausalHs64OddLength) {
  LOOM_REQUIRE_GPU();
  run_case({"hs64 causal T=333", 2, 3, 64, 333, 333, true});
}

TEST(CudaAttention, CausalHs128PackedQkv) {
  LOOM_REQUIRE_GPU();
  AttnCase c{"hs128 causal packed qkv T=300", 2, 2, 128, 300, 300, true};
  c.packed = true;
  run_case(c);
}

// Grouped-query attention (attention_util.cuh's cases): each backward block sums dK and dV over its
// group's query heads.
TEST(CudaAttention, GroupedQueryHeads) {
  LOOM_REQUIRE_GPU();
  for (const AttnCase& c : loom::test::gqa_cases()) run_case(c);
}

TEST(CudaAttention, CausalHs64PackedQkvLong) {
  LOOM_REQUIRE_GPU();
  AttnCase c{"hs64 causal packed qkv T=1100", 1, 2, 64, 1100, 1100, true};
  c.packed = true;
  run_case(c);
}

TEST(CudaAttention, NonCausalCrossLengthsPadded) {
  LOOM_REQUIRE_GPU();
  AttnCase c{"hs64 non-causal Tq=150 Tkv=290 padded", 1, 2, 64, 150, 290, false};
  c.pad = 24;
  run_case(c);
  AttnCase d{"hs128 non-causal Tq=77 Tkv=200 padded", 2, 1, 128, 77, 200, false};
  d.pad = 8;
  run_case(d);
}

TEST(CudaAttention, QueryChunkAfterKeys) {
  LOOM_REQUIRE_GPU();
  // A chunk of queries at positions 256.. attending causally to keys at positions 0..455
  // (context-parallel style): some key tiles are fully visible, the last ones partly.
  AttnCase c{"hs128 causal q_pos0=256 Tq=200 Tkv=456", 1, 2, 128, 200, 456, true};
  c.q_pos0 = 256;
  c.pad = 16;
  run_case(c);
  AttnCase d{"hs64 causal q_pos0=100 Tq=190 Tkv=290", 2, 2, 64, 190, 290, true};
  d.q_pos0 = 100;
  run_case(d);
}

TEST(CudaAttention, RowsWithNoVisibleKey) {
  LOOM_REQUIRE_GPU();
  // Keys start at position 60: queries 0..59 see nothing (out 0, lse -inf, dq 0).
  AttnCase c{"hs64 causal kv_pos0=60 Tq=140 Tkv=100", 1, 2, 64, 140, 100, true};
  c.kv_pos0 = 60;
  run_case(c);
  AttnCase d{"hs128 causal kv_pos0=130 Tq=300 Tkv=170", 1, 1, 128, 300, 170, true};
  d.kv_pos0 = 130;
  run_case(d);
}

TEST(CudaAttention, ExplicitScaleAndShortSequence) {
  LOOM_REQUIRE_GPU();
  AttnCase c{"hs128 causal scale=0.2 T=1030", 1, 1, 128, 1030, 1030, true};
  c.scale = 0.2f;
  run_case(c);
  run_case({"hs64 causal T=5", 3, 8, 64, 5, 5, true});
  AttnCase one{"hs128 causal T=1", 2, 2, 128, 1, 1, true};
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

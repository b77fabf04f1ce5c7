// cuDNN fused attention (kernels/cuda/cudnn_attention.cuh) against the CPU op
// (kernels/cpu/attention.h) on fresh random bf16 inputs: forward output and log-sum-exp, backward
// dq, dk, dv. Outputs and the workspace are poisoned with NaN before every run, and row padding
// must stay poisoned. Cases, inputs, the reference and the tolerances are attention_util.cuh's,
// the same as attention_test.cu's for loom's own kernels; LOOM_TEST_SEED=<n> repeats a run.
// Without a GPU (or without cuDNN in the build) the GPU tests skip; the argument checks run
// everywhere.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "attention_util.cuh"
#include "core/error.h"
#include "kernels/cuda/cudnn_attention.cuh"
#include "kernels/cuda/cuda_test_util.h"

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

  // cuDNN.
  const loom::cuda::AttnArgs ga = attn_gpu_args(cs, l);
  loom::cuda::CudnnAttention att(ga);
  std::printf("    %s\n", att.describe().c_str());
  const size_t ws_bytes = std::max(att.forward_workspace_bytes(), att.backward_workspace_bytes());

  AttnDevice d(cs, l, in, ws_bytes);
  const std::vector<float>& out = d.h_out;
  const std::vector<float>& lse = d.h_lse;
  const std::vector<float>& dq = d.h_dq;
  const std::vector<float>& dk = d.h_dk;
  const std::vector<float>& dv = d.h_dv;
  auto run_and_fetch = [&]() {
    d.run([&] {
      att.forward(d.out.get(), d.lse.get(), d.gq, d.gk, d.gv, d.ws.get(), nullptr);
      att.backward(d.gdq, d.gdk, d.gdv, d.dout.get(), d.gq, d.gk, d.gv, d.out.get(), d.lse.get(), d.ws.get(), nullptr);
    });
  };
  ASSERT_NO_THROW(run_and_fetch());

  attn_expect_outputs(cs, l, ref, out, dq, dk, dv);
  attn_expect_lse(lse, ref.lse);

  // Nothing written outside the tensors' columns.
  EXPECT_EQ(attn_padding_written(out, cs.B * cs.Tq, l.o_stride, C), 0) << "out: row padding written";
  if (!cs.packed) {
    EXPECT_EQ(attn_padding_written(dq, cs.B * cs.Tq, l.q_stride, C), 0) << "dq: row padding written";
    EXPECT_EQ(attn_padding_written(dk, cs.B * cs.Tkv, l.kv_stride, l.Ckv), 0) << "dk: row padding written";
    EXPECT_EQ(attn_padding_written(dv, cs.B * cs.Tkv, l.kv_stride, l.Ckv), 0) << "dv: row padding written";
  }

  // The forward pass is deterministic: a second run gives the same bits.
  const std::vector<float> out1 = out, lse1 = lse;
  ASSERT_NO_THROW(run_and_fetch());
  EXPECT_TRUE(attn_same_bits(out1, out)) << "out differs between runs";
  EXPECT_TRUE(attn_same_bits(lse1, lse)) << "lse differs between runs";
}

// Grouped-query attention: the cases loom's flash kernels take (attention_util.cuh), SmolLM-135M's
// 9 query heads on 3 among them.
TEST(CudnnAttention, GroupedQueryHeads) {
  LOOM_REQUIRE_CUDNN();
  for (const AttnCase& c : loom::test::gqa_cases()) run_case(c);
}

TEST(CudnnAttention, CausalHs64OddLength) {
  LOOM_REQUIRE_CUDNN();
  run_case({"hs64 causal B=2 T=333", 2, 3, 64, 333, 333, true});
}

TEST(CudnnAttention, CausalHs128Packed) {
  LOOM_REQUIRE_CUDNN();
  AttnCase c{"hs128 causal packed qkv B=2 T=300", 2, 2, 128, 300, 300, true};
  c.packed = true;
  run_case(c);
}

TEST(CudnnAttention, CausalMultiplesOf128) {
  LOOM_REQUIRE_CUDNN();
  AttnCase c{"hs64 causal packed qkv B=1 T=1024", 1, 2, 64, 1024, 1024, true};
  c.packed = true;
  run_case(c);
  run_case({"hs128 causal B=4 T=256", 4, 2, 128, 256, 256, true});
}

TEST(CudnnAttention, CausalLongOddLengthPadded) {
  LOOM_REQUIRE_CUDNN();
  AttnCase c{"hs128 causal B=1 T=1100 padded", 1, 2, 128, 1100, 1100, true};
  c.pad = 16;
  run_case(c);
}

TEST(CudnnAttention, CausalUnequalLengths) {
  LOOM_REQUIRE_CUDNN();
  // Top-left aligned: query t sees keys 0..t; queries past the last key see every key.
  run_case({"hs64 causal Tq=200 Tkv=130", 2, 2, 64, 200, 130, true});
  run_case({"hs128 causal Tq=100 Tkv=256", 1, 2, 128, 100, 256, true});
}

TEST(CudnnAttention, NonCausalCrossLengthsPadded) {
  LOOM_REQUIRE_CUDNN();
  AttnCase c{"hs64 non-causal Tq=150 Tkv=290 padded", 1, 2, 64, 150, 290, false};
  c.pad = 24;
  run_case(c);
  AttnCase d{"hs128 non-causal Tq=77 Tkv=200 padded", 2, 1, 128, 77, 200, false};
  d.pad = 8;
  run_case(d);
}

TEST(CudnnAttention, ExplicitScaleAndShortSequences) {
  LOOM_REQUIRE_CUDNN();
  AttnCase c{"hs128 causal scale=0.2 T=513", 1, 1, 128, 513, 513, true};
  c.scale = 0.2f;
  run_case(c);
  run_case({"hs64 causal B=3 NH=8 T=5", 3, 8, 64, 5, 5, true});
  // One query and two keys, the second masked: the output is v of key 0, so dq and dk are zero.
  // (One query and one key is refused: RefusesUnsupportedArguments.)
  AttnCase one{"hs128 causal Tq=1 Tkv=2", 2, 2, 128, 1, 2, true};
  one.zero_dqdk = true;
  run_case(one);
}

TEST(CudnnAttention, RefusesMisalignedPointersAndMissingWorkspace) {
  LOOM_REQUIRE_CUDNN();
  loom::cuda::AttnArgs a;
  a.B = 1, a.NH = 1, a.HS = 64, a.Tq = a.Tkv = 128, a.q_stride = a.kv_stride = a.o_stride = 64;
  loom::cuda::CudnnAttention att(a);
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
  b.Tq = b.Tkv = 1;
  EXPECT_NE(message(b).find("Tq = 1 and Tkv = 1"), std::string::npos) << message(b);
  b.Tkv = 2;
  EXPECT_EQ(message(b), "");

  b = a;
  b.NH = 6, b.NKV = 4, b.q_stride = b.o_stride = 384, b.kv_stride = 256;  // 4 key/value heads do not divide 6
  EXPECT_NE(message(b).find("NKV = 4"), std::string::npos) << message(b);
  b.NKV = 3, b.kv_stride = 192;  // groups of 2: k and v rows need only NKV * HS
  EXPECT_EQ(message(b), "");
  b.kv_stride = 184;
  EXPECT_NE(message(b).find("NKV * HS = 192"), std::string::npos) << message(b);

  b = a;
  b.Tkv = 0;
  EXPECT_NE(message(b).find("Tkv = 0"), std::string::npos) << message(b);
  b = a;
  b.scale = INFINITY;
  EXPECT_NE(message(b).find("scale"), std::string::npos) << message(b);
}

}  // namespace

// Context parallelism: ring attention over load-balanced chunks equals one attention call over
// the whole sequence (forward output, log-sum-exp, and dq, dk, dv), and cp trains a sequence
// length that one rank's activation budget refuses, with the single-device loss wherever both fit.
#include "parallel/context/ring_attention.h"

#include <gtest/gtest.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "comm/threads.h"
#include "core/error.h"
#include "core/rng.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/backend.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "parallel/data/data_parallel.h"

using namespace loom;

namespace {

comm::RunOptions one_thread() {
  comm::RunOptions o;
  o.threads_per_rank = 1;
  return o;
}

TEST(ContextLayout, EachRankHoldsOneEarlyAndOneLateChunk) {
  // T = 16 over cp = 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
  EXPECT_EQ(parallel::cp::global_position(0, 16, 2, 0), 0);
  EXPECT_EQ(parallel::cp::global_position(4, 16, 2, 0), 12);
  EXPECT_EQ(parallel::cp::global_position(3, 16, 2, 1), 7);
  EXPECT_EQ(parallel::cp::global_position(4, 16, 2, 1), 8);
  // Every position exactly once over the ranks.
  for (int cp : {1, 2, 4}) {
    std::vector<int> seen(64, 0);
    for (int r = 0; r < cp; ++r)
      for (int64_t t = 0; t < 64 / cp; ++t) seen[size_t(parallel::cp::global_position(t, 64, cp, r))]++;
    for (int s : seen) EXPECT_EQ(s, 1);
  }
  EXPECT_THROW(parallel::cp::check_sequence(20, 4, "test"), Error);
}

// (cp, key/value heads of NH = 3)
class RingAttentionVsFull : public testing::TestWithParam<std::tuple<int, int>> {};

TEST_P(RingAttentionVsFull, ForwardAndBackwardMatchOneCall) {
  const auto [cp, NKV] = GetParam();
  const int64_t B = 2, T = 48, NH = 3, HS = 8, C = NH * HS, Q = (NH + 2 * NKV) * HS;
  // Full-sequence reference: qkv f32 [B, T, Q], dout f32 [B, T, C].
  std::vector<float> qkv(size_t(B * T * Q)), dout(size_t(B * T * C));
  for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = 2.0f * uniform_at(3, 1, i) - 1.0f;
  for (size_t i = 0; i < dout.size(); ++i) dout[i] = 2.0f * uniform_at(3, 2, i) - 1.0f;
  std::vector<float> out(size_t(B * T * C)), lse(size_t(B * NH * T)), dqkv(qkv.size());
  cpu::AttnArgs a;
  a.B = B, a.NH = NH, a.HS = HS, a.Tq = a.Tkv = T, a.q_stride = a.kv_stride = Q, a.o_stride = C, a.NKV = NKV;
  const int64_t ko = C, vo = C + NKV * HS;
  cpu::attention_forward(out.data(), lse.data(), qkv.data(), qkv.data() + ko, qkv.data() + vo, a);
  cpu::attention_backward(dqkv.data(), dqkv.data() + ko, dqkv.data() + vo, dout.data(), qkv.data(),
                          qkv.data() + ko, qkv.data() + vo, out.data(), lse.data(), a);

  comm::run_ranks(cp, [&](comm::Comm& g) {
    const int r = g.rank();
    const int64_t Tl = T / cp, Tc = Tl / 2;
    std::vector<float> lq(size_t(B * Tl * Q)), ldout(size_t(B * Tl * C));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tl; ++t) {
        const int64_t p = parallel::cp::global_position(t, T, cp, r);
        std::copy_n(&qkv[size_t((b * T + p) * Q)], Q, &lq[size_t((b * Tl + t) * Q)]);
        std::copy_n(&dout[size_t((b * T + p) * C)], C, &ldout[size_t((b * Tl + t) * C)]);
      }
    MemoryPool pool("rank");
    cpu::CpuBackend be({.pool = &pool});
    parallel::cp::RingAttention ring(be);
    const parallel::cp::RingShape shape{B, T, NH, HS, NKV};
    std::vector<float> lout(size_t(B * Tl * C)), llse(size_t(2 * B * NH * Tc)), ldqkv(lq.size());
    ring.forward(g, lout.data(), llse.data(), lq.data(), shape);
    ring.backward(g, ldqkv.data(), ldout.data(), lq.data(), lout.data(), llse.data(), shape);
    // Tolerance: different summation orders of the same f32 sums (values of order 1).
    const float tol = 2e-6f;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < Tl; ++t) {
        const int64_t p = parallel::cp::global_position(t, T, cp, r);
        for (int64_t c = 0; c < C; ++c)
          ASSERT_NEAR(lout[size_t((b * Tl + t) * C + c)], out[size_t((b * T + p) * C + c)], tol)
              << "out b=" << b << " pos=" << p << " c=" << c;
        for (int64_t c = 0; c < Q; ++c)
          ASSERT_NEAR(ldqkv[size_t((b * Tl + t) * Q + c)], dqkv[size_t((b * T + p) * Q + c)], tol)
              << "dqkv b=" << b << " pos=" << p << " c=" << c;
        const int64_t h = t / Tc;  // lse is [2, B, NH, Tc]: per local chunk
        for (int64_t n = 0; n < NH; ++n)
          ASSERT_NEAR(llse[size_t(((h * B + b) * NH + n) * Tc + t % Tc)], lse[size_t((b * NH + n) * T + p)], tol);
      }
  }, one_thread());
}

INSTANTIATE_TEST_SUITE_P(Cp, RingAttentionVsFull,
                         testing::Values(std::tuple{2, 3}, std::tuple{3, 3}, std::tuple{4, 3}, std::tuple{2, 1},
                                         std::tuple{3, 1}));

// The ring keeps its buffers between passes (passes after the first allocate nothing) and holds
// exactly RingAttention::buffer_bytes of them, beside the backend's attention scratch for its two
// kinds of chunk pair; release() gives them back.
TEST(RingAttention, ReusesItsBuffersAcrossPasses) {
  const int cp = 2;
  const int64_t B = 2, T = 48, NH = 3, HS = 8, C = NH * HS, Tl = T / cp, Tc = Tl / 2;
  const parallel::cp::RingShape shape{B, T, NH, HS};
  comm::run_ranks(cp, [&](comm::Comm& g) {
    std::vector<float> qkv(size_t(B * Tl * 3 * C)), dout(size_t(B * Tl * C));
    for (size_t i = 0; i < qkv.size(); ++i) qkv[i] = 2.0f * uniform_at(4, uint64_t(g.rank()), i) - 1.0f;
    for (size_t i = 0; i < dout.size(); ++i) dout[i] = 2.0f * uniform_at(5, uint64_t(g.rank()), i) - 1.0f;
    std::vector<float> out(size_t(B * Tl * C)), lse(size_t(B * 2 * NH * Tc)), dqkv(qkv.size());
    MemoryPool pool("rank");
    cpu::CpuBackend be({.pool = &pool});
    parallel::cp::RingAttention ring(be);
    ring.forward(g, out.data(), lse.data(), qkv.data(), shape);
    ring.backward(g, dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), shape);
    const int64_t taken = pool.total_allocations();
    std::vector<float> out2(out.size()), lse2(lse.size()), dqkv2(dqkv.size());
    for (int pass = 0; pass < 2; ++pass) {
      ring.forward(g, out2.data(), lse2.data(), qkv.data(), shape);
      ring.backward(g, dqkv2.data(), dout.data(), qkv.data(), out2.data(), lse2.data(), shape);
    }
    EXPECT_EQ(pool.total_allocations(), taken);
    EXPECT_EQ(out2, out);
    EXPECT_EQ(lse2, lse);
    EXPECT_EQ(dqkv2, dqkv);
    const int64_t scratch = be.attention_scratch().bytes();
    int64_t need = 0;
    for (bool causal : {true, false})
      need = std::max(need, be.attention_workspace_bytes(DType::f32, parallel::cp::RingAttention::chunk_shape(shape, cp, causal)));
    EXPECT_EQ(scratch, need);
    const auto bytes = parallel::cp::RingAttention::buffer_bytes(shape, cp, DType::f32);
    EXPECT_EQ(ring.held_bytes(), bytes.total());
    EXPECT_EQ(ring.held_bytes() + scratch, pool.total_current());
    // The key/value blocks and their gradients are communication buffers.
    EXPECT_EQ(pool.current(MemTag::comm), 4 * 2 * B * Tl * 2 * C * 2);
    EXPECT_EQ(pool.current(MemTag::comm), bytes.comm);
    EXPECT_EQ(pool.current(MemTag::workspace), bytes.workspace + scratch);
    ring.release();
    EXPECT_EQ(pool.total_current(), scratch);
  }, one_thread());
}

model::GPTConfig tiny() { return model::gpt_preset("gpt2-tiny"); }

void fill(Tensor& tok, Tensor& tgt, int step) {
  for (int64_t i = 0; i < tok.numel(); ++i) {
    tok.i32()[i] = int32_t(uniform_at(uint64_t(50 + step), 1, uint64_t(i)) * 503.0f);
    tgt.i32()[i] = int32_t(uniform_at(uint64_t(50 + step), 2, uint64_t(i)) * 503.0f);
  }
}

// Five training steps at [B, T] on cp ranks under an activation budget; returns the losses.
std::vector<float> train(int cp, int64_t B, int64_t T, int64_t budget, int64_t* peak_activations = nullptr) {
  std::vector<float> losses(5);
  comm::run_ranks(cp, [&](comm::Comm& g) {
    MemoryPool pool("rank");
    model::GPT m(tiny(), pool, 1337, {.groups = {nullptr, &g}, .activation_budget = budget});
    // The cp ranks hold partial sums of the gradients: one replica over the cp group.
    parallel::DataParallel opt(m, g, {}, {});
    Tensor tok = Tensor::empty({B, T}, DType::i32, MemTag::workspace, pool);
    Tensor tgt = Tensor::empty({B, T}, DType::i32, MemTag::workspace, pool);
    for (int s = 0; s < 5; ++s) {
      fill(tok, tgt, s);
      opt.zero_grad();
      float loss = m.forward(tok, tgt, {.fuse_backward = true});
      m.backward();
      opt.step(-1.0);
      if (g.rank() == 0) losses[size_t(s)] = loss;
    }
    if (g.rank() == 0 && peak_activations) *peak_activations = pool.peak(MemTag::activations);
  }, one_thread());
  return losses;
}

TEST(ContextParallel, TrainsASequenceOneRanksBudgetRefuses) {
  const int64_t B = 2, T = 64;
  // The budget: what one rank needs at half the sequence length.
  MemoryPool probe;
  model::GPT one(tiny(), probe);
  const int64_t budget = one.saved_activation_bytes(B, T / 2);
  ASSERT_GT(one.saved_activation_bytes(B, T), budget);
  try {
    train(1, B, T, budget);
    ADD_FAILURE() << "the single rank should refuse T = " << T;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("over the activation budget"), std::string::npos) << e.what();
  }
  int64_t peak = 0;
  const auto cp_losses = train(2, B, T, budget, &peak);
  EXPECT_LE(peak, budget);
  EXPECT_GT(peak, 0);
  for (float l : cp_losses) EXPECT_TRUE(std::isfinite(l));
  // Where both fit (T / 2), cp = 2 equals the single rank step for step.
  const auto a = train(1, B, T / 2, budget), b = train(2, B, T / 2, budget);
  for (size_t s = 0; s < a.size(); ++s) EXPECT_LE(std::abs(a[s] - b[s]) / std::abs(a[s]), 1e-5) << "step " << s;
  // And the long sequence on cp = 2 equals an unbudgeted single-device model::GPT.
  MemoryPool pool;
  model::GPT ref(tiny(), pool);
  optim::AdamW opt(ref.parameters(), {}, pool);
  Tensor tok = Tensor::empty({B, T}, DType::i32, MemTag::workspace, pool);
  Tensor tgt = Tensor::empty({B, T}, DType::i32, MemTag::workspace, pool);
  for (int s = 0; s < 5; ++s) {
    fill(tok, tgt, s);
    ref.zero_grad();
    const float l = ref.forward(tok, tgt, {.fuse_backward = true});
    ref.backward();
    opt.step();
    EXPECT_LE(std::abs(l - cp_losses[size_t(s)]) / std::abs(l), 1e-5) << "step " << s;
  }
}

}  // namespace

// Split backward (zero-bubble schedules): backward_input followed by backward_weight gives the same
// input gradient and parameter gradients as the fused backward, bit for bit, for the transformer
// block, the head and the embedding; the deferred tensors are freed by backward_weight.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "core/backend.h"
#include "core/error.h"
#include "model/blocks.h"

namespace loom::model {
namespace {

GPTConfig tiny() {
  GPTConfig c;
  c.name = "split-tiny";
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  c.vocab_size = 97;
  c.block_size = 16;
  return c;
}

constexpr int64_t kB = 2, kT = 7;

std::vector<float> randn(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

// Gives block b the parameters of block a (LayerNorm weights perturbed so their gradients are
// not trivially symmetric).
void copy_params(ChainBlock& a, ChainBlock& b) {
  auto pa = a.parameters(), pb = b.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i)
    std::memcpy(pb[i]->value_full.raw(), pa[i]->value_full.raw(), size_t(pa[i]->value_full.numel()) * sizeof(float));
}

void expect_same_grads(ChainBlock& a, ChainBlock& b) {
  auto pa = a.parameters(), pb = b.parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    const Tensor& ga = pa[i]->grad_full;
    const Tensor& gb = pb[i]->grad_full;
    double sum2 = 0;
    for (int64_t k = 0; k < ga.numel(); ++k) sum2 += double(ga.f32()[k]) * ga.f32()[k];
    EXPECT_GT(sum2, 0.0) << pa[i]->spec.name << ": the gradient is zero, the comparison means nothing";
    EXPECT_EQ(std::memcmp(ga.raw(), gb.raw(), size_t(ga.numel()) * sizeof(float)), 0)
        << pa[i]->spec.name << ": split gradient differs from the fused one";
  }
}

struct Scratch {
  std::vector<float> dres, bufC, buf4C;
  explicit Scratch(int64_t C) : dres(size_t(kB * kT * C)), bufC(size_t(kB * kT * C)), buf4C(size_t(kB * kT * 4 * C)) {}
  BackwardScratch s() { return {dres.data(), bufC.data(), buf4C.data()}; }
};

TEST(SplitBackward, TransformerBlockEqualsFused) {
  const GPTConfig cfg = tiny();
  const int64_t C = cfg.n_embd, n = kB * kT * C;
  MemoryPool pool("split");
  auto be = make_backend(Device::cpu, {.pool = &pool});
  TransformerBlock fused(cfg, 0, *be), split(cfg, 0, *be);
  // The backend's attention scratch at its size for this shape, so that what backward_input
  // keeps shows alone in the workspace tag.
  be->prepare_attention(DType::f32, split.attention_shape(kB, kT));
  const int64_t scratch = pool.current(MemTag::workspace);
  for (Parameter* p : fused.parameters()) p->initialise(7);
  {
    // LayerNorm weights and biases away from 1 and 0.
    auto ps = fused.parameters();
    for (int i : {0, 1, 6, 7}) {
      std::vector<float> r = randn(C, 100u + uint32_t(i));
      for (int64_t k = 0; k < C; ++k) ps[size_t(i)]->value.f32()[k] += 0.1f * r[size_t(k)];
    }
  }
  copy_params(fused, split);
  const std::vector<float> x = randn(n, 1), dout = randn(n, 2);
  // Two micro-batches, so the split path also accumulates onto non-zero gradients.
  for (int mb = 0; mb < 2; ++mb) {
    std::vector<float> xm = x;
    for (float& v : xm) v += 0.25f * float(mb);
    Scratch a(C), b(C);
    fused.forward(xm.data(), kB, kT);
    split.forward(xm.data(), kB, kT);
    ASSERT_EQ(std::memcmp(fused.out().raw(), split.out().raw(), size_t(n) * sizeof(float)), 0);
    std::memcpy(a.dres.data(), dout.data(), size_t(n) * sizeof(float));
    std::memcpy(b.dres.data(), dout.data(), size_t(n) * sizeof(float));
    fused.backward(xm.data(), a.s());
    split.backward_input(xm.data(), b.s());
    // The input gradient is complete before the weight part runs.
    EXPECT_EQ(std::memcmp(a.dres.data(), b.dres.data(), size_t(n) * sizeof(float)), 0) << "micro-batch " << mb;
    EXPECT_EQ(pool.current(MemTag::workspace), scratch + split.deferred_gradient_bytes(kB, kT));
    split.backward_weight();
    EXPECT_EQ(pool.current(MemTag::workspace), scratch);
  }
  expect_same_grads(fused, split);
  EXPECT_THROW(split.backward_weight(), Error);  // nothing deferred
}

TEST(SplitBackward, HeadAndEmbeddingEqualFused) {
  GPTConfig cfg = tiny();
  cfg.tied_embeddings = false;  // the head owns lm_head, so its gradient is compared here
  const int64_t C = cfg.n_embd, n = kB * kT * C;
  MemoryPool pool("split");
  auto be = make_backend(Device::cpu, {.pool = &pool});
  Embedding emb_a(cfg, *be), emb_b(cfg, *be);
  Head head_a(cfg, nullptr, *be), head_b(cfg, nullptr, *be);
  for (Parameter* p : emb_a.parameters()) p->initialise(3);
  for (Parameter* p : head_a.parameters()) p->initialise(3);
  copy_params(emb_a, emb_b);
  copy_params(head_a, head_b);
  std::mt19937 rng(5);
  for (int mb = 0; mb < 2; ++mb) {
    std::vector<int32_t> tok(size_t(kB * kT)), tgt(size_t(kB * kT));
    for (size_t i = 0; i < tok.size(); ++i) {
      tok[i] = int32_t(rng() % uint32_t(cfg.vocab_size));
      tgt[i] = i % 5 == 4 ? -1 : int32_t(rng() % uint32_t(cfg.vocab_size));
    }
    emb_a.forward(tok.data(), kB, kT);
    emb_b.forward(tok.data(), kB, kT);
    // The fused-loss path (dlogits from forward) on one micro-batch, the separate one on the other.
    const bool fuse = mb == 0;
    const double la = head_a.forward(emb_a.out().f32(), tgt.data(), kB, kT, fuse, 0.5f);
    const double lb = head_b.forward(emb_b.out().f32(), tgt.data(), kB, kT, fuse, 0.5f);
    EXPECT_EQ(la, lb);
    Scratch a(C), b(C);
    head_a.backward(emb_a.out().f32(), a.s(), 0.5f);
    head_b.backward_input(emb_b.out().f32(), b.s(), 0.5f);
    EXPECT_EQ(std::memcmp(a.dres.data(), b.dres.data(), size_t(n) * sizeof(float)), 0) << "micro-batch " << mb;
    emb_a.backward(a.dres.data());
    emb_b.backward_input(b.dres.data());
    EXPECT_EQ(pool.current(MemTag::workspace), emb_b.deferred_gradient_bytes(kB, kT));
    // Weight parts in the fused order (head, then embedding).
    head_b.backward_weight();
    emb_b.backward_weight();
    EXPECT_EQ(pool.current(MemTag::workspace), 0);
  }
  expect_same_grads(emb_a, emb_b);
  expect_same_grads(head_a, head_b);
  EXPECT_THROW(head_b.backward_weight(), Error);
  EXPECT_THROW(emb_b.backward_weight(), Error);
}

}  // namespace
}  // namespace loom::model

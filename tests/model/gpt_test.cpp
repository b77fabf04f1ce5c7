#include "kernels/cpu/backend.h"
#include "model/gpt.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>

#include "core/dtype.h"
#include "core/error.h"
#include "core/rng.h"
#include "optim/adamw.h"

using namespace loom;
using model::GPT;
using model::GPTConfig;

namespace {

GPTConfig tiny() { return model::gpt_preset("gpt2-tiny"); }

struct Batch {
  Tensor tokens, targets;  // i32 [B, T]
};

Batch make_batch(int64_t B, int64_t T, int64_t V, uint64_t seed, MemoryPool& pool) {
  Batch b{Tensor::empty({B, T}, DType::i32, MemTag::workspace, pool),
          Tensor::empty({B, T}, DType::i32, MemTag::workspace, pool)};
  for (int64_t i = 0; i < B * T; ++i) {
    b.tokens.i32()[i] = int32_t(uniform_at(seed, 1, uint64_t(i)) * float(V));
    b.targets.i32()[i] = int32_t(uniform_at(seed, 2, uint64_t(i)) * float(V));
  }
  return b;
}

// Two AdamW training steps on one batch (every buffer of a step allocated, the second step's
// reused), the peaks then in the model's pool.
void train_two_steps(GPT& gpt, optim::AdamW& opt, const Batch& b) {
  for (int step = 0; step < 2; ++step) {
    gpt.zero_grad();
    gpt.forward(b.tokens, b.targets, {.fuse_backward = true});
    gpt.backward();
    opt.step();
  }
}

std::vector<std::vector<float>> grads_of(GPT& gpt) {
  std::vector<std::vector<float>> out;
  for (auto* p : gpt.parameters()) out.emplace_back(p->grad.f32(), p->grad.f32() + p->spec.numel());
  return out;
}

}  // namespace

TEST(GPTConfig, PresetsAndValidation) {
  GPTConfig c = model::gpt_preset("gpt2");
  EXPECT_EQ(c.name, "gpt2-124m");
  EXPECT_EQ(c.padded_vocab(), 50304);
  EXPECT_EQ(tiny().padded_vocab(), 512);
  EXPECT_THROW(model::gpt_preset("gpt3"), Error);
  c.n_head = 5;  // 768 % 5 != 0
  try {
    c.validate("run.toml [model]");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("run.toml [model]: n_embd"), std::string::npos) << e.what();
  }
  c = tiny();
  c.n_layer = 0;
  EXPECT_THROW(c.validate(), Error);
}

TEST(GPT, ParameterNamesShapesAndCount) {
  MemoryPool pool("gpt");
  GPTConfig cfg = tiny();
  GPT gpt(cfg, pool);
  const int64_t C = cfg.n_embd, L = cfg.n_layer, V = cfg.vocab_size, T = cfg.block_size;
  ASSERT_EQ(gpt.parameters().size(), size_t(2 + 12 * L + 2));
  EXPECT_EQ(gpt.parameters()[0]->spec.name, "wte.weight");
  EXPECT_EQ(gpt.parameters()[2]->spec.name, "h.0.ln_1.weight");
  EXPECT_EQ(gpt.parameter("h.1.attn.c_attn.weight").spec.shape, (Shape{3 * C, C}));
  EXPECT_EQ(gpt.parameter("h.1.mlp.c_proj.weight").spec.shape, (Shape{C, 4 * C}));
  EXPECT_EQ(gpt.parameter("wte.weight").value_full.shape(), (Shape{cfg.padded_vocab(), C}));
  EXPECT_THROW(gpt.parameter("lm_head.weight"), Error);  // tied
  const int64_t per_block = 12 * C * C + 13 * C;
  EXPECT_EQ(gpt.num_nonembedding_parameters(), L * per_block + 2 * C);
  EXPECT_EQ(cfg.nonembedding_parameters(), gpt.num_nonembedding_parameters());
  // MFU's FLOPs per token for GPT-2 124M at T = 1024: nanoGPT's estimate_mfu for its model (vocabulary
  // padded to 50304): 6 * 123,689,472 + 12 * 12 * 768 * 1024.
  EXPECT_DOUBLE_EQ(model::gpt_preset("gpt2-124m").flops_per_token(1024), 855383040.0);
  EXPECT_EQ(gpt.num_parameters(), V * C + T * C + L * per_block + 2 * C);
  EXPECT_EQ(pool.current(MemTag::params), gpt.param_bytes());
  EXPECT_EQ(pool.current(MemTag::grads), gpt.grad_bytes());
  // GPT-2 124M: 124,439,808 parameters (Hugging Face's count, tied embeddings).
  GPTConfig big = model::gpt_preset("gpt2-124m");
  const int64_t Cb = big.n_embd;
  EXPECT_EQ(big.vocab_size * Cb + big.block_size * Cb + big.n_layer * (12 * Cb * Cb + 13 * Cb) + 2 * Cb, 124439808);
}

TEST(GPT, UntiedHeadHasItsOwnWeight) {
  MemoryPool pool("gpt");
  GPTConfig cfg = tiny();
  cfg.tied_embeddings = false;
  GPT gpt(cfg, pool);
  EXPECT_EQ(gpt.parameter("lm_head.weight").value_full.shape(), (Shape{cfg.padded_vocab(), cfg.n_embd}));
  MemoryPool io("io");
  Batch b = make_batch(2, 8, cfg.vocab_size, 3, io);
  float loss = gpt.forward(b.tokens, b.targets);
  EXPECT_NEAR(loss, std::log(float(cfg.vocab_size)), 0.1);
  gpt.backward();
  EXPECT_GT(std::fabs(gpt.parameter("lm_head.weight").grad.f32()[5]) +
                std::fabs(gpt.parameter("lm_head.weight").grad.f32()[cfg.n_embd * 100]),
            0.0f);
}

TEST(GPT, InitialisationIsAFunctionOfSeedNameAndIndex) {
  MemoryPool pool("gpt");
  GPTConfig cfg = tiny();
  GPT a(cfg, pool, 11), b(cfg, pool, 11), c(cfg, pool, 12);
  const int64_t C = cfg.n_embd;
  for (size_t i = 0; i < a.parameters().size(); ++i) {
    auto* pa = a.parameters()[i];
    auto* pb = b.parameters()[i];
    ASSERT_EQ(0, std::memcmp(pa->value_full.raw(), pb->value_full.raw(), pa->value_full.nbytes())) << pa->spec.name;
  }
  EXPECT_NE(a.parameter("wpe.weight").value.f32()[3], c.parameter("wpe.weight").value.f32()[3]);
  // A shard [first, first + n) of the full tensor draws the same values.
  model::Parameter& w = a.parameter("h.1.mlp.c_fc.weight");
  std::vector<float> shard(1000);
  model::init_values(w.spec, 11, shard.data(), 5000, 1000);
  for (int i = 0; i < 1000; ++i) ASSERT_EQ(shard[size_t(i)], w.value.f32()[5000 + i]);
  // nanoGPT statistics: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 L)), biases 0, LN 1.
  auto std_of = [](const model::Parameter& p) {
    double s = 0, s2 = 0;
    const int64_t n = p.spec.numel();
    for (int64_t i = 0; i < n; ++i) {
      s += p.value.f32()[i];
      s2 += double(p.value.f32()[i]) * p.value.f32()[i];
    }
    return std::sqrt(s2 / double(n) - (s / double(n)) * (s / double(n)));
  };
  EXPECT_NEAR(std_of(a.parameter("wte.weight")), 0.02, 0.02 * 0.03);
  EXPECT_NEAR(std_of(a.parameter("h.0.attn.c_attn.weight")), 0.02, 0.02 * 0.03);
  const double proj = 0.02 / std::sqrt(2.0 * double(cfg.n_layer));
  EXPECT_NEAR(std_of(a.parameter("h.0.mlp.c_proj.weight")), proj, proj * 0.03);
  EXPECT_NEAR(std_of(a.parameter("h.1.attn.c_proj.weight")), proj, proj * 0.05);
  for (int64_t i = 0; i < C; ++i) {
    ASSERT_EQ(a.parameter("h.0.ln_2.weight").value.f32()[i], 1.0f);
    ASSERT_EQ(a.parameter("h.0.ln_2.bias").value.f32()[i], 0.0f);
    ASSERT_EQ(a.parameter("h.1.attn.c_proj.bias").value.f32()[i], 0.0f);
  }
  const model::Parameter& wte = a.parameter("wte.weight");
  for (int64_t i = cfg.vocab_size * C; i < cfg.padded_vocab() * C; ++i) ASSERT_EQ(wte.value_full.f32()[i], 0.0f);
}

// With the linear layers' products in bf16 (train.precision = bf16) the backend keeps bf16 copies
// of the largest input, of a block of at most 4096 of a weight's rows and of the output gradient's
// columns, and oneDNN's scratch: declared by the model (GPT::linear_workspace_bytes: the backend's
// over its blocks' linear shapes), with biases (GPT-2) and without (Llama), and with a vocabulary
// the head's products take in three blocks; equal to the pool's peak after two steps.
TEST(GPT, Bf16MatmulScratchIsDeclared) {
  if (const std::string missing = cpu_bf16_missing(); !missing.empty()) GTEST_SKIP() << "this CPU lacks " << missing;
  constexpr int64_t kBlock = 4096;  // Bf16Matmul's block of output features
  GPTConfig wide_vocab = model::gpt_preset("gpt2-tiny");
  wide_vocab.vocab_size = 2 * kBlock + 100;
  for (const auto& [name, cfg] : {std::pair{"gpt2-tiny", model::gpt_preset("gpt2-tiny")},
                                  std::pair{"llama-tiny", model::gpt_preset("llama-tiny")},
                                  std::pair{"gpt2-tiny, vocabulary 8292", wide_vocab}}) {
    SCOPED_TRACE(name);
    MemoryPool pool("gpt"), io("io");
    cpu::CpuBackend be({.pool = &pool, .matmul = DType::bf16});
    GPT gpt(cfg, be);
    optim::AdamW opt(gpt.parameters(), {}, pool);
    const int64_t B = 2, T = 16;
    train_two_steps(gpt, opt, make_batch(B, T, cfg.vocab_size, 5, io));
    const int threads = omp_get_max_threads();
    const int64_t linear = gpt.linear_workspace_bytes(B, T);
    // At least the bf16 copies of a block of lm_head's weight and output gradient (that the
    // declaration stays below the whole head's copies is Bf16Matmul's test, at GPT-2 124M's head).
    const int64_t block = std::min(cfg.padded_vocab(), kBlock);
    EXPECT_GE(linear, 2 * block * cfg.n_embd + 2 * B * T * block);
    const int64_t attn = gpt.block(0).attention_workspace_bytes(B, T, threads);
    EXPECT_EQ(gpt.workspace_bytes(B, T, threads), B * T * (2 * cfg.n_embd + model::wide_columns(cfg, 1)) * 4 + attn + linear);
    EXPECT_EQ(pool.peak(MemTag::workspace), gpt.workspace_bytes(B, T, threads));
  }
}

TEST(GPT, PeakMemoryEqualsDeclaration) {
  GPTConfig cfg = tiny();
  MemoryPool pool("gpt");
  MemoryPool io("io");
  GPT gpt(cfg, pool);
  optim::AdamW opt(gpt.parameters(), {}, pool);
  const int64_t B = 3, T = 20;
  train_two_steps(gpt, opt, make_batch(B, T, cfg.vocab_size, 5, io));
  EXPECT_EQ(pool.peak(MemTag::params), gpt.param_bytes());
  EXPECT_EQ(pool.peak(MemTag::grads), gpt.grad_bytes());
  EXPECT_EQ(pool.peak(MemTag::optimizer), opt.state_bytes());
  EXPECT_EQ(pool.peak(MemTag::optimizer), 2 * 4 * gpt.num_parameters());
  EXPECT_EQ(pool.peak(MemTag::activations), gpt.saved_activation_bytes(B, T));
  // Workspace: the backward scratch 24 B T C plus the attention kernel's scratch (one buffer).
  const int threads = omp_get_max_threads();
  const int64_t attn = gpt.block(0).attention_workspace_bytes(B, T, threads);
  EXPECT_GT(attn, 0);
  EXPECT_EQ(gpt.workspace_bytes(B, T, threads), 24 * B * T * cfg.n_embd + attn);
  EXPECT_EQ(pool.peak(MemTag::workspace), gpt.workspace_bytes(B, T, threads));
  EXPECT_EQ(pool.peak(MemTag::comm), 0);
  // The declaration by block: embedding, n_layer blocks, head.
  int64_t sum = 0;
  for (auto* blk : gpt.chain()) sum += blk->saved_activation_bytes(B, T);
  EXPECT_EQ(sum, gpt.saved_activation_bytes(B, T));
  EXPECT_EQ(gpt.block(0).saved_activation_bytes(B, T), 4 * (B * T * (16 * cfg.n_embd + 4) + B * cfg.n_head * T));
  EXPECT_EQ(gpt.head().saved_activation_bytes(B, T), 4 * B * T * (cfg.n_embd + 2 + cfg.padded_vocab() + 1) + 4 * B * T);
  EXPECT_EQ(gpt.embedding().saved_activation_bytes(B, T), 4 * B * T * (1 + cfg.n_embd));
  // Each named saved tensor of a block matches what its last forward kept.
  auto items = gpt.block(1).saved_activations(B, T);
  ASSERT_EQ(items.size(), 13u);
  EXPECT_EQ(items[11].name, "h.1.fch_gelu");
  EXPECT_EQ(items[11].shape, gpt.block(1).saved().fch_gelu.shape());
  EXPECT_EQ(items[5].shape, gpt.block(1).saved().lse.shape());
  // A new shape frees the old activations before allocating: the peak is the larger declaration.
  pool.reset_peaks();
  Batch small = make_batch(1, 4, cfg.vocab_size, 6, io);
  gpt.forward(small.tokens, small.targets);
  EXPECT_EQ(pool.current(MemTag::activations), gpt.saved_activation_bytes(1, 4));
  EXPECT_EQ(pool.peak(MemTag::activations), gpt.saved_activation_bytes(B, T));
  gpt.release_activations();
  EXPECT_EQ(pool.current(MemTag::activations), 0);
  EXPECT_EQ(pool.current(MemTag::workspace), 0);
}

// Every block's attention calls share one scratch buffer that the model takes once for the shape
// (the larger of the forward and backward call): the first step allocates it and the backward
// scratch (four allocations under tag workspace), later steps allocate nothing there.
TEST(GPT, AttentionScratchIsTakenOncePerShape) {
  GPTConfig cfg = tiny();
  MemoryPool pool("gpt"), io("io");
  GPT gpt(cfg, pool);
  const int64_t B = 2, T = 24;
  Batch b = make_batch(B, T, cfg.vocab_size, 7, io);
  for (int step = 0; step < 3; ++step) {
    gpt.zero_grad();
    gpt.forward(b.tokens, b.targets, {.fuse_backward = true});
    gpt.backward();
    EXPECT_EQ(pool.allocations(MemTag::workspace), 4) << "after step " << step + 1;
  }
  EXPECT_EQ(pool.current(MemTag::workspace), gpt.workspace_bytes(B, T, omp_get_max_threads()));
  // A forward without targets at a new shape keeps only that forward call's scratch.
  Batch small = make_batch(1, 8, cfg.vocab_size, 8, io);
  gpt.forward(small.tokens, Tensor());
  const model::TransformerBlock& blk = gpt.block(0);
  EXPECT_EQ(pool.current(MemTag::workspace),
            cpu::attention_workspace_bytes(cpu::CpuBackend::attn_args(blk.attention_shape(1, 8)), false,
                                           omp_get_max_threads()));
  gpt.release_activations();
  EXPECT_EQ(pool.current(MemTag::workspace), 0);
}

TEST(GPT, GradientAccumulationOverMicroBatches) {
  GPTConfig cfg = tiny();
  MemoryPool pool("gpt"), io("io");
  GPT gpt(cfg, pool, 3);
  Batch b = make_batch(2, 16, cfg.vocab_size, 9, io);
  gpt.zero_grad();
  const float l1 = gpt.forward(b.tokens, b.targets, {.fuse_backward = true});
  gpt.backward();
  auto once = grads_of(gpt);
  // The same batch as two micro-steps of half weight, one fused and one not: the same gradients.
  gpt.zero_grad();
  const float l2 = gpt.forward(b.tokens, b.targets, {.fuse_backward = false, .dloss_scale = 0.5f});
  gpt.backward();
  gpt.forward(b.tokens, b.targets, {.fuse_backward = true, .dloss_scale = 0.5f});
  gpt.backward();
  auto twice = grads_of(gpt);
  EXPECT_EQ(l1, l2);
  for (size_t i = 0; i < once.size(); ++i) {
    double d = 0, s = 0;
    for (size_t j = 0; j < once[i].size(); ++j) {
      d += std::pow(double(once[i][j]) - twice[i][j], 2);
      s += std::pow(double(once[i][j]), 2);
    }
    EXPECT_LE(std::sqrt(d / std::max(s, 1e-30)), 1e-6) << gpt.parameters()[i]->spec.name;
  }
}

TEST(GPT, IgnoredTargetsAreNotCounted) {
  GPTConfig cfg = tiny();
  MemoryPool pool("gpt"), io("io");
  GPT gpt(cfg, pool);
  Batch b = make_batch(1, 8, cfg.vocab_size, 4, io);
  gpt.forward(b.tokens, b.targets);
  std::vector<float> per(gpt.losses().f32(), gpt.losses().f32() + 8);
  b.targets.i32()[2] = -1;
  b.targets.i32()[5] = -1;
  const float loss = gpt.forward(b.tokens, b.targets);
  double expect = 0;
  for (int i = 0; i < 8; ++i)
    if (i != 2 && i != 5) expect += per[size_t(i)];
  EXPECT_NEAR(loss, expect / 6, 1e-6);
}

// Repeated runs are bitwise identical; other thread counts agree to rounding (oneDNN's sgemm
// may split its reductions by the team size).
TEST(GPT, RepeatableAndThreadCountStable) {
  GPTConfig cfg = tiny();
  MemoryPool pool("gpt"), io("io");
  GPT gpt(cfg, pool, 5);
  Batch b = make_batch(2, 32, cfg.vocab_size, 8, io);
  const int saved = omp_get_max_threads();
  std::vector<float> losses;
  std::vector<std::vector<std::vector<float>>> grads;
  for (int threads : {2, 2, 1, 3}) {
    omp_set_num_threads(threads);
    gpt.zero_grad();
    losses.push_back(gpt.forward(b.tokens, b.targets, {.fuse_backward = true}));
    gpt.backward();
    grads.push_back(grads_of(gpt));
  }
  omp_set_num_threads(saved);
  EXPECT_EQ(losses[1], losses[0]);
  for (size_t i = 0; i < grads[0].size(); ++i) EXPECT_EQ(grads[1][i], grads[0][i]) << gpt.parameters()[i]->spec.name;
  for (size_t k = 2; k < losses.size(); ++k) {
    EXPECT_NEAR(losses[k], losses[0], 1e-6 * losses[0]);
    for (size_t i = 0; i < grads[0].size(); ++i) {
      double d = 0, s = 0;
      for (size_t j = 0; j < grads[0][i].size(); ++j) {
        d += std::pow(double(grads[k][i][j]) - grads[0][i][j], 2);
        s += std::pow(double(grads[0][i][j]), 2);
      }
      EXPECT_LE(std::sqrt(d / std::max(s, 1e-30)), 1e-5) << gpt.parameters()[i]->spec.name << ", run " << k;
    }
  }
}

TEST(GPT, BadInputIsAnError) {
  GPTConfig cfg = tiny();
  MemoryPool pool("gpt"), io("io");
  GPT gpt(cfg, pool);
  EXPECT_THROW(gpt.backward(), Error);  // no forward yet
  Batch too_long = make_batch(1, cfg.block_size + 1, cfg.vocab_size, 1, io);
  EXPECT_THROW(gpt.forward(too_long.tokens, too_long.targets), Error);
  Batch b = make_batch(1, 4, cfg.vocab_size, 1, io);
  b.tokens.i32()[1] = int32_t(cfg.vocab_size);
  EXPECT_THROW(gpt.forward(b.tokens, b.targets), Error);
  b.tokens.i32()[1] = 0;
  b.targets.i32()[0] = int32_t(cfg.vocab_size) + 3;
  EXPECT_THROW(gpt.forward(b.tokens, b.targets), Error);
  b.targets.i32()[0] = 0;
  Tensor f = Tensor::zeros({1, 4}, DType::f32, MemTag::workspace, io);
  EXPECT_THROW(gpt.forward(f, b.targets), Error);
  // Without targets there is no loss and no backward; logits are available.
  EXPECT_TRUE(std::isnan(gpt.forward(b.tokens, Tensor())));
  EXPECT_EQ(gpt.logits().shape(), (Shape{1, 4, cfg.padded_vocab()}));
  EXPECT_THROW(gpt.backward(), Error);
  // After a fused forward the buffer holds dlogits.
  gpt.forward(b.tokens, b.targets, {.fuse_backward = true});
  EXPECT_THROW(gpt.logits(), Error);
}

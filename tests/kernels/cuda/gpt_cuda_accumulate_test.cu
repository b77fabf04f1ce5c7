// The GPU model's pieces for the trainer (model/gpt_cuda.cuh): gradient accumulation over
// micro-batches (eager, then the captured graph), the separate optimizer step (with the mean
// over micro-batches taken by its grad_scale) against train_step, and the AdamW moments by name
// (a copy continues training as the original does).
// The models here differ from their references only where the GPU sums in a varying order (f32
// atomics of the token-embedding gradient and of flash attention's dq): 1e-4 relative is about
// a thousand times that rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "cuda_test_util.h"
#include "kernels/cuda/allocator.cuh"
#include "model/gpt_cuda.cuh"

using namespace loom;
using namespace loom::test;

namespace {

constexpr double kTol = 1e-4;

model::GPTConfig small_config() {
  model::GPTConfig cfg = model::gpt_preset("gpt2-tiny");
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.n_embd = 128;  // head size 64: flash attention
  return cfg;
}

model::GPTCudaOptions small_options() {
  model::GPTCudaOptions o;
  o.B = 2;
  o.T = 64;
  o.lr = 2e-3f;
  return o;
}

}  // namespace

TEST(GPTCudaAccumulate, GradientIsTheSumOverMicroBatches) {
  LOOM_REQUIRE_GPU();
  const model::GPTConfig cfg = small_config();
  const model::GPTCudaOptions o = small_options();
  const int64_t n = o.B * o.T;
  auto t1 = random_tokens(n, cfg.vocab_size, 1), y1 = random_tokens(n, cfg.vocab_size, 2);
  auto t2 = random_tokens(n, cfg.vocab_size, 3), y2 = random_tokens(n, cfg.vocab_size, 4);
  model::GPTCuda ref(cfg, o, cuda::device_pool(), 5);
  const float l1 = ref.forward_backward(t1.data(), y1.data());
  std::vector<std::vector<float>> g1;
  for (const model::ParamSpec& s : ref.specs()) g1.push_back(ref.gradient(s.name));
  const float l2 = ref.forward_backward(t2.data(), y2.data());

  model::GPTCuda acc(cfg, o, cuda::device_pool(), 5);
  // Twice: the first pass runs eagerly then captures, the second replays the captured graph.
  for (int pass = 0; pass < 2; ++pass) {
    SCOPED_TRACE(pass);
    acc.zero_grad();
    EXPECT_FLOAT_EQ(acc.accumulate(t1.data(), y1.data()), l1);
    EXPECT_FLOAT_EQ(acc.accumulate(t2.data(), y2.data()), l2);
    for (size_t i = 0; i < ref.specs().size(); ++i) {
      const std::string& name = ref.specs()[i].name;
      const std::vector<float> g2 = ref.gradient(name);
      std::vector<double> want(g2.size());
      for (size_t j = 0; j < g2.size(); ++j) want[j] = double(g1[i][j]) + double(g2[j]);
      EXPECT_LE(rel_err(acc.gradient(name), want), kTol) << name;
    }
  }
  // forward_backward zeroes the accumulated gradients first.
  EXPECT_FLOAT_EQ(acc.forward_backward(t1.data(), y1.data()), l1);
  size_t wpe = 0;
  while (wpe < ref.specs().size() && ref.specs()[wpe].name != "wpe.weight") ++wpe;
  ASSERT_LT(wpe, ref.specs().size());
  EXPECT_LE(rel_err(acc.gradient("wpe.weight"), g1[wpe]), kTol);
}

TEST(GPTCudaAccumulate, OptimizerStepMatchesTrainStep) {
  LOOM_REQUIRE_GPU();
  const model::GPTConfig cfg = small_config();
  const model::GPTCudaOptions o = small_options();
  const int64_t n = o.B * o.T;
  auto tok = random_tokens(n, cfg.vocab_size, 6), tgt = random_tokens(n, cfg.vocab_size, 7);
  model::GPTCuda whole(cfg, o, cuda::device_pool(), 8), split(cfg, o, cuda::device_pool(), 8);
  for (int step = 1; step <= 6; ++step) {
    const float lr = o.lr * float(step) / 6.f;  // a new learning rate every step, as a schedule gives
    const float lw = whole.train_step(tok.data(), tgt.data(), lr, step);
    // The batch twice, the sum scaled by 1/2: train_step's gradient, norm and update.
    split.zero_grad();
    const float ls1 = split.accumulate(tok.data(), tgt.data());
    const float ls2 = split.accumulate(tok.data(), tgt.data());
    const float norm = split.optimizer_step(lr, step, 0.5f);
    EXPECT_NEAR(ls1, lw, kTol * lw) << "step " << step;
    EXPECT_FLOAT_EQ(ls2, ls1) << "step " << step;
    EXPECT_NEAR(norm, whole.last_grad_norm(), kTol * whole.last_grad_norm()) << "step " << step;
    EXPECT_FLOAT_EQ(split.last_grad_norm(), norm);
  }
  for (const model::ParamSpec& s : whole.specs()) {
    EXPECT_LE(rel_err(split.parameter(s.name), whole.parameter(s.name)), kTol) << s.name;
    EXPECT_LE(rel_err(split.exp_avg(s.name), whole.exp_avg(s.name)), kTol) << s.name;
    EXPECT_LE(rel_err(split.exp_avg_sq(s.name), whole.exp_avg_sq(s.name)), kTol) << s.name;
  }
  EXPECT_THROW(split.optimizer_step(o.lr, 7, 0.f), Error) << "grad_scale must be positive";
  EXPECT_THROW(split.optimizer_step(o.lr, 7, NAN), Error) << "grad_scale must be finite";
}

TEST(GPTCudaAccumulate, MomentsByNameContinueTraining) {
  LOOM_REQUIRE_GPU();
  const model::GPTConfig cfg = small_config();
  const model::GPTCudaOptions o = small_options();
  const int64_t n = o.B * o.T;
  auto tok = random_tokens(n, cfg.vocab_size, 9), tgt = random_tokens(n, cfg.vocab_size, 10);
  model::GPTCuda a(cfg, o, cuda::device_pool(), 11);
  for (const model::ParamSpec& s : a.specs())
    for (float m : a.exp_avg(s.name)) ASSERT_EQ(m, 0.f) << s.name << ": moments start at zero";
  for (int step = 1; step <= 3; ++step) a.train_step(tok.data(), tgt.data(), o.lr, step);
  // A model with another seed takes a's weights and moments; the step count is the caller's.
  model::GPTCuda b(cfg, o, cuda::device_pool(), 12);
  for (const model::ParamSpec& s : a.specs()) {
    const std::vector<float> p = a.parameter(s.name), m = a.exp_avg(s.name), v = a.exp_avg_sq(s.name);
    b.set_parameter(s.name, p.data());
    b.set_exp_avg(s.name, m.data());
    b.set_exp_avg_sq(s.name, v.data());
    EXPECT_EQ(b.exp_avg(s.name), m) << s.name;
    EXPECT_EQ(b.exp_avg_sq(s.name), v) << s.name;
  }
  double moved = 0;
  for (float m : a.exp_avg("wpe.weight")) moved += std::fabs(m);
  EXPECT_GT(moved, 0) << "three steps leave nonzero moments";
  for (int step = 4; step <= 6; ++step) {
    const float la = a.train_step(tok.data(), tgt.data(), o.lr, step);
    const float lb = b.train_step(tok.data(), tgt.data(), o.lr, step);
    EXPECT_NEAR(lb, la, kTol * la) << "step " << step;
  }
  for (const model::ParamSpec& s : a.specs())
    EXPECT_LE(rel_err(b.parameter(s.name), a.parameter(s.name)), kTol) << s.name;
  std::vector<float> wrong(4, 0.f);
  EXPECT_THROW(b.set_exp_avg("no.such.weight", wrong.data()), Error);
  EXPECT_THROW(b.exp_avg_sq("no.such.weight"), Error);
}

// The training step runner (train/step_runner.h) on a backend: the same suite for every device,
// instantiated by step_runner_test.cpp (cpu, and emu: the emulated device in bf16) and
// step_runner_cuda_test.cu (cuda; skipped without a GPU). References are the model's own forward
// and backward with the CPU AdamW (optim/adamw.h) on a CPU copy, so the runner's batch handling,
// device loss, multi-tensor AdamW, graphs and accumulation are what is checked. Tolerances: f32
// backend 1e-6 relative (the same kernels; the loss is reduced in another order), bf16 backend
// 2e-2 absolute for losses (bf16 compute against the f32 reference, compounded over steps).
// Parameters after the steps are compared on the f32 backend only: AdamW normalises every
// element's update, so where a gradient is near zero (the key bias's is zero but for rounding) a
// bf16 gradient moves the element by up to lr in a direction the f32 one need not share; the bf16
// backend's parameters are checked through the losses of the steps that follow instead.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/backend.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "train/step_runner.h"

namespace loom::test {

inline double step_rel_err(const std::vector<float>& a, const float* ref, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
    den += double(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

class StepRunnerSuite : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override {
    std::string why;
    if (!backend_available(GetParam(), &why)) GTEST_SKIP() << device_name(GetParam()) << " backend: " << why;
    cfg_ = model::gpt_preset("gpt2-tiny");
    cfg_.n_layer = 2;
    cfg_.n_head = 2;
    cfg_.n_embd = 128;  // head size 64: every CUDA attention kernel takes it
    cfg_.block_size = 64;
    cfg_.vocab_size = 211;
  }
  std::unique_ptr<Backend> backend() { return make_backend(GetParam()); }
  bool bf16(Backend& be) const { return be.compute_dtype() == DType::bf16; }
  double loss_tol(Backend& be) const { return bf16(be) ? 2e-2 : 1e-6; }
  std::vector<int32_t> ids(int64_t n, uint32_t seed, bool ignore_some = false) const {
    std::mt19937 g(seed);
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (size_t i = 0; i < v.size(); ++i) v[i] = ignore_some && i % 7 == 3 ? -1 : int32_t(g() % uint32_t(cfg_.vocab_size));
    return v;
  }
  static Tensor host(const std::vector<int32_t>& v, int64_t B, int64_t T) {
    Tensor t = Tensor::empty({B, T}, DType::i32, MemTag::workspace);
    std::copy(v.begin(), v.end(), t.i32());
    return t;
  }
  model::GPTConfig cfg_;
};

// Steps of the runner against the CPU model with optim::AdamW: losses every step, parameters
// after the last.
TEST_P(StepRunnerSuite, TrainStepsMatchTheModelWithAdamW) {
  const int64_t B = 2, T = 32, steps = 4;
  auto be = backend();
  model::GPT gpt(cfg_, *be, 5);
  train::StepRunner run(gpt, {.B = B, .T = T});
  MemoryPool ref_pool("ref");
  model::GPT ref(cfg_, ref_pool, 5);
  optim::AdamW opt(ref.parameters(), {.lr = 1e-2, .weight_decay = 0.1, .max_norm = 1.0f}, ref_pool);
  for (int64_t s = 0; s < steps; ++s) {
    const auto x = ids(B * T, uint32_t(10 + s)), y = ids(B * T, uint32_t(20 + s), /*ignore_some=*/true);
    const float l = run.train_step(x.data(), y.data(), 1e-2, s + 1);
    ref.zero_grad();
    const float rl = ref.forward(host(x, B, T), host(y, B, T), {.fuse_backward = true});
    ref.backward();
    const optim::StepStats st = opt.step();
    EXPECT_NEAR(l, rl, loss_tol(*be) * (bf16(*be) ? 1.0 : std::fabs(rl))) << "step " << s + 1;
    EXPECT_NEAR(run.last_grad_norm(), st.grad_norm, (bf16(*be) ? 5e-2 : 1e-5) * st.grad_norm) << "step " << s + 1;
  }
  if (!bf16(*be))
    for (model::Parameter* p : ref.parameters()) {
      const std::vector<float> got = run.parameter(p->spec.name);
      EXPECT_LE(step_rel_err(got, p->value.f32(), got.size()), 1e-6) << p->spec.name;
    }
  // The steps ran as graph replays where the backend captures (the first step eagerly).
  EXPECT_EQ(run.graph_launches(), be->can_capture() ? steps - 1 : 0);
}

// accumulate() adds each micro-batch's gradient (checked against forward_backward of each), and
// optimizer_step's grad_scale scales the gradient its norm is taken of.
TEST_P(StepRunnerSuite, AccumulationSumsTheMicroBatches) {
  const int64_t B = 2, T = 24;
  auto be = backend();
  model::GPT gpt(cfg_, *be, 9);
  train::StepRunner run(gpt, {.B = B, .T = T});
  const auto x0 = ids(B * T, 1), y0 = ids(B * T, 2, true), x1 = ids(B * T, 3), y1 = ids(B * T, 4);
  run.forward_backward(x0.data(), y0.data());
  std::vector<std::vector<float>> g0;
  for (model::Parameter* p : gpt.parameters()) g0.push_back(run.gradient(p->spec.name));
  run.forward_backward(x1.data(), y1.data());
  std::vector<std::vector<float>> g1;
  for (model::Parameter* p : gpt.parameters()) g1.push_back(run.gradient(p->spec.name));
  run.zero_grad();
  const float l0 = run.accumulate(x0.data(), y0.data());
  const float l1 = run.accumulate(x1.data(), y1.data());
  const float l1_again = run.accumulate(x1.data(), y1.data());  // a replay where the backend captures
  EXPECT_EQ(l1, l1_again);
  EXPECT_GT(l0, 0.f);
  // The accumulated gradient is g0 + 2 g1 (x1 twice); the update takes the mean over the three
  // micro-batches, so its norm is a third of the accumulated gradient's.
  std::vector<std::vector<float>> acc;
  for (model::Parameter* p : gpt.parameters()) acc.push_back(run.gradient(p->spec.name));
  double ss = 0;
  for (const auto& a : acc)
    for (float v : a) ss += double(v) * v / 9.0;
  const float norm = run.optimizer_step(1e-3, 1, 1.0f / 3.0f);
  EXPECT_NEAR(norm, std::sqrt(ss), std::sqrt(ss) * (bf16(*be) ? 1e-3 : 1e-5));
  for (size_t i = 0; i < acc.size(); ++i) {
    std::vector<float> want(acc[i].size());
    for (size_t k = 0; k < want.size(); ++k) want[k] = g0[i][k] + 2.0f * g1[i][k];
    EXPECT_LE(step_rel_err(acc[i], want.data(), want.size()), bf16(*be) ? 1e-3 : 1e-6)
        << gpt.parameters()[i]->spec.name;
  }
}

// A loss scale (fp16's loss scaling: the loss gradient times S, the gradients divided by S before
// the norm, clipping and AdamW) is undone exactly: S a power of two scales every gradient exactly
// (no overflow or underflow at these sizes), so the losses, norms and parameters equal an
// unscaled run's bit for bit on the f32 backend (on a 16-bit backend to the same accuracy; its
// replays may sum in another order). Through train_step (a step at another scale is captured
// again), and through accumulate with optimizer_step's grad_scale carrying 1 / S.
TEST_P(StepRunnerSuite, LossScaleIsUndoneBeforeTheUpdate) {
  const int64_t B = 2, T = 32, steps = 3;
  auto be_a = backend(), be_b = backend();
  model::GPT ga(cfg_, *be_a, 11), gb(cfg_, *be_b, 11);
  train::StepRunner ra(ga, {.B = B, .T = T}), rb(gb, {.B = B, .T = T});
  const bool exact = !bf16(*be_a) && be_a->compute_dtype() == DType::f32;
  auto same = [&](double a, double b, const std::string& what) {
    if (exact)
      EXPECT_EQ(a, b) << what;
    else
      EXPECT_NEAR(a, b, 1e-3 * std::fabs(b)) << what;
  };
  for (int64_t s = 0; s < steps; ++s) {
    const auto x = ids(B * T, uint32_t(40 + s)), y = ids(B * T, uint32_t(50 + s), true);
    const float scale = s == 1 ? 4096.0f : 1024.0f;  // a new scale mid-run: captured again
    same(rb.train_step(x.data(), y.data(), 1e-2, s + 1, scale), ra.train_step(x.data(), y.data(), 1e-2, s + 1),
         "loss, step " + std::to_string(s + 1));
    same(rb.last_grad_norm(), ra.last_grad_norm(), "norm, step " + std::to_string(s + 1));
  }
  const auto x = ids(B * T, 60), y = ids(B * T, 61);
  ra.zero_grad();
  rb.zero_grad();
  same(rb.accumulate(x.data(), y.data(), 2048.0f), ra.accumulate(x.data(), y.data()), "accumulated loss");
  same(rb.optimizer_step(1e-2, steps + 1, 1.0f / 2048.0f), ra.optimizer_step(1e-2, steps + 1), "accumulated norm");
  for (model::Parameter* p : ga.parameters()) {
    const std::vector<float> pa = ra.parameter(p->spec.name), pb = rb.parameter(p->spec.name);
    if (exact)
      EXPECT_EQ(pa, pb) << p->spec.name;
    else
      EXPECT_LE(step_rel_err(pb, pa.data(), pa.size()), 1e-2) << p->spec.name;
  }
}

// Checkpoint state by name: what is set is what is read, and training goes on from it exactly as
// it would have.
TEST_P(StepRunnerSuite, StateByNameContinuesTraining) {
  const int64_t B = 1, T = 16;
  auto be = backend();
  model::GPT a(cfg_, *be, 3), b(cfg_, *be, 4);
  train::StepRunner ra(a, {.B = B, .T = T}), rb(b, {.B = B, .T = T});
  const auto x = ids(B * T, 30), y = ids(B * T, 31);
  for (int s = 1; s <= 2; ++s) ra.train_step(x.data(), y.data(), 1e-2, s);
  for (model::Parameter* p : a.parameters()) {
    const std::string& n = p->spec.name;
    rb.set_parameter(n, ra.parameter(n).data());
    rb.set_exp_avg(n, ra.exp_avg(n).data());
    rb.set_exp_avg_sq(n, ra.exp_avg_sq(n).data());
    EXPECT_EQ(rb.exp_avg(n), ra.exp_avg(n)) << n;
  }
  const float la = ra.train_step(x.data(), y.data(), 1e-2, 3), lb = rb.train_step(x.data(), y.data(), 1e-2, 3);
  EXPECT_EQ(la, lb);
  for (model::Parameter* p : a.parameters()) EXPECT_EQ(ra.parameter(p->spec.name), rb.parameter(p->spec.name));
  EXPECT_THROW(ra.parameter("h.9.ln_1.weight"), Error);
}

// Bad batches are refused before any device work, naming the index; the runner still trains.
TEST_P(StepRunnerSuite, BadBatchIsAnError) {
  const int64_t B = 1, T = 8;
  auto be = backend();
  model::GPT gpt(cfg_, *be, 1);
  train::StepRunner run(gpt, {.B = B, .T = T});
  std::vector<int32_t> x(8, 1), y(8, 2);
  x[3] = int32_t(cfg_.vocab_size);
  EXPECT_THROW(run.train_step(x.data(), y.data(), 1e-3, 1), Error);
  x[3] = 0;
  y[5] = -2;
  EXPECT_THROW(run.forward(x.data(), y.data()), Error);
  y[5] = 1;
  EXPECT_TRUE(std::isfinite(run.train_step(x.data(), y.data(), 1e-3, 1)));
  EXPECT_THROW(train::StepRunner(gpt, {.B = 1, .T = cfg_.block_size + 1}), Error);
}

}  // namespace loom::test

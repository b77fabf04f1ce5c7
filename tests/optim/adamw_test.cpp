#include "optim/adamw.h"

#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "model/gpt.h"

using namespace loom;

namespace {

model::GPTConfig tiny() {
  model::GPTConfig c = model::gpt_preset("gpt2-tiny");
  c.n_layer = 1;
  return c;
}

}  // namespace

TEST(AdamW, DecayGroupsFollowNanoGPT) {
  MemoryPool pool("adamw");
  model::GPT gpt(tiny(), pool);
  for (model::Parameter* p : gpt.parameters()) {
    const std::string& n = p->spec.name;
    bool matrix = n == "wte.weight" || n == "wpe.weight" || n.find("c_attn.weight") != std::string::npos ||
                  n.find("c_proj.weight") != std::string::npos || n.find("c_fc.weight") != std::string::npos;
    EXPECT_EQ(p->spec.decay(), matrix) << n;
  }
}

TEST(AdamW, OneStepMatchesFormulaWithClipping) {
  MemoryPool pool("adamw");
  model::GPT gpt(tiny(), pool, 7);
  // Known gradients: g = 0.01 * (i % 7 - 3) for every parameter.
  std::vector<std::vector<float>> before, grads;
  double ss = 0;
  for (model::Parameter* p : gpt.parameters()) {
    std::vector<float> g(size_t(p->spec.numel()));
    for (size_t i = 0; i < g.size(); ++i) {
      g[i] = 0.01f * float(int(i % 7) - 3);
      p->grad.f32()[i] = g[i];
      ss += double(g[i]) * g[i];
    }
    grads.push_back(g);
    before.emplace_back(p->value.f32(), p->value.f32() + p->spec.numel());
  }
  optim::AdamWConfig cfg;
  cfg.lr = 1e-2f;
  cfg.weight_decay = 0.1f;
  cfg.max_norm = 0.5f;
  optim::AdamW opt(gpt.parameters(), cfg, pool);
  EXPECT_EQ(pool.current(MemTag::optimizer), opt.state_bytes());
  EXPECT_NEAR(opt.grad_sum_squares(), ss, 1e-9 * ss);
  optim::StepStats st = opt.step();
  EXPECT_NEAR(st.grad_norm, std::sqrt(ss), 1e-6 * std::sqrt(ss));
  const double scale = 0.5 / (std::sqrt(ss) + 1e-6);
  ASSERT_LT(scale, 1.0);  // the clip is active
  EXPECT_NEAR(st.clip_scale, scale, 1e-6);
  EXPECT_EQ(st.step, 1);
  size_t k = 0;
  for (model::Parameter* p : gpt.parameters()) {
    const float wd = p->spec.decay() ? 0.1f : 0.0f;
    for (int64_t i = 0; i < p->spec.numel(); i += 97) {
      // Step 1: m_hat = g, v_hat = g^2, so the update is lr * g / (|g| + eps) after decay.
      double g = grads[k][size_t(i)] * scale, w = before[k][size_t(i)];
      double expect = w * (1 - 1e-2 * wd) - 1e-2 * g / (std::fabs(g) + 1e-8);
      EXPECT_NEAR(p->value.f32()[i], expect, 1e-6) << p->spec.name << "[" << i << "]";
    }
    ++k;
  }
  // The wte padding rows stay zero.
  model::Parameter& wte = gpt.parameter("wte.weight");
  const int64_t V = tiny().vocab_size, Vp = tiny().padded_vocab(), C = tiny().n_embd;
  for (int64_t i = V * C; i < Vp * C; ++i) ASSERT_EQ(wte.value_full.f32()[i], 0.0f);
}

TEST(AdamW, NonFiniteNormAndBadConfigAreErrors) {
  MemoryPool pool("adamw");
  model::GPT gpt(tiny(), pool);
  optim::AdamWConfig bad;
  bad.beta2 = 1.0f;
  EXPECT_THROW(optim::AdamW(gpt.parameters(), bad, pool), Error);
  optim::AdamW opt(gpt.parameters(), {}, pool);
  gpt.parameters()[3]->grad.f32()[0] = std::nanf("");
  EXPECT_THROW(opt.step(), Error);
}

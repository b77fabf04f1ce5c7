// Activation recomputation (model/recompute.h): every policy trains bit-identically to none over
// 20 AdamW steps (the same kernels on the same values), the activations pool peaks at exactly plan_peak, and the
// optimal policy's plan is the least recompute cost that fits the budget (then the least peak),
// checked against every plan of small chains.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>

#include "core/error.h"
#include "core/rng.h"
#include "model/gpt.h"
#include "model/recompute.h"
#include "optim/adamw.h"

using namespace loom;
using namespace loom::model;

namespace {

GPTConfig five_blocks(const char* preset = "gpt2-tiny") {
  GPTConfig c = gpt_preset(preset);
  c.n_layer = 5;
  return c;
}

struct Trained {
  std::vector<float> losses;
  std::vector<std::vector<float>> params;
  int64_t peak_activations = 0, declared = 0, none_declared = 0;
};

Trained train(const RecomputePlan* plan, int steps = 20, const GPTConfig& cfg = five_blocks()) {
  MemoryPool pool("recompute");
  GPT gpt(cfg, pool);
  if (plan) gpt.set_recompute(*plan);
  optim::AdamW opt(gpt.parameters(), {}, pool);
  const int64_t B = 2, T = 32;
  Tensor tok = Tensor::empty({B, T}, DType::i32, MemTag::workspace, pool);
  Tensor tgt = Tensor::empty({B, T}, DType::i32, MemTag::workspace, pool);
  Trained r;
  pool.reset_peaks();
  for (int s = 0; s < steps; ++s) {
    for (int64_t i = 0; i < B * T; ++i) {
      tok.i32()[i] = int32_t(uniform_at(uint64_t(7 + s), 1, uint64_t(i)) * 503.0f);
      tgt.i32()[i] = int32_t(uniform_at(uint64_t(7 + s), 2, uint64_t(i)) * 503.0f);
    }
    gpt.zero_grad();
    r.losses.push_back(gpt.forward(tok, tgt, {.fuse_backward = true}));
    gpt.backward();
    opt.step();
  }
  for (Parameter* p : gpt.parameters()) r.params.emplace_back(p->value.f32(), p->value.f32() + p->spec.numel());
  r.peak_activations = pool.peak(MemTag::activations);
  r.declared = gpt.activation_peak_bytes(B, T);
  r.none_declared = gpt.saved_activation_bytes(B, T);
  return r;
}

ChainMemory identical(int64_t L, double F, double o, double fixed) {
  ChainMemory c;
  c.full.assign(size_t(L), F);
  c.out.assign(size_t(L), o);
  c.forward.assign(size_t(L), 1.0);
  c.fixed = fixed;
  return c;
}

// Every plan of L blocks: each block kept, starting a segment, or continuing the one before.
void every_plan(int64_t L, const std::function<void(const RecomputePlan&)>& fn) {
  std::vector<int> label(size_t(L), 0);
  std::function<void(int64_t)> go = [&](int64_t l) {
    if (l == L) {
      RecomputePlan p;
      p.blocks = L;
      for (int64_t i = 0; i < L; ++i) {
        if (label[size_t(i)] == 1) p.segments.push_back({i, i});
        if (label[size_t(i)] == 2) p.segments.back().second = i;
      }
      fn(p);
      return;
    }
    for (int v = 0; v < 3; ++v) {
      if (v == 2 && (l == 0 || label[size_t(l - 1)] == 0)) continue;
      label[size_t(l)] = v;
      go(l + 1);
    }
  };
  go(0);
}

}  // namespace

// Every policy against none, for a model of either family (the Llama's blocks rotate q and k and
// gate the MLP, so a recomputed block must run those again too).
void expect_every_policy_bit_identical(const GPTConfig& cfg) {
  const Trained none = train(nullptr, 20, cfg);
  EXPECT_EQ(none.peak_activations, none.declared);
  MemoryPool probe;
  GPT shapes(cfg, probe);
  const ChainMemory c = shapes.chain_memory(2, 32);
  for (const auto& [name, plan] : std::vector<std::pair<std::string, RecomputePlan>>{
           {"full", plan_recompute(Recompute::full, c)},
           {"every-2", plan_recompute(Recompute::every_k, c, 2)},
           {"sqrt", plan_recompute(Recompute::sqrt, c)},
           {"optimal", plan_recompute(Recompute::optimal, c, 2, (plan_peak(plan_recompute(Recompute::full, c), c) +
                                                                 double(none.declared)) / 2)},
           {"selective", plan_recompute(Recompute::selective, c)}}) {
    SCOPED_TRACE(cfg.name + " " + name + ": " + plan.describe());
    const Trained r = train(&plan, 20, cfg);
    EXPECT_EQ(r.losses, none.losses);
    ASSERT_EQ(r.params.size(), none.params.size());
    for (size_t i = 0; i < r.params.size(); ++i) EXPECT_EQ(r.params[i], none.params[i]) << "parameter " << i;
    EXPECT_EQ(r.peak_activations, r.declared);
    EXPECT_LT(r.peak_activations, none.peak_activations);
    std::printf("  %-10s %-8s %-22s peak activations %lld of %lld bytes\n", cfg.name.c_str(), name.c_str(),
                plan.describe().c_str(), (long long)r.peak_activations, (long long)none.peak_activations);
  }
}

TEST(Recompute, EveryPolicyTrainsBitIdenticallyAndPeaksAsDeclared) {
  expect_every_policy_bit_identical(five_blocks());
  expect_every_policy_bit_identical(five_blocks("llama-tiny"));
  MemoryPool probe;
  GPT shapes(five_blocks(), probe);
  const ChainMemory c = shapes.chain_memory(2, 32);
  EXPECT_EQ(plan_recompute(Recompute::sqrt, c).describe(), "h.0-h.2, h.3-h.4");
  EXPECT_EQ(plan_recompute(Recompute::full, c).describe(), "h.0-h.4 in segments of 1 block");
  EXPECT_EQ(plan_recompute(Recompute::full, c).recomputed_blocks(), 5);
  // Selective: every block saves all but its attention output and log-sum-exps.
  const int64_t B = 2, T = 32, C = 64, NH = 4;
  EXPECT_EQ(plan_peak(RecomputePlan{5, {}, false}, c) - double(train(nullptr, 0).none_declared), 0.0);
  GPT sel(five_blocks(), probe);
  sel.set_recompute(plan_recompute(Recompute::selective, c));
  EXPECT_EQ(shapes.saved_activation_bytes(B, T) - sel.saved_activation_bytes(B, T), 5 * 4 * (B * T * C + B * NH * T));
}

TEST(Recompute, OptimalIsTheLeastCostThatFitsAmongEveryPlan) {
  struct Case {
    int64_t L;
    std::vector<double> outs, budgets;
  };
  // Chains up to 12 blocks (3^12 plans); F = 16, the embedding and head 5.
  const std::vector<Case> cases{{1, {1, 4}, {10, 30}},
                                {3, {1, 4}, {30, 45, 60}},
                                {5, {1, 4}, {30, 45, 60, 80, 120}},
                                {7, {1, 4}, {45, 60, 80, 120}},
                                {12, {2}, {60, 110, 180}}};
  // (Each budget scaled with n, so the plans differ.)
  // n micro-batches in flight, with and without a split backward (zero bubble).
  for (bool split : {false, true})
  for (double n : {1.0, 2.0, 3.0})
  for (const Case& cs : cases)
    for (double o : cs.outs)
      for (double budget1 : cs.budgets) {
        const int64_t L = cs.L;
        const double budget = budget1 * (n == 1 ? 1.0 : 0.8 * n);
        ChainMemory c = identical(L, 16.0, o, 5.0);
        c.in_flight = n;
        c.split_backward = split;
        double best_cost = std::numeric_limits<double>::infinity(), best_peak = 0;
        every_plan(L, [&](const RecomputePlan& p) {
          const double peak = plan_peak(p, c), cost = plan_cost(p, c);
          if (peak > budget) return;
          if (cost < best_cost || (cost == best_cost && peak < best_peak)) best_cost = cost, best_peak = peak;
        });
        SCOPED_TRACE(fmt::format("L={} o={} budget={} in flight {}{}", L, o, budget, n, split ? " split" : ""));
        if (!std::isfinite(best_cost)) {
          try {
            plan_recompute(Recompute::optimal, c, 2, budget);
            ADD_FAILURE() << "no plan fits, yet one was returned";
          } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("memory.activation_budget"), std::string::npos) << e.what();
          }
          continue;
        }
        const RecomputePlan p = plan_recompute(Recompute::optimal, c, 2, budget);
        EXPECT_LE(plan_peak(p, c), budget);
        EXPECT_EQ(plan_cost(p, c), best_cost);
        EXPECT_EQ(plan_peak(p, c), best_peak);
      }
}

TEST(Recompute, BadPoliciesAndBudgetsAreRefused) {
  EXPECT_THROW(recompute_from_name("some", "memory.recompute"), Error);
  EXPECT_EQ(recompute_from_name("every-k", "memory.recompute"), Recompute::every_k);
  const ChainMemory c = identical(4, 16, 1, 5);
  EXPECT_THROW(plan_recompute(Recompute::optimal, c, 2, 0), Error);  // no budget
  EXPECT_THROW(plan_recompute(Recompute::every_k, c, 0), Error);
}

// ZeRO-1 over a list of parameters (parallel/data/zero1.h) against plain data parallelism: the
// gradients all-reduced and averaged, optim::AdamW over whole parameters. dp in {2, 3} on the
// threads backend, five parameters (one with vocabulary-style padding rows, element counts not
// divisible by dp, parameters straddling shard boundaries, one left out of the norm), clipping
// active in every step. After 5 steps the parameters and both moments agree within
// ||x - x_ref|| / ||x_ref|| <= 1e-6; the pools hold exactly the bytes of the header's formulas;
// moments scattered into a fresh optimizer continue the run bit for bit.
#include "parallel/data/zero1.h"

#include <gtest/gtest.h>

#include <omp.h>

#include <cmath>
#include <memory>
#include <mutex>

#include "comm/threads.h"
#include "core/error.h"
#include "core/rng.h"
#include "optim/adamw.h"
#include "parallel/data/param_set_util.h"

using namespace loom;

namespace {

constexpr int kSteps = 5;

using test::raw;
using test::rel_dist;

std::vector<std::unique_ptr<model::Parameter>> make_params(MemoryPool& pool) { return test::make_param_set(pool); }
const std::vector<test::ParamSpec>& specs() { return test::param_set(); }
optim::AdamWConfig adam_cfg() { return test::clipping_adamw(); }
float grad_at(int s, int r, size_t k, int64_t j) { return test::grad_at(1000, s, r, k, j); }

struct Result {
  std::vector<std::vector<float>> params, exp_avg, exp_avg_sq;  // per parameter, logical elements
  std::vector<double> norms;
};

Result reference(int dp) {
  MemoryPool pool("ref");
  auto ps = make_params(pool);
  optim::AdamW opt(raw(ps), adam_cfg(), pool);
  Result r;
  for (int s = 0; s < kSteps; ++s) {
    double sq = 0;
    for (size_t k = 0; k < ps.size(); ++k) {
      float* g = ps[k]->grad.f32();
      for (int64_t j = 0; j < ps[k]->spec.numel(); ++j) {
        double sum = 0;
        for (int q = 0; q < dp; ++q) sum += grad_at(s, q, k, j);
        g[j] = float(sum / dp);
        if (specs()[k].in_norm) sq += double(g[j]) * g[j];
      }
    }
    r.norms.push_back(std::sqrt(sq));
    optim::StepStats st = opt.step_with_norm(std::sqrt(sq));
    EXPECT_LT(st.clip_scale, 1.0f) << "clipping must be active";
  }
  for (size_t k = 0; k < ps.size(); ++k) {
    const int64_t n = ps[k]->spec.numel();
    r.params.emplace_back(ps[k]->value.f32(), ps[k]->value.f32() + n);
    r.exp_avg.emplace_back(opt.exp_avg(k).f32(), opt.exp_avg(k).f32() + n);
    r.exp_avg_sq.emplace_back(opt.exp_avg_sq(k).f32(), opt.exp_avg_sq(k).f32() + n);
  }
  return r;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The header's formulas, from the specs alone.
int64_t expected_n_pad(int dp) {
  int64_t sum = 0;
  for (const test::ParamSpec& s : specs()) {
    const int64_t rows = std::max(s.alloc_rows, s.shape[0]);
    sum += round_up(shape_numel(s.shape) / s.shape[0] * rows, 16);
  }
  return round_up(sum, 16 * dp);
}

struct RankOut {
  Result result;
  int64_t params_peak = 0, grads_peak = 0, optimizer_peak = 0, other_peak = 0;
  int64_t n_pad = 0, shard = 0;
  bool padding_zero = true;
  bool straddles = false;  // some parameter spans two shards
};

// One dp rank: kSteps steps of ZeRO-1 with the rank's own gradients.
RankOut run_rank(comm::Comm& dp) {
  RankOut o;
  MemoryPool pool(fmt::format("rank{}", dp.rank()));
  auto ps = make_params(pool);
  parallel::Zero1Options zo;
  for (const test::ParamSpec& s : specs()) zo.in_norm.push_back(s.in_norm);
  parallel::Zero1Optimizer opt(raw(ps), dp, adam_cfg(), pool, zo);
  pool.reset_peaks();
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    for (size_t k = 0; k < ps.size(); ++k)
      for (int64_t j = 0; j < ps[k]->spec.numel(); ++j) ps[k]->grad.f32()[j] = grad_at(s, dp.rank(), k, j);
    const double sq = opt.reduce_gradients();
    const double norm = std::sqrt(parallel::sum_over_ranks(dp, sq));
    optim::StepStats st = opt.step(norm);
    EXPECT_LT(st.clip_scale, 1.0f);
    o.result.norms.push_back(norm);
  }
  o.params_peak = pool.peak(MemTag::params);
  o.grads_peak = pool.peak(MemTag::grads);
  o.optimizer_peak = pool.peak(MemTag::optimizer);
  for (MemTag t : {MemTag::activations, MemTag::workspace, MemTag::comm}) o.other_peak += pool.peak(t);
  o.n_pad = opt.flat_elements();
  o.shard = opt.shard_elements();
  for (size_t k = 0; k < ps.size(); ++k) {
    const int64_t n = ps[k]->spec.numel();
    o.result.params.emplace_back(ps[k]->value.f32(), ps[k]->value.f32() + n);
    for (int64_t j = n; j < ps[k]->value_full.numel(); ++j) o.padding_zero &= ps[k]->value_full.f32()[j] == 0.0f;
    std::vector<float> m(static_cast<size_t>(n)), v(static_cast<size_t>(n));
    test::gather_moments(opt.moment_part(k), dp, n, m.data(), v.data());
    o.result.exp_avg.push_back(m);
    o.result.exp_avg_sq.push_back(v);
    int parts = 0;
    for (int64_t c : opt.layout().shard_counts(opt.layout().params[k].offset, opt.layout().params[k].offset + n))
      parts += c > 0;
    o.straddles |= parts > 1;
  }
  return o;
}

std::vector<RankOut> run_dp(int dp) {
  std::vector<RankOut> out(static_cast<size_t>(dp));
  comm::RunOptions ro;
  ro.threads_per_rank = 1;
  comm::run_ranks(dp, [&](comm::Comm& c) { out[size_t(c.rank())] = run_rank(c); }, ro);
  return out;
}

class Zero1 : public testing::TestWithParam<int> {};

TEST_P(Zero1, EqualsAllReduceAndAdamW) {
  omp_set_num_threads(1);
  const int dp = GetParam();
  const Result ref = reference(dp);
  const std::vector<RankOut> runs = run_dp(dp);
  EXPECT_TRUE(runs[0].straddles) << "the layout should split some parameter between shards";
  for (int r = 0; r < dp; ++r) {
    const RankOut& o = runs[size_t(r)];
    const double dparam = rel_dist(o.result.params, ref.params), dm = rel_dist(o.result.exp_avg, ref.exp_avg),
                 dv = rel_dist(o.result.exp_avg_sq, ref.exp_avg_sq);
    EXPECT_LE(dparam, 1e-6) << "dp=" << dp << " rank " << r;
    EXPECT_LE(dm, 1e-6) << "dp=" << dp << " rank " << r;
    EXPECT_LE(dv, 1e-6) << "dp=" << dp << " rank " << r;
    for (int s = 0; s < kSteps; ++s)
      EXPECT_NEAR(o.result.norms[size_t(s)], ref.norms[size_t(s)], 1e-6 * ref.norms[size_t(s)]) << "step " << s;
    EXPECT_TRUE(o.padding_zero) << "padding rows must stay zero";
    // Every rank holds the same parameters, norms and gathered moments, bit for bit.
    EXPECT_EQ(o.result.params, runs[0].result.params) << "rank " << r;
    EXPECT_EQ(o.result.norms, runs[0].result.norms) << "rank " << r;
    EXPECT_EQ(o.result.exp_avg, runs[0].result.exp_avg) << "rank " << r;
    if (r == 0)
      std::printf("  dp=%d: params %.2e, exp_avg %.2e, exp_avg_sq %.2e relative to all-reduce + AdamW\n", dp, dparam,
                  dm, dv);
  }
}

// params 4 N_pad, grads 4 N_pad, optimizer 8 S; nothing else from the pool during the steps.
TEST_P(Zero1, PeakBytesEqualTheFormulas) {
  omp_set_num_threads(1);
  const int dp = GetParam();
  const int64_t n_pad = expected_n_pad(dp), S = n_pad / dp;
  const std::vector<RankOut> runs = run_dp(dp);
  for (int r = 0; r < dp; ++r) {
    const RankOut& o = runs[size_t(r)];
    EXPECT_EQ(o.n_pad, n_pad) << "rank " << r;
    EXPECT_EQ(o.shard, S) << "rank " << r;
    EXPECT_EQ(o.params_peak, 4 * n_pad) << "rank " << r;
    EXPECT_EQ(o.grads_peak, 4 * n_pad) << "rank " << r;
    EXPECT_EQ(o.optimizer_peak, 8 * S) << "rank " << r;
    EXPECT_EQ(o.other_peak, 0) << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Dp, Zero1, testing::Values(2, 3), [](const auto& i) { return fmt::format("dp{}", i.param); });

// Resume: moments gathered after 3 steps and scattered from one rank into a fresh optimizer over
// the same parameter values continue exactly like the original (2 more steps, bit for bit).
TEST(Zero1Moments, ScatteredMomentsContinueTheRunExactly) {
  omp_set_num_threads(1);
  const int dp = 3;
  comm::RunOptions ro;
  ro.threads_per_rank = 1;
  std::mutex mu;
  comm::run_ranks(dp, [&](comm::Comm& c) {
    MemoryPool pool(fmt::format("rank{}", c.rank()));
    auto a = make_params(pool), b = make_params(pool);
    parallel::Zero1Optimizer oa(raw(a), c, adam_cfg(), pool);
    auto step = [&](parallel::Zero1Optimizer& o, std::vector<std::unique_ptr<model::Parameter>>& ps, int s) {
      o.zero_grad();
      for (size_t k = 0; k < ps.size(); ++k)
        for (int64_t j = 0; j < ps[k]->spec.numel(); ++j) ps[k]->grad.f32()[j] = grad_at(s, c.rank(), k, j);
      o.step(std::sqrt(parallel::sum_over_ranks(c, o.reduce_gradients())));
    };
    for (int s = 0; s < 3; ++s) step(oa, a, s);
    parallel::Zero1Optimizer ob(raw(b), c, adam_cfg(), pool);
    for (size_t k = 0; k < a.size(); ++k) {
      const int64_t n = a[k]->spec.numel();
      std::vector<float> m(static_cast<size_t>(n)), v(static_cast<size_t>(n));
      test::gather_moments(oa.moment_part(k), c, n, m.data(), v.data());
      if (c.rank() != 1) std::fill(m.begin(), m.end(), NAN), std::fill(v.begin(), v.end(), NAN);
      c.broadcast(m.data(), n, DType::f32, 1);  // rank 1's moments to every rank, each keeps its part
      c.broadcast(v.data(), n, DType::f32, 1);
      test::load_moments(ob.moment_part(k), m.data(), v.data());
      std::copy_n(a[k]->value_full.f32(), a[k]->value_full.numel(), b[k]->value_full.f32());
    }
    ob.set_steps_taken(oa.steps_taken());
    for (int s = 3; s < 5; ++s) step(oa, a, s), step(ob, b, s);
    std::lock_guard lock(mu);
    for (size_t k = 0; k < a.size(); ++k) {
      const int64_t n = a[k]->spec.numel();
      EXPECT_EQ(std::vector<float>(b[k]->value.f32(), b[k]->value.f32() + n),
                std::vector<float>(a[k]->value.f32(), a[k]->value.f32() + n))
          << a[k]->spec.name << " rank " << c.rank();
    }
  }, ro);
}

TEST(Zero1Errors, BadParameterListsAreClearErrors) {
  comm::run_ranks(2, [&](comm::Comm& c) {
    MemoryPool pool("rank");
    auto ps = make_params(pool);
    std::vector<model::Parameter*> twice = raw(ps);
    twice.push_back(ps[1].get());
    try {
      parallel::Zero1Optimizer o(twice, c, adam_cfg(), pool);
      ADD_FAILURE() << "a parameter listed twice was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'b1' is listed twice"), std::string::npos) << e.what();
    }
    parallel::Zero1Options zo;
    zo.in_norm = {true, false};
    try {
      parallel::Zero1Optimizer o(raw(ps), c, adam_cfg(), pool, zo);
      ADD_FAILURE() << "a wrong number of in_norm flags was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("2 in_norm flags for 5 parameters"), std::string::npos) << e.what();
    }
    parallel::Zero1Options bad;
    bad.replicas = 3;
    try {
      parallel::Zero1Optimizer o(raw(ps), c, adam_cfg(), pool, bad);
      ADD_FAILURE() << "replicas = 3 over 2 ranks was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("replicas = 3 must divide the group's 2 ranks"), std::string::npos)
          << e.what();
    }
  });
}

// replicas = 1: the reduce-scattered gradient is the plain sum over the group (partial sums of
// one replica, as the cp ranks hold), not the mean.
TEST(Zero1Replicas, OneReplicaSumsTheRanksGradients) {
  comm::run_ranks(2, [&](comm::Comm& c) {
    MemoryPool pool("rank");
    auto ps = make_params(pool);
    parallel::Zero1Options zo;
    zo.replicas = 1;
    parallel::Zero1Optimizer o(raw(ps), c, adam_cfg(), pool, zo);
    o.zero_grad();
    for (auto& p : ps) {
      float* g = p->grad.f32();
      for (int64_t i = 0; i < p->spec.numel(); ++i) g[i] = float(c.rank() + 1) * 0.25f * float(i % 7 + 1);
    }
    const double sq = o.reduce_gradients();
    // Each element's sum over ranks 0 and 1 is 0.75 (i % 7 + 1); the shards' squares add up to
    // the sum over all elements.
    double want = 0;
    for (auto& p : ps)
      for (int64_t i = 0; i < p->spec.numel(); ++i) want += std::pow(0.75 * double(i % 7 + 1), 2);
    const double total = parallel::sum_over_ranks(c, sq);
    EXPECT_NEAR(total, want, 1e-9 * want) << "rank " << c.rank();
  });
}

}  // namespace

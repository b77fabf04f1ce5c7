// parallel::ReplicaOptimizer, the data-parallel reduction over dp x cp: 4 threads ranks as
// dp = 2 replicas of cp = 2 ranks, each holding a partial sum of its replica's gradient. The
// reduced gradient must be the sum over all 4 ranks divided by 2 (cp partial sums added, dp
// replicas averaged), with and without ZeRO-1: after 5 clipped AdamW steps the parameters and
// both moments agree with optim::AdamW on that gradient within ||x - x_ref|| / ||x_ref|| <= 1e-6,
// and every step's norm within 1e-6 relative on every rank. A parameter left out of the norm
// (a replicated copy counted elsewhere) is still updated.
#include "parallel/data/replica_optimizer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <mutex>

#include "comm/threads.h"
#include "core/error.h"
#include "core/rng.h"
#include "parallel/data/param_set_util.h"
#include "parallel/tensor/counting_comm.h"

using namespace loom;

namespace {

constexpr int kSteps = 5, kRanks = 4, kReplicas = 2;

using test::raw;
using test::rel_dist;

float grad_at(int s, int r, size_t k, int64_t j) { return test::grad_at(300, s, r, k, j); }

struct Result {
  std::vector<std::vector<float>> params, m, v;
  std::vector<double> norms;
};

Result reference() {
  MemoryPool pool("ref");
  auto ps = test::make_param_set(pool);
  optim::AdamW opt(raw(ps), test::clipping_adamw(), pool);
  Result r;
  for (int s = 0; s < kSteps; ++s) {
    double sq = 0;
    for (size_t k = 0; k < ps.size(); ++k)
      for (int64_t j = 0; j < ps[k]->spec.numel(); ++j) {
        double sum = 0;
        for (int q = 0; q < kRanks; ++q) sum += grad_at(s, q, k, j);
        const float g = float(sum / kReplicas);
        ps[k]->grad.f32()[j] = g;
        if (test::param_set()[k].in_norm) sq += double(g) * g;
      }
    r.norms.push_back(std::sqrt(sq));
    EXPECT_LT(opt.step_with_norm(std::sqrt(sq)).clip_scale, 1.0f) << "clipping must be active";
  }
  for (size_t k = 0; k < ps.size(); ++k) {
    const int64_t n = ps[k]->spec.numel();
    r.params.emplace_back(ps[k]->value.f32(), ps[k]->value.f32() + n);
    r.m.emplace_back(opt.exp_avg(k).f32(), opt.exp_avg(k).f32() + n);
    r.v.emplace_back(opt.exp_avg_sq(k).f32(), opt.exp_avg_sq(k).f32() + n);
  }
  return r;
}

class ReplicaOptimizerTest : public ::testing::TestWithParam<int> {};

TEST_P(ReplicaOptimizerTest, AddsCpPartialSumsAndAveragesReplicas) {
  const int zero_stage = GetParam();
  const Result ref = reference();
  std::vector<Result> got(kRanks);
  comm::run_ranks(kRanks, [&](comm::Comm& c) {
    MemoryPool pool("rank" + std::to_string(c.rank()));
    auto ps = test::make_param_set(pool);
    parallel::ReplicaOptimizer::Options o;
    o.zero_stage = zero_stage;
    o.replicas = kReplicas;
    for (const test::ParamSpec& s : test::param_set()) o.in_norm.push_back(s.in_norm);
    parallel::CountingComm cc(c);
    parallel::ReplicaOptimizer opt(raw(ps), &cc, o, test::clipping_adamw(), pool);
    EXPECT_EQ(opt.sharded(), zero_stage == 1);
    Result& r = got[size_t(c.rank())];
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      for (size_t k = 0; k < ps.size(); ++k)
        for (int64_t j = 0; j < ps[k]->spec.numel(); ++j) ps[k]->grad.f32()[j] = grad_at(s, c.rank(), k, j);
      const int64_t calls = cc.counts().calls;
      const double norm = std::sqrt(opt.reduce_gradients());
      // Every gradient in one collective (ZeRO 0: an all-reduce of the flat buffer; ZeRO-1: its
      // reduce-scatter, then the norm's all-gather of one double per rank).
      EXPECT_EQ(cc.counts().calls - calls, zero_stage == 0 ? 1 : 2) << "step " << s;
      r.norms.push_back(norm);
      opt.step(norm);
    }
    for (size_t k = 0; k < ps.size(); ++k) {
      const int64_t n = ps[k]->spec.numel();
      r.params.emplace_back(ps[k]->value.f32(), ps[k]->value.f32() + n);
      r.m.emplace_back(size_t(n)), r.v.emplace_back(size_t(n));
      test::gather_moments(opt.moment_part(k), c, n, r.m.back().data(), r.v.back().data());
    }
    EXPECT_EQ(opt.steps_taken(), kSteps);
  });
  for (int q = 0; q < kRanks; ++q) {
    for (int s = 0; s < kSteps; ++s)
      EXPECT_NEAR(got[size_t(q)].norms[size_t(s)], ref.norms[size_t(s)], 1e-6 * ref.norms[size_t(s)])
          << "rank " << q << " step " << s;
    EXPECT_LE(rel_dist(got[size_t(q)].params, ref.params), 1e-6) << "rank " << q;
    EXPECT_LE(rel_dist(got[size_t(q)].m, ref.m), 1e-6) << "rank " << q;
    EXPECT_LE(rel_dist(got[size_t(q)].v, ref.v), 1e-6) << "rank " << q;
  }
}

TEST_P(ReplicaOptimizerTest, LoadedMomentsAreTheOnesGathered) {
  comm::run_ranks(2, [&](comm::Comm& c) {
    MemoryPool pool("rank");
    auto ps = test::make_param_set(pool);
    parallel::ReplicaOptimizer::Options o;
    o.zero_stage = GetParam();
    parallel::ReplicaOptimizer opt(raw(ps), &c, o, test::clipping_adamw(), pool);
    const int64_t n = ps[2]->spec.numel();
    const size_t len = static_cast<size_t>(n);
    std::vector<float> m(len), v(len), m2(len), v2(len);
    for (int64_t j = 0; j < n; ++j) m[size_t(j)] = float(j), v[size_t(j)] = float(2 * j);
    test::load_moments(opt.moment_part(2), m.data(), v.data());
    test::gather_moments(opt.moment_part(2), c, n, m2.data(), v2.data());
    EXPECT_EQ(m, m2);
    EXPECT_EQ(v, v2);
  });
}

INSTANTIATE_TEST_SUITE_P(ZeroStage, ReplicaOptimizerTest, ::testing::Values(0, 1),
                         [](const auto& info) { return "zero" + std::to_string(info.param); });

TEST(ReplicaOptimizer, RefusesBadOptions) {
  comm::run_ranks(4, [&](comm::Comm& c) {
    MemoryPool pool("rank");
    auto ps = test::make_param_set(pool);
    parallel::ReplicaOptimizer::Options o;
    o.replicas = 3;
    try {
      parallel::ReplicaOptimizer opt(raw(ps), &c, o, test::clipping_adamw(), pool);
      ADD_FAILURE() << "replicas = 3 over 4 ranks was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("replicas = 3 must divide the group's 4 ranks"), std::string::npos) << e.what();
    }
    o.replicas = 2;
    o.in_norm = {true};
    EXPECT_THROW(parallel::ReplicaOptimizer(raw(ps), &c, o, test::clipping_adamw(), pool), Error);
    o.in_norm.clear();
    o.zero_stage = 2;
    EXPECT_THROW(parallel::ReplicaOptimizer(raw(ps), &c, o, test::clipping_adamw(), pool), Error);
  });
  MemoryPool pool("alone");
  auto ps = test::make_param_set(pool);
  parallel::ReplicaOptimizer::Options o;
  o.zero_stage = 1;
  EXPECT_THROW(parallel::ReplicaOptimizer(raw(ps), nullptr, o, test::clipping_adamw(), pool), Error);
}

}  // namespace

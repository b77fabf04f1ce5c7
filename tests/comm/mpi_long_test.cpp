// The full mpi matrix: worlds 1 to 8, element counts 0, 1, small primes, ~1M and 64 MB, f32 and
// bf16, every collective (all_reduce alone at 64 MB), oversubscribed on whatever cores there are.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "mpi_util.h"

namespace loom::comm {
namespace {

using ::testing::HasSubstr;
using testing::run_driver;

class MpiWorld : public ::testing::TestWithParam<int> {};

TEST_P(MpiWorld, EveryCollective) {
  const int n = GetParam();
  auto r = run_driver(n, "collectives --counts 0,1,2,3,7,13,97,7919,104729,1000003 --dtypes f32,bf16", 600);
  if (r.skipped) GTEST_SKIP() << r.output;
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("collectives OK on " + std::to_string(n) + " ranks"));
}

TEST_P(MpiWorld, AllReduce64MB) {
  const int n = GetParam();
  // 64 MB of f32 (16 Mi elements), then of bf16 (32 Mi elements).
  for (const char* args : {"--counts 16777216 --dtypes f32", "--counts 33554432 --dtypes bf16"}) {
    auto r = run_driver(n, std::string("collectives --all-reduce-only ") + args, 600);
    if (r.skipped) GTEST_SKIP() << r.output;
    EXPECT_EQ(r.status, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("collectives OK on " + std::to_string(n) + " ranks"));
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, MpiWorld, ::testing::Range(1, 9),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace loom::comm

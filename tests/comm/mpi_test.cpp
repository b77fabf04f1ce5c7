// The mpi backend under mpirun (a representative subset; mpi_long_test.cpp runs the full matrix):
// the shared collective checks for worlds 1, 3 and 8, and the failure paths: a rank that throws,
// a process that is killed and a rank that hangs make the job end non-zero, promptly, with a
// message naming the rank.
#include "mpi_util.h"

#include <vector>

#include "comm/threads.h"
#include "comm_util.h"
#include "timeout_message.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace loom::comm {
namespace {

using ::testing::HasSubstr;
using testing::run_driver;

TEST(MpiComm, CollectivesWorlds1To8Subset) {
  for (int n : {1, 2, 3, 8}) {  // 2: no ring partials, only the last step's window
    auto r = run_driver(n, "collectives --counts 0,1,7919,1500007 --dtypes f32,bf16", 300);
    if (r.skipped) GTEST_SKIP() << r.output;
    EXPECT_EQ(r.status, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("collectives OK on " + std::to_string(n) + " ranks"));
  }
}

TEST(MpiComm, SameBitsAsTheThreadsBackend) {
  for (int n : {3, 5}) {
    for (const char* dt : {"f32", "bf16"}) {
      const int64_t count = 1000003;
      DType dtype = std::string(dt) == "f32" ? DType::f32 : DType::bf16;
      uint64_t threads_hash = 0;
      run_ranks(n, [&](Comm& c) {
        std::vector<char> buf(size_t(count) * dtype_size(dtype));
        testing::fill_input(buf.data(), dtype, count, 77, c.rank());
        c.all_reduce(buf.data(), count, dtype);
        if (c.rank() == 0) threads_hash = testing::hash_bytes(buf.data(), buf.size());
      });
      auto r = run_driver(n, fmt::format("hash --count {} --dtype {} --seed 77", count, dt), 120);
      if (r.skipped) GTEST_SKIP() << r.output;
      EXPECT_EQ(r.status, 0) << r.output;
      EXPECT_THAT(r.output, HasSubstr(fmt::format("all_reduce hash {:016x}", threads_hash))) << n << " ranks, " << dt;
    }
  }
}

TEST(MpiComm, RankThatThrowsEndsTheJob) {
  auto r = run_driver(3, "throw --rank 1 --timeout-ms 30000", 60);
  if (r.skipped) GTEST_SKIP() << r.output;
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("loom: rank 1 of 3 failed: rank 1 raised on purpose"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("should not have passed")));
  EXPECT_LT(r.seconds, 25.0) << "the job must end long before the 30 s timeout";
}

TEST(MpiComm, KilledProcessEndsTheJob) {
  auto r = run_driver(3, "kill --rank 1 --timeout-ms 30000", 60);
  if (r.skipped) GTEST_SKIP() << r.output;
  EXPECT_NE(r.status, 0) << r.output;
  // mpirun's report: "... process rank 1 with PID ... exited on signal 9 (Killed)."
  EXPECT_THAT(r.output, HasSubstr("rank 1"));
  EXPECT_THAT(r.output, HasSubstr("signal 9"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("should not have passed")));
  EXPECT_LT(r.seconds, 25.0);
}

TEST(MpiComm, HungRankTimesOut) {
  // Whichever waiting rank times out first names the rank that never arrived.
  for (int n : {2, 4}) {
    auto r = run_driver(n, "hang --rank 1 --timeout-ms 2000", 60);
    if (r.skipped) GTEST_SKIP() << r.output;
    EXPECT_NE(r.status, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("(mpi): all_reduce (sum, f32 [1000]) timed out after 2 s: ring step"));
    // The neighbour exactly, or the ranks the data passes through when a later ring step waits.
    EXPECT_TRUE(testing_util::names_suspect(r.output, 1)) << r.output;
    EXPECT_GE(r.seconds, 2.0);
    EXPECT_LT(r.seconds, 20.0);
  }
}

}  // namespace
}  // namespace loom::comm

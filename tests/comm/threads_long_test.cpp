// The threads backend's 64 MB bf16 all_reduce for every world 1 to 8 (the default suite runs f32 at
// 64 MB for all worlds and bf16 at 64 MB for world 3).
#include <gtest/gtest.h>

#include "comm/threads.h"
#include "comm_util.h"

namespace loom::comm {
namespace {

class ThreadsWorldLong : public ::testing::TestWithParam<int> {};

TEST_P(ThreadsWorldLong, AllReduce64MBBf16) {
  RunOptions o;
  o.comm.timeout = std::chrono::seconds(120);
  run_ranks(GetParam(), [](Comm& c) {
    testing::check_all_reduce(c, (64 << 20) / 2, DType::bf16, ReduceOp::sum, 41);
    testing::check_all_reduce(c, (64 << 20) / 2, DType::bf16, ReduceOp::max, 42);
  }, o);
}

INSTANTIATE_TEST_SUITE_P(Worlds, ThreadsWorldLong, ::testing::Range(1, 9),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

}  // namespace
}  // namespace loom::comm

// The threads backend: every collective for worlds 1..8, element counts 0, 1, primes and up to
// 64 MB, f32 and bf16, bit-exact against the reduction order of comm.h; failure and timeout paths.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "comm/threads.h"
#include "comm_util.h"
#include "core/error.h"

namespace loom::comm {
namespace {

using namespace std::chrono_literals;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

RunOptions opts(std::chrono::milliseconds timeout = 60s) {
  RunOptions o;
  o.comm.timeout = timeout;
  return o;
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

class ThreadsWorld : public ::testing::TestWithParam<int> {};

TEST_P(ThreadsWorld, AllReduceCountsAndDtypes) {
  const int n = GetParam();
  run_ranks(n, [&](Comm& c) {
    for (DType dt : {DType::f32, DType::bf16}) {
      for (int64_t count : {0, 1, 2, 3, 7, 13, 97, 7919, 104729, 1000003}) {
        testing::check_all_reduce(c, count, dt, ReduceOp::sum, 11);
      }
      testing::check_all_reduce(c, 7919, dt, ReduceOp::max, 12);
    }
  }, opts());
}

TEST_P(ThreadsWorld, AllReduce64MB) {
  const int n = GetParam();
  run_ranks(n, [&](Comm& c) {
    testing::check_all_reduce(c, (64 << 20) / 4, DType::f32, ReduceOp::sum, 21);  // 64 MB of f32
    if (n == 3) testing::check_all_reduce(c, (64 << 20) / 2, DType::bf16, ReduceOp::sum, 22);  // 64 MB of bf16
  }, opts());
}

TEST_P(ThreadsWorld, EveryCollective) {
  const int n = GetParam();
  testing::CheckPlan plan;
  plan.counts = {0, 1, 7919, 100003};
  plan.seed = 31;
  run_ranks(n, [&](Comm& c) { testing::check_collectives(c, plan); }, opts());
}

INSTANTIATE_TEST_SUITE_P(Worlds, ThreadsWorld, ::testing::Range(1, 9),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

TEST(ThreadsComm, SumsInTheDocumentedOrder) {
  // 2^24 + 1 + 1 in f32 depends on the order: chunk 0 folds ranks 1, 2, 0 and chunk 1 folds 2, 0, 1.
  run_ranks(3, [](Comm& c) {
    float big = 16777216.f;
    float x[2];
    x[0] = c.rank() == 1 ? big : 1.f;  // chunk 0 (owner 0): big + 1 (=big) + 1 (=big)
    x[1] = c.rank() == 2 ? big : 1.f;  // chunk 1 (owner 1): big + 1 + 1, same order from rank 2
    c.all_reduce(x, 2, DType::f32);
    if (x[0] != big || x[1] != big) throw Error(fmt::format("got {} {}", x[0], x[1]));
    float y[3] = {1.f, 1.f, 1.f};
    y[2] = c.rank() == 0 ? big : 1.f;  // chunk 2 (owner 2) folds 0, 1, 2: big + 1 + 1 = big
    c.all_reduce(y, 3, DType::f32);
    if (y[2] != big) throw Error(fmt::format("got {}", y[2]));
    y[2] = c.rank() == 2 ? big : 1.f;  // folds 0, 1, 2: 1 + 1 + big = big + 2
    c.all_reduce(y, 3, DType::f32);
    if (y[2] != big + 2) throw Error(fmt::format("got {}", y[2]));
  }, opts());
}

TEST(ThreadsComm, Bf16IsRoundedOnce) {
  // 1 + 3 * 2^-8 in bf16 steps: rounding after each addition would give 1 (each 2^-8 is half an
  // ulp at 1 and ties to even); rounding once gives 1 + 2^-7 + 2^-8 -> 1.0117 rounds to 1.0156.
  run_ranks(4, [](Comm& c) {
    bf16 x = f32_to_bf16(c.rank() == 1 ? 1.f : 1.f / 256);
    c.all_reduce(&x, 1, DType::bf16);
    float got = bf16_to_f32(x);
    float want = bf16_to_f32(f32_to_bf16(1.f + 3.f / 256));
    if (got != want || want == 1.f) throw Error(fmt::format("got {} want {}", got, want));
  }, opts());
}

TEST(ThreadsComm, TensorForms) {
  run_ranks(2, [](Comm& c) {
    Tensor t = Tensor::empty({4, 3}, DType::f32, MemTag::grads);
    for (int i = 0; i < 12; ++i) t.f32()[i] = float(i * (c.rank() + 1));
    c.all_reduce(t);
    for (int i = 0; i < 12; ++i) if (t.f32()[i] != float(3 * i)) throw Error("tensor all_reduce");
    Tensor half = Tensor::empty({2, 3}, DType::f32, MemTag::grads);
    c.reduce_scatter(t, half);
    for (int i = 0; i < 6; ++i) {
      if (half.f32()[i] != float(6 * (i + 6 * c.rank()))) throw Error("tensor reduce_scatter");
    }
    c.all_gather(half, t);
    for (int i = 0; i < 12; ++i) if (t.f32()[i] != float(6 * i)) throw Error("tensor all_gather");
    Tensor wrong = Tensor::empty({5}, DType::f32, MemTag::grads);
    try {
      c.reduce_scatter(t, wrong);
      throw std::logic_error("no error for a wrong output size");
    } catch (const Error& e) {
      if (std::string(e.what()).find("must hold 1/2") == std::string::npos) throw;
    }
  }, opts());
}

TEST(ThreadsComm, BadArgumentsThrowBeforeAnySync) {
  ThreadWorld w(3);
  auto c = w.comm(0);
  std::vector<float> x(10);
  EXPECT_THAT([&] { c->reduce_scatter(x.data(), x.data(), 10, DType::f32); },
              ::testing::ThrowsMessage<Error>(HasSubstr("not divisible by the 3 ranks")));
  EXPECT_THAT([&] { c->all_reduce(x.data(), 10, DType::i32); },
              ::testing::ThrowsMessage<Error>(HasSubstr("f32 and bf16, got i32")));
  EXPECT_THAT([&] { c->broadcast(x.data(), 10, DType::f32, 3); },
              ::testing::ThrowsMessage<Error>(HasSubstr("root 3 is not a rank")));
  EXPECT_THAT([&] { c->send(x.data(), 10, DType::f32, 1, kMaxTag + 1); },
              ::testing::ThrowsMessage<Error>(HasSubstr("tag 32768")));
  EXPECT_THAT([&] { c->send(x.data(), 10, DType::f32, 0); },
              ::testing::ThrowsMessage<Error>(HasSubstr("sends to itself")));
  std::vector<int64_t> counts{1, 2};
  EXPECT_THAT([&] { c->all_gather_v(x.data(), x.data(), counts, DType::f32); },
              ::testing::ThrowsMessage<Error>(HasSubstr("2 counts given for a communicator of 3")));
  EXPECT_THAT([&] { (void)w.comm(0); }, ::testing::ThrowsMessage<Error>(HasSubstr("already taken")));
  EXPECT_THROW(ThreadWorld(0), Error);
}

TEST(ThreadsComm, MismatchedCollectivesThrowOnEveryRank) {
  std::vector<std::string> msgs(2);
  EXPECT_THROW(run_ranks(2, [&](Comm& c) {
    std::vector<float> x(8);
    try {
      c.all_reduce(x.data(), c.rank() == 0 ? 5 : 6, DType::f32);
    } catch (const Error& e) {
      msgs[size_t(c.rank())] = e.what();
      throw;
    }
  }, opts(5s)), Error);
  for (auto& m : msgs) EXPECT_THAT(m, HasSubstr("mismatched collectives"));
}

TEST(ThreadsComm, RankThatThrowsStopsTheOthersPromptly) {
  std::vector<std::string> msgs(4);
  auto t0 = Clock::now();
  try {
    run_ranks(4, [&](Comm& c) {
      std::vector<float> x(1000, 1.f);
      c.all_reduce(x.data(), 1000, DType::f32);  // one good collective first
      if (c.rank() == 2) throw std::logic_error("rank two broke on purpose");
      try {
        c.all_reduce(x.data(), 1000, DType::f32);
      } catch (const Error& e) {
        msgs[size_t(c.rank())] = e.what();
        throw;
      }
    }, opts(20s));
    FAIL() << "no exception";
  } catch (const std::logic_error& e) {
    EXPECT_STREQ(e.what(), "rank two broke on purpose");  // the first failure, with its own type
  }
  EXPECT_LT(seconds_since(t0), 2.0) << "the others must stop long before the 20 s timeout";
  for (int r : {0, 1, 3}) {
    EXPECT_THAT(msgs[size_t(r)], HasSubstr("rank 2 failed: rank two broke on purpose")) << "rank " << r;
  }
}

TEST(ThreadsComm, FailureReachesPointToPointAndSubCommunicators) {
  std::vector<std::string> msgs(4);
  auto t0 = Clock::now();
  EXPECT_THROW(run_ranks(4, [&](Comm& c) {
    auto pair = c.split(c.rank() / 2, 0);  // {0, 1} and {2, 3}
    try {
      if (c.rank() == 0) throw Error("rank zero gives up");
      if (c.rank() == 1) {
        float x;
        pair->recv(&x, 1, DType::f32, 0);  // from rank 0, which never sends
      } else {
        std::vector<float> x(100);
        pair->all_reduce(x.data(), 100, DType::f32);
        pair->barrier();
        c.barrier();  // rank 0 never arrives
      }
    } catch (const Error& e) {
      msgs[size_t(c.rank())] = e.what();
      throw;
    }
  }, opts(20s)), Error);
  EXPECT_LT(seconds_since(t0), 2.0);
  EXPECT_THAT(msgs[1], HasSubstr("recv of f32 [1] from rank 0"));
  for (int r : {1, 2, 3}) EXPECT_THAT(msgs[size_t(r)], HasSubstr("rank 0 failed: rank zero gives up"));
}

TEST(ThreadsComm, TimeoutNamesTheCallAndTheMissingRanks) {
  ThreadWorld w(4, CommOptions{.timeout = 300ms});
  std::vector<std::unique_ptr<Comm>> comms;
  for (int r = 0; r < 4; ++r) comms.push_back(w.comm(r));
  std::vector<std::string> msgs(2);
  auto t0 = Clock::now();
  std::vector<std::thread> ts;
  for (int r = 0; r < 2; ++r) {  // ranks 2 and 3 never call
    ts.emplace_back([&, r] {
      std::vector<float> x(64);
      try {
        comms[size_t(r)]->all_reduce(x.data(), 64, DType::f32);
      } catch (const Error& e) {
        msgs[size_t(r)] = e.what();
      }
    });
  }
  for (auto& t : ts) t.join();
  double dt = seconds_since(t0);
  EXPECT_GE(dt, 0.29);
  EXPECT_LT(dt, 2.0);
  // At least one rank reports the timeout itself; the other may report that one leaving.
  bool named = false;
  for (auto& m : msgs) {
    EXPECT_THAT(m, HasSubstr("all_reduce (sum, f32 [64])"));
    if (m.find("timed out after 0.3 s: rank(s) 2, 3 did not arrive") != std::string::npos) named = true;
  }
  EXPECT_TRUE(named) << msgs[0] << "\n" << msgs[1];
}

TEST(ThreadsComm, SendRecvMismatchAndTimeout) {
  std::vector<std::string> msgs(2);
  EXPECT_THROW(run_ranks(2, [&](Comm& c) {
    std::vector<float> x(12);
    try {
      if (c.rank() == 0) c.send(x.data(), 10, DType::f32, 1, 5);
      else c.recv(x.data(), 12, DType::f32, 0, 5);
    } catch (const Error& e) {
      msgs[size_t(c.rank())] = e.what();
      throw;
    }
  }, opts(5s)), Error);
  for (auto& m : msgs) EXPECT_THAT(m, HasSubstr("rank 0 sent f32 [10] with tag 5 but rank 1 receives f32 [12]"));

  // A receive nobody sends to times out naming the source and tag.
  ThreadWorld w(2, CommOptions{.timeout = 200ms});
  auto c1 = w.comm(1);
  float y;
  EXPECT_THAT([&] { c1->recv(&y, 1, DType::f32, 0, 9); },
              ::testing::ThrowsMessage<Error>(HasSubstr("no message from rank 0 with tag 9 arrived")));
  // And an unmatched send is withdrawn (its buffer is no longer referenced) when it times out.
  auto c0 = w.comm(0);
  EXPECT_THAT([&] { c0->send(&y, 1, DType::f32, 1, 4); },
              ::testing::ThrowsMessage<Error>(HasSubstr("rank 1 did not receive it")));
  // A non-blocking send returns at once; waiting for one nobody receives times out the same way.
  auto pending = c0->isend(&y, 1, DType::f32, 1, 6);
  EXPECT_THAT([&] { pending->wait(); }, ::testing::ThrowsMessage<Error>(HasSubstr("rank 1 did not receive it")));
  // One dropped without a wait is withdrawn: the receiver finds no message.
  c0->isend(&y, 1, DType::f32, 1, 7).reset();
  EXPECT_THAT([&] { c1->recv(&y, 1, DType::f32, 0, 7); },
              ::testing::ThrowsMessage<Error>(HasSubstr("no message from rank 0 with tag 7 arrived")));
  // A mismatched receive fails the sender's wait with the receiver's message.
  std::vector<std::string> imsgs(2);
  EXPECT_THROW(run_ranks(2, [&](Comm& c) {
    std::vector<float> x(12);
    try {
      if (c.rank() == 0) c.isend(x.data(), 10, DType::f32, 1, 5)->wait();
      else c.recv(x.data(), 12, DType::f32, 0, 5);
    } catch (const Error& e) {
      imsgs[size_t(c.rank())] = e.what();
      throw;
    }
  }, opts(5s)), Error);
  for (auto& m : imsgs) EXPECT_THAT(m, HasSubstr("rank 0 sent f32 [10] with tag 5 but rank 1 receives f32 [12]"));
}

TEST(ThreadsComm, ManySmallCollectivesInConcurrentGroups) {
  // Races show up as wrong sums: integers make every order exact, so the check is cheap.
  run_ranks(6, [](Comm& c) {
    auto half = c.split(c.rank() % 2, c.rank());  // 3 ranks each
    for (int it = 0; it < 1500; ++it) {
      Comm& g = it % 3 == 0 ? c : *half;
      int n = g.size();
      int64_t count = 1 + (it * 37) % 300;
      std::vector<float> x(static_cast<size_t>(count));
      for (int64_t i = 0; i < count; ++i) x[size_t(i)] = float(g.rank() + it + i);
      g.all_reduce(x.data(), count, DType::f32);
      for (int64_t i = 0; i < count; ++i) {
        float want = float(n * (n - 1) / 2 + n * (it + i));
        if (x[size_t(i)] != want) throw Error(fmt::format("iteration {} element {}: {} != {}", it, i, x[size_t(i)], want));
      }
      if (it % 5 == 0) {
        int v = g.rank() == it % n ? it : -1;
        g.broadcast(&v, 1, DType::i32, it % n);
        if (v != it) throw Error(fmt::format("broadcast {}", it));
      }
      if (it % 7 == 0) g.barrier();
    }
  }, opts());
}

TEST(ThreadsComm, TwoCommunicatorsOfOneRankFromTwoThreads) {
  // The overlap pattern: a side thread all-reduces gradients on a duplicate of the world while the
  // rank's own thread keeps using the world.
  run_ranks(3, [](Comm& c) {
    auto side = c.split(0, c.rank());
    std::exception_ptr side_error;
    std::thread t([&] {
      try {
        for (int it = 0; it < 200; ++it) testing::check_all_reduce(*side, 4099, DType::bf16, ReduceOp::sum, 100 + it);
      } catch (...) {
        side_error = std::current_exception();
      }
    });
    for (int it = 0; it < 200; ++it) testing::check_all_reduce(c, 1031, DType::f32, ReduceOp::max, 500 + it);
    t.join();
    if (side_error) std::rethrow_exception(side_error);
  }, opts());
}

TEST(ThreadsComm, BarrierOrdersPhases) {
  std::atomic<int> arrived{0};
  run_ranks(5, [&](Comm& c) {
    for (int round = 1; round <= 50; ++round) {
      arrived.fetch_add(1);
      c.barrier();
      if (arrived.load() < 5 * round) throw Error(fmt::format("round {}: passed the barrier early", round));
      c.barrier();
    }
  }, opts());
}

TEST(ThreadsComm, AllocatesNoStagingMemory) {
  int64_t before = default_cpu_pool().peak(MemTag::comm);
  run_ranks(4, [](Comm& c) { testing::check_all_reduce(c, 100000, DType::bf16, ReduceOp::sum, 3); }, opts());
  EXPECT_EQ(default_cpu_pool().peak(MemTag::comm), before);
}

}  // namespace
}  // namespace loom::comm

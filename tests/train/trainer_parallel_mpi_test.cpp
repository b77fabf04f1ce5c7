// Mesh runs of `loom train` under MPI (parallel.comm = "mpi", one process per rank, 4 processes
// with one OpenMP thread each) against the same config with ranks as threads: tp=2 x dp=2,
// cp=2 x tp=2 and pp=2 x dp=2. Both backends reduce in the order comm/comm.h fixes and the
// kernels see the same shapes and thread counts, so every loss, validation loss and gradient norm
// and every tensor of the final checkpoint are bit-identical. Also: --trace gathers every
// process's pipeline timeline to rank 0; a rank that throws ends every process with an error
// naming it; a process count other than pp x dp x cp x tp is refused naming the fields. Each
// mpirun has a deadline (timeout), so a hang fails the test instead of stalling it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <set>

#include "train/mesh_train_util.h"

using namespace loom;
using namespace loom::test;

namespace {

#ifdef LOOM_HAVE_MPI
constexpr bool kHaveMpi = true;
#else
constexpr bool kHaveMpi = false;
#endif

std::string find_mpirun() {
  for (const char* d : {"/usr/bin/mpirun", "/usr/local/bin/mpirun"})
    if (::access(d, X_OK) == 0) return d;
  return "";
}

#define SKIP_WITHOUT_MPI()                                                                           \
  do {                                                                                               \
    if (!fs::exists(kLoom)) GTEST_SKIP() << "the loom executable is not built at " << kLoom;         \
    if (!kHaveMpi) GTEST_SKIP() << "loom was built without MPI";                                     \
    if (find_mpirun().empty()) GTEST_SKIP() << "mpirun not found; install OpenMPI to test the mpi backend"; \
  } while (0)

// `timeout ... mpirun -n n` (the loom command follows); with_fault forwards LOOM_FAULT_INJECT.
std::string mpirun_prefix(int n, bool with_fault = false) {
  return fmt::format("timeout -k 10 240 {} {}--oversubscribe {}-n {}", find_mpirun(),
                     ::geteuid() == 0 ? "--allow-run-as-root " : "", with_fault ? "-x LOOM_FAULT_INJECT " : "", n);
}

class TrainParallelMpi : public MeshTrainFixture {
 protected:
  // The same layout with threads and under mpirun (4 processes).
  static void expect_mpi_equals_threads(const std::string& name, const std::string& layout,
                                        const std::string& mpi_extra = "") {
    CmdRun threads = train(name + "_threads", layout);
    ASSERT_EQ(threads.status, 0) << layout << "\n" << threads.output;
    auto t0 = std::chrono::steady_clock::now();
    CmdRun mpi = train(name + "_mpi", layout + " --parallel.comm mpi" + mpi_extra, mpirun_prefix(4));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_EQ(mpi.status, 0) << layout << "\n" << mpi.output;
    expect_identical_metrics(name + "_threads", name + "_mpi", {"loss", "val_loss", "grad_norm"});
    ASSERT_EQ(metric(name + "_mpi", "loss").size(), 10u);
    expect_identical_checkpoints(name + "_threads", name + "_mpi");
    std::printf("%-40s mpi (4 processes) == threads, bit for bit; mpirun took %.1f s\n", layout.c_str(), s);
  }
};

}  // namespace

TEST_F(TrainParallelMpi, TensorTimesDataParallelEqualsThreads) {
  SKIP_WITHOUT_MPI();
  expect_mpi_equals_threads("tp2_dp2", "--parallel.tp 2 --parallel.dp 2");
}

TEST_F(TrainParallelMpi, ContextTimesTensorParallelEqualsThreads) {
  SKIP_WITHOUT_MPI();
  expect_mpi_equals_threads("cp2_tp2", "--parallel.cp 2 --parallel.tp 2");
}

TEST_F(TrainParallelMpi, PipelineTimesDataParallelEqualsThreadsAndTracesEveryRank) {
  SKIP_WITHOUT_MPI();
  const fs::path trace = root_ / "pp2_dp2_trace.json";
  expect_mpi_equals_threads("pp2_dp2", "--parallel.pp 2 --parallel.schedule 1f1b --parallel.dp 2",
                            " --trace " + trace.string());
  std::ifstream f(trace);
  ASSERT_TRUE(f.good()) << trace << " was not written";
  auto j = nlohmann::json::parse(f);
  std::set<int> named, busy;
  for (const auto& e : j.at("traceEvents")) {
    if (e.at("ph") == "M") named.insert(e.at("tid").get<int>());
    if (e.at("ph") == "X") busy.insert(e.at("tid").get<int>());
  }
  EXPECT_EQ(named, (std::set<int>{0, 1, 2, 3}));
  EXPECT_EQ(busy, (std::set<int>{0, 1, 2, 3})) << "a rank without compute events in the trace";
}

TEST_F(TrainParallelMpi, RankThatThrowsEndsEveryProcessNamingIt) {
  SKIP_WITHOUT_MPI();
  // Rank 2 of tp=2 x dp=2 throws at the start of step 4; the others are then in (or entering)
  // step 4's collectives. With a 60 s communicator timeout, ending well before it shows the job
  // was aborted by the failure.
  auto t0 = std::chrono::steady_clock::now();
  CmdRun r = train("mpi_throw",
                   "--parallel.tp 2 --parallel.dp 2 --parallel.comm mpi --parallel.timeout_s 60 "
                   "--train.checkpoint_every 2",
                   "LOOM_FAULT_INJECT=rank=2,step=4,kind=throw " + mpirun_prefix(4, true));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.status, 124) << "hang: killed by the test's deadline\n" << r.output;
  EXPECT_LT(s, 30.0) << r.output;  // mpirun start-up included
  EXPECT_NE(r.output.find("loom: rank 2 of 4 failed"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("fails on purpose at step 4"), std::string::npos) << r.output;
  // Steps 1-3 completed; the checkpoint of step 2 is the last one.
  const std::string ckpt = train::latest_checkpoint((root_ / "mpi_throw").string());
  ASSERT_FALSE(ckpt.empty()) << r.output;
  EXPECT_EQ(train::read_checkpoint_meta(ckpt).step, 2);
  std::printf("[ mesh mpi throw ] mpirun exit %d after %.2f s (timeout 60 s)\n", r.status, s);
}

TEST_F(TrainParallelMpi, ProcessCountOtherThanTheMeshIsRefused) {
  SKIP_WITHOUT_MPI();
  CmdRun r = train("mpi_count", "--parallel.tp 2 --parallel.dp 2 --parallel.comm mpi", mpirun_prefix(2));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("parallel.pp x parallel.dp x parallel.cp x parallel.tp = 1 x 2 x 1 x 2 = 4 but mpirun "
                          "started 2 processes"),
            std::string::npos)
      << r.output;
}

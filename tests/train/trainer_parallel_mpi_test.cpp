// Mesh runs of `loom train` under MPI (parallel.comm = "mpi", one process per rank, 4 processes
// with one OpenMP thread each) against the same config with ranks as threads: tp=2 x dp=2,
// cp=2 x tp=2 and pp=2 x dp=2, and two layouts on the emulated device. Both backends reduce in the order comm/comm.h fixes and the
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

#define SKIP_WITHOUT_MPI()                                                                           \
  do {                                                                                               \
    LOOM_REQUIRE_LOOM();                                                                             \
    if (!kHaveMpi) GTEST_SKIP() << "loom was built without MPI";                                     \
    if (mpirun_prefix(1).empty()) GTEST_SKIP() << "mpirun not found; install OpenMPI to test the mpi backend"; \
  } while (0)

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

// The emulated device's buffers over processes (its communicators wrap MPI's): tp x dp with
// ZeRO-3's gathered compute copies, and tp x pp with bf16 activations sent between the stages.
TEST_F(TrainParallelMpi, EmulatedDeviceLayoutsEqualThreads) {
  SKIP_WITHOUT_MPI();
  expect_mpi_equals_threads("emu_tp2_dp2_z3", "--train.device emu --parallel.tp 2 --parallel.dp 2 --parallel.zero 3");
  expect_mpi_equals_threads("emu_tp2_pp2", "--train.device emu --parallel.tp 2 --parallel.pp 2");
}

// GaLore over processes: each projector computed by one data-parallel rank and broadcast.
TEST_F(TrainParallelMpi, GaLoreWithDataAndPipelineParallelEqualsThreads) {
  SKIP_WITHOUT_MPI();
  expect_mpi_equals_threads("galore_dp2_pp2", "--parallel.dp 2 --parallel.pp 2 --optim.name galore "
                                              "--optim.galore_rank 8 --optim.galore_update_every 3");
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
    if (e.at("ph") == "X") {
      busy.insert(e.at("tid").get<int>());
      EXPECT_GT(e.at("args").at("cpu_ms").get<double>(), 0) << "a compute without its CPU time: " << e.dump();
    }
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

// The 4D layout dp 2 x pp 2 x tp 2 on the README's corpus (the King James Bible of Debian's
// bible-kjv, tokenised by `loom prepare` with a trained vocabulary), 8 ranks: as threads
// and as 8 processes under mpirun, with bit-identical losses. A GPT smaller than the README's
// keeps it to seconds.
TEST_F(TrainParallelMpi, FourDimensionalRunOnTheReadmeCorpusEqualsUnderThreadsAndMpi) {
  SKIP_WITHOUT_MPI();
  if (::access("/usr/bin/bible", X_OK) != 0)
    GTEST_SKIP() << "the README corpus is not installed (apt-get install bible-kjv; scripts/install_deps.sh does)";
  const fs::path dir = root_ / "kjv";
  fs::create_directories(dir);
  CmdRun text = sh(fmt::format("bible -f 'Genesis 1:1-Revelation 22:21' | sed -E 's/^[0-9]?[A-Za-z]+[0-9]+:[0-9]+ //' "
                               "> {}", (dir / "kjv.txt").string()));
  ASSERT_EQ(text.status, 0) << text.output;
  ASSERT_GT(fs::file_size(dir / "kjv.txt"), 4'000'000u) << "the bible program printed less than the whole text";
  CmdRun prep = sh(fmt::format("{} prepare {} --out {} --vocab-size 1024 --val-fraction 0.05", kLoom,
                               (dir / "kjv.txt").string(), dir.string()));
  ASSERT_EQ(prep.status, 0) << prep.output;
  auto run = [&](const std::string& out, const std::string& extra, const std::string& prefix) {
    return sh(fmt::format(
        "{}{} train --quiet --data.dir {} --train.out_dir {} --model.n_layer 4 --model.n_head 4 --model.n_embd 64 "
        "--model.block_size 64 --data.seq_len 64 --train.batch_size 8 --train.grad_accum 2 --train.steps 8 "
        "--train.eval_every 4 --train.eval_batches 2 --train.sample_tokens 0 --train.threads 1 "
        "--optim.warmup_steps 2 --optim.lr 3e-3 --parallel.dp 2 --parallel.pp 2 --parallel.tp 2 {}",
        prefix.empty() ? "" : prefix + " ", kLoom, dir.string(), (root_ / out).string(), extra));
  };
  CmdRun threads = run("kjv_4d_threads", "", "");
  ASSERT_EQ(threads.status, 0) << threads.output;
  auto t0 = std::chrono::steady_clock::now();
  CmdRun mpi = run("kjv_4d_mpi", "--parallel.comm mpi", mpirun_prefix(8));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(mpi.status, 0) << mpi.output;
  expect_identical_metrics("kjv_4d_threads", "kjv_4d_mpi", {"loss", "val_loss", "grad_norm"});
  auto loss = metric("kjv_4d_mpi", "loss");
  ASSERT_EQ(loss.size(), 8u);
  // And both equal one device within the layout tests' 1e-5 relative.
  CmdRun single = run("kjv_single", "--parallel.dp 1 --parallel.pp 1 --parallel.tp 1", "");
  ASSERT_EQ(single.status, 0) << single.output;
  for (auto [step, v] : metric("kjv_single", "loss"))
    EXPECT_LE(std::abs(loss.at(step) - v), kTol * std::abs(v)) << "step " << step;
  EXPECT_LT(loss.rbegin()->second, loss.begin()->second) << "the 4D run did not learn";
  std::printf("4D dp2 x pp2 x tp2 on the KJV corpus: loss %.4f -> %.4f, threads == mpi (8 processes) bit for bit; "
              "mpirun took %.1f s\n",
              loss.begin()->second, loss.rbegin()->second, s);
}

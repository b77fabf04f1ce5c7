// Stopping a run early (train/stop.h): SIGINT, SIGTERM or SIGUSR1 (from outside, or from
// LOOM_FAULT_INJECT on one rank), or train.time_limit_min, stop every rank after the same step with
// that step's checkpoint; `--resume` then trains on to the losses of the run never stopped. A
// second signal ends the process at once. Signals reach a thread of their own, never one inside a
// oneDNN GEMM (whose JIT kernels corrupt the heap when a handler interrupts them).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "cli_util.h"

extern char** environ;
namespace fs = std::filesystem;
using namespace loom::test;

namespace {

const std::string kModel =
    "--model.n_layer 2 --model.n_head 2 --model.n_embd 32 --data.seq_len 16 --train.batch_size 4 "
    "--train.eval_every 0 --train.sample_tokens 0 --optim.warmup_steps 4 ";

struct StopRun : TrainScratch {
  StopRun() : TrainScratch("loom_stop_cli") {}
  CliRun train(const std::string& out, const std::string& args, const std::string& fault = "") const {
    return TrainScratch::train(out, kModel + args, fault.empty() ? "" : "LOOM_FAULT_INJECT=" + fault);
  }
};

// The checkpoint `latest` names in a run directory ("" when none).
std::string latest(const fs::path& run) {
  std::ifstream f(run / "latest");
  std::string s;
  std::getline(f, s);
  return s;
}

// Every step's loss of a run directory, exactly as written.
std::map<int64_t, double> losses(const fs::path& run) { return read_metrics(run / "metrics.jsonl", "loss"); }

// `loom train ARGS` started in the background with `env` added to the environment, its output in LOG.
pid_t spawn_loom(const std::vector<std::string>& args, const std::string& log, const std::vector<std::string>& env = {}) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::vector<std::string> all{kLoom};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : all) argv.push_back(const_cast<char*>(s.c_str()));
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (char** e = environ; *e; ++e) envp.push_back(*e);
  for (const std::string& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  pid_t pid = -1;
  EXPECT_EQ(posix_spawn(&pid, kLoom.c_str(), &fa, nullptr, argv.data(), envp.data()), 0);
  posix_spawn_file_actions_destroy(&fa);
  return pid;
}

// A loom process spawn_loom started: killed and reaped when it goes out of scope unless waited for
// (a failed assertion must not leave a run of a million steps behind).
struct Child {
  pid_t pid = -1;
  ~Child() {
    if (pid > 0) ::kill(pid, SIGKILL), ::waitpid(pid, nullptr, 0);
  }
};

// Waits up to `seconds` for the child; its wait status, or -1 (then it is killed) when it did not end.
int wait_for(Child& c, int seconds) {
  for (int i = 0; i < seconds * 100; ++i) {
    int st = 0;
    if (::waitpid(c.pid, &st, WNOHANG) == c.pid) {
      c.pid = -1;
      return st;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;  // (~Child kills it)
}

// Waits until the run in `dir` has logged at least `steps` steps (true), for at most a minute.
bool wait_for_steps(const fs::path& dir, int64_t steps) {
  for (int i = 0; i < 6000; ++i) {
    std::ifstream f(dir / "metrics.jsonl");
    int64_t n = 0;
    std::string line;
    while (std::getline(f, line)) n += line.find("\"loss\"") != std::string::npos;
    if (n >= steps) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

}  // namespace

// A signal on one rank of a mesh (dp 2 x tp 2 on threads, ZeRO-1): every rank stops after that
// step, the checkpoint is that step's, the exit status is 128 + the signal's number, and the
// resumed run's losses are the uninterrupted run's to the bit.
TEST(StopCli, ASignalOnOneRankStopsEveryRankAfterTheStepWithItsCheckpoint) {
  LOOM_REQUIRE_LOOM();
  StopRun r;
  const std::string layout = "--parallel.dp 2 --parallel.tp 2 --parallel.zero 1 --train.threads 4 --train.steps 10 ";
  const CliRun whole = r.train("whole", layout);
  ASSERT_EQ(whole.code, 0) << whole.out << whole.err;
  for (const auto& [kind, sig] : std::vector<std::pair<std::string, int>>{{"sigterm", SIGTERM}, {"sigusr1", SIGUSR1}}) {
    SCOPED_TRACE(kind);
    const std::string out = "stopped_" + kind;
    const CliRun stopped = r.train(out, layout, "rank=3,step=4,kind=" + kind);
    EXPECT_EQ(stopped.code, 128 + sig) << stopped.out << stopped.err;
    EXPECT_NE(stopped.err.find("stopped after step 4 of 10, with its checkpoint; go on with --resume"), std::string::npos)
        << stopped.err;
    EXPECT_EQ(latest(r.root / out), "ckpt_00000004");
    EXPECT_EQ(losses(r.root / out).rbegin()->first, 4);
    EXPECT_EQ(stopped.out.find("--- sample"), std::string::npos) << "no end-of-run sample after a stop";
    const CliRun resumed = r.train(out, layout + "--resume");
    ASSERT_EQ(resumed.code, 0) << resumed.out << resumed.err;
    EXPECT_EQ(losses(r.root / out), losses(r.root / "whole"));
  }
}

// train.time_limit_min: the run stops at the first step end past the limit (one step at least,
// however short the limit), writes its checkpoint and exits 0; a checkpoint due at that very step
// is written once.
TEST(StopCli, TheTimeLimitStopsWithACheckpointAndExitsZero) {
  LOOM_REQUIRE_LOOM();
  StopRun r;
  const CliRun whole = r.train("whole", "--train.steps 6 --parallel.dp 2 --train.threads 2");
  ASSERT_EQ(whole.code, 0) << whole.out << whole.err;
  const CliRun stopped =
      r.train("limited", "--train.steps 6 --parallel.dp 2 --train.threads 2 --train.checkpoint_every 1 "
                         "--train.time_limit_min 1e-9");
  EXPECT_EQ(stopped.code, 0) << stopped.out << stopped.err;
  EXPECT_NE(stopped.err.find("train.time_limit_min: stopped after step 1 of 6, with its checkpoint"), std::string::npos)
      << stopped.err;
  EXPECT_NE(stopped.out.find("checkpoints: 1 written"), std::string::npos) << stopped.out;
  EXPECT_EQ(latest(r.root / "limited"), "ckpt_00000001");
  const CliRun resumed = r.train("limited", "--train.steps 6 --parallel.dp 2 --train.threads 2 --resume");
  ASSERT_EQ(resumed.code, 0) << resumed.out << resumed.err;
  EXPECT_EQ(losses(r.root / "limited"), losses(r.root / "whole"));
  // A negative limit is refused by name.
  const CliRun bad = r.train("bad", "--train.steps 6 --train.time_limit_min -1");
  EXPECT_EQ(bad.code, 1);
  EXPECT_NE(bad.err.find("train.time_limit_min: must be non-negative"), std::string::npos) << bad.err;
}

// SIGTERM sent from outside at an arbitrary moment of a run whose steps are mostly oneDNN GEMMs,
// twelve times: every run stops cleanly with the checkpoint of its last logged step (no crash:
// a handler on a computing thread corrupted the heap about one time in six). A second SIGINT ends
// the process at once, by the signal.
TEST(StopCli, SignalsFromOutsideStopCleanlyAndASecondEndsAtOnce) {
  LOOM_REQUIRE_LOOM();
  StopRun r;
  const std::string data = (r.root / "data").string();
  auto args = [&](const std::string& out) {
    return std::vector<std::string>{"train", "--data.dir", data, "--train.out_dir", (r.root / out).string(),
                                    "--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", "64",
                                    "--data.seq_len", "64", "--train.batch_size", "8", "--train.steps", "1000000",
                                    "--train.eval_every", "0", "--train.sample_tokens", "0", "--train.threads", "2",
                                    "--quiet"};
  };
  for (int i = 0; i < 14; ++i) {
    SCOPED_TRACE(i);
    const std::string out = fmt::format("ext_{}", i), log = (r.root / "logs" / (out + ".log")).string();
    // The last two with one thread (OpenBLAS then starts no thread of its own before main, whose
    // handler took the signals while loom's receiving thread blocked them: they went unanswered).
    Child child{spawn_loom(args(out), log,
                           i < 12 ? std::vector<std::string>{}
                                  : std::vector<std::string>{"OPENBLAS_NUM_THREADS=1", "OMP_NUM_THREADS=1"})};
    ASSERT_TRUE(wait_for_steps(r.root / out, 3 + 5 * i)) << slurp(log);
    // (At another moment of a step each time: a step takes a few milliseconds here.)
    std::this_thread::sleep_for(std::chrono::microseconds(1000 + 2371 * i % 9000));
    ASSERT_EQ(::kill(child.pid, SIGTERM), 0);
    const int st = wait_for(child, 120);
    ASSERT_NE(st, -1) << "did not stop: " << slurp(log);
    ASSERT_TRUE(WIFEXITED(st)) << "ended by signal " << WTERMSIG(st) << ": " << slurp(log);
    EXPECT_EQ(WEXITSTATUS(st), 128 + SIGTERM) << slurp(log);
    const int64_t last = losses(r.root / out).rbegin()->first;
    EXPECT_EQ(latest(r.root / out), fmt::format("ckpt_{:08d}", last)) << slurp(log);
    EXPECT_NE(slurp(log).find(fmt::format("SIGTERM: stopped after step {} of 1000000, with its checkpoint", last)),
              std::string::npos)
        << slurp(log);
  }
  const std::string log = (r.root / "logs" / "twice.log").string();
  Child child{spawn_loom(args("twice"), log)};
  ASSERT_TRUE(wait_for_steps(r.root / "twice", 3)) << slurp(log);
  ASSERT_EQ(::kill(child.pid, SIGINT), 0);
  // (Once the first is received: two sent at once may arrive as one, as signals of a kind do.)
  for (int i = 0; i < 6000 && slurp(log).find("SIGINT: the run stops") == std::string::npos; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(::kill(child.pid, SIGINT), 0);
  const int st = wait_for(child, 120);
  ASSERT_NE(st, -1) << slurp(log);
  ASSERT_TRUE(WIFSIGNALED(st)) << "exit " << WEXITSTATUS(st) << ": " << slurp(log);
  EXPECT_EQ(WTERMSIG(st), SIGINT);
}

// Under mpirun, a signal on one process stops both after the same step (mpirun forwards SIGUSR1 to
// its processes; here one process receives it alone): the checkpoint is complete and resumes.
TEST(StopCli, UnderMpiEveryProcessStopsAfterTheSameStep) {
  LOOM_REQUIRE_LOOM();
  std::string mpirun = mpirun_prefix(2, /*with_fault=*/true);
  if (mpirun.empty()) GTEST_SKIP() << "mpirun not on PATH, or loom built without MPI";
  // One OpenBLAS thread, as a process bound to one core has (mpirun's default binding): no thread
  // of a library's takes the signal for loom.
  mpirun.replace(mpirun.rfind(" -n "), 4, " -x OPENBLAS_NUM_THREADS=1 -n ");
  StopRun r;
  auto run = [&](const std::string& out, const std::string& extra, const std::string& fault) {
    const std::string cmd = fmt::format(
        "{}{} '{}' train --data.dir '{}' --train.out_dir '{}' {} --parallel.dp 2 --parallel.comm mpi "
        "--train.threads 1 --train.steps 8 {}",
        fault.empty() ? "" : "LOOM_FAULT_INJECT=" + fault + " ", mpirun, kLoom, (r.root / "data").string(),
        (r.root / out).string(), kModel, extra);
    return sh(cmd);
  };
  const CmdRun stopped = run("mpi", "", "rank=1,step=3,kind=sigusr1");
  EXPECT_EQ(stopped.status, 128 + SIGUSR1) << stopped.output;
  EXPECT_NE(stopped.output.find("SIGUSR1: stopped after step 3 of 8, with its checkpoint"), std::string::npos)
      << stopped.output;
  EXPECT_EQ(latest(r.root / "mpi"), "ckpt_00000003");
  const CmdRun resumed = run("mpi", "--resume", "");
  ASSERT_EQ(resumed.status, 0) << resumed.output;
  const CmdRun whole = run("whole", "", "");
  ASSERT_EQ(whole.status, 0) << whole.output;
  EXPECT_EQ(losses(r.root / "mpi"), losses(r.root / "whole"));
}

// `loom train` data-parallel failure handling, on the real executable and both communicator
// backends: a rank that throws (LOOM_FAULT_INJECT) or a rank process that this test SIGKILLs makes
// the whole job exit non-zero, promptly (well within parallel.timeout_s), with output naming the
// failed rank; never a hang (each run has a deadline after which the test kills it and fails).
// The last complete checkpoint written before the failure still loads.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "comm/timeout_message.h"
#include "data/shard.h"
#include "train/checkpoint.h"

namespace fs = std::filesystem;
using namespace loom;
using Clock = std::chrono::steady_clock;

namespace {

using test::kLoom;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// The processes /proc lists: pid -> parent pid.
std::vector<std::pair<pid_t, pid_t>> process_table() {
  std::vector<std::pair<pid_t, pid_t>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string n = e.path().filename().string();
    if (n.empty() || n.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string stat = read_text(e.path() / "stat");
    size_t close = stat.rfind(')');  // the command name may hold spaces and parentheses
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    if (rest >> state >> ppid) out.push_back({pid_t(std::stol(n)), ppid});
  }
  return out;
}

// Every live descendant of `root`.
std::vector<pid_t> descendants(pid_t root) {
  auto table = process_table();
  std::vector<pid_t> found{root}, out;
  for (size_t i = 0; i < found.size(); ++i)
    for (auto [pid, ppid] : table)
      if (ppid == found[i]) {
        found.push_back(pid);
        out.push_back(pid);
      }
  return out;
}

bool alive(pid_t pid) {
  std::string stat = read_text(fs::path("/proc") / std::to_string(pid) / "stat");
  size_t close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return false;
  return stat[close + 2] != 'Z';  // a zombie has exited
}

using testing_util::names_suspect;

// MPI rank -> pid of the loom processes that `mpirun_pid` started (OMPI_COMM_WORLD_RANK in each
// process's environment).
std::vector<std::pair<int, pid_t>> mpi_rank_pids(pid_t mpirun_pid) {
  std::vector<std::pair<int, pid_t>> out;
  std::error_code ec;
  const fs::path loom = fs::weakly_canonical(kLoom, ec);
  for (pid_t pid : descendants(mpirun_pid)) {
    fs::path proc = fs::path("/proc") / std::to_string(pid);
    if (fs::read_symlink(proc / "exe", ec) != loom || ec) continue;
    std::string env = read_text(proc / "environ");
    const std::string key = "OMPI_COMM_WORLD_RANK=";
    for (size_t at = 0; at < env.size();) {
      size_t end = env.find('\0', at);
      if (end == std::string::npos) end = env.size();
      if (env.compare(at, key.size(), key) == 0) out.push_back({std::stoi(env.substr(at + key.size(), end - at)), pid});
      at = end + 1;
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string mpirun() {
  for (const char* d : {"/usr/bin/mpirun", "/usr/local/bin/mpirun"})
    if (::access(d, X_OK) == 0) return d;
  return "";
}

// A command running in its own process group, stdout and stderr into a log file.
class Job {
 public:
  Job(const std::string& cmd, const fs::path& log, const std::string& fault) : log_(log) {
    start_ = Clock::now();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
        ::close(fd);
      }
      if (fault.empty()) ::unsetenv("LOOM_FAULT_INJECT");
      else ::setenv("LOOM_FAULT_INJECT", fault.c_str(), 1);
      ::execl("/bin/sh", "sh", "-c", ("exec " + cmd).c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    if (pid_ > 0) ::setpgid(pid_, pid_);
  }
  ~Job() {
    if (!done_) kill_all();
  }
  Job(const Job&) = delete;
  Job& operator=(const Job&) = delete;

  pid_t pid() const { return pid_; }
  bool done() const { return done_; }
  double seconds() const { return seconds_; }  // from start to exit
  std::string output() const { return read_text(log_); }
  // The exit code, or 128 + signal.
  int status() const { return WIFEXITED(status_) ? WEXITSTATUS(status_) : 128 + WTERMSIG(status_); }

  // Whether the job is still running (reaps it when it has exited).
  bool running() {
    if (done_) return false;
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) == pid_) {
      done_ = true;
      status_ = st;
      seconds_ = since(start_);
    }
    return !done_;
  }

  // Polls until the job exits (true) or `deadline` passes (false: the job and everything it
  // started is killed).
  bool wait_until(Clock::time_point deadline) {
    while (running()) {
      if (Clock::now() >= deadline) {
        kill_all();
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return true;
  }

 private:
  void kill_all() {
    if (pid_ <= 0) return;
    for (pid_t p : descendants(pid_)) ::kill(p, SIGKILL);
    ::kill(-pid_, SIGKILL);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    done_ = true;
    status_ = st;
    seconds_ = since(start_);
  }
  fs::path log_;
  pid_t pid_ = -1;
  bool done_ = false;
  int status_ = 0;
  double seconds_ = 0;
  Clock::time_point start_;
};

class TrainerFailure : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / fmt::format("loom_trainer_failure_{}", ::getpid());
    test::write_pattern_corpus(root_ / "data");
  }
  void TearDown() override { if (!std::getenv("LOOM_KEEP_TMP")) fs::remove_all(root_); }

  // A tiny model, a checkpoint every 2 steps, the given communicator timeout.
  std::string args(const std::string& out, int dp, int64_t steps, double timeout_s, const std::string& extra) const {
    return fmt::format(
        "train --quiet --data.dir {} --train.out_dir {} --model.n_layer 2 --model.n_head 2 --model.n_embd 32 "
        "--data.seq_len 16 --train.batch_size 6 --train.steps {} --train.eval_every 0 --train.sample_tokens 0 "
        "--train.checkpoint_every 2 --train.keep_checkpoints 2 --optim.warmup_steps 2 --parallel.dp {} "
        "--parallel.zero 1 --parallel.timeout_s {} {}",
        (root_ / "data").string(), (root_ / out).string(), steps, dp, timeout_s, extra);
  }
  // mpirun -n n loom <a>; with_fault forwards LOOM_FAULT_INJECT to every rank.
  std::string mpi_cmd(int n, const std::string& a, bool with_fault) const {
    std::string root = ::geteuid() == 0 ? "--allow-run-as-root " : "";
    return fmt::format("{} {}--oversubscribe {}-n {} {} {} --parallel.comm mpi --train.threads 1", mpirun(), root,
                       with_fault ? "-x LOOM_FAULT_INJECT " : "", n, kLoom, a);
  }
  fs::path log(const std::string& name) const { return root_ / (name + ".log"); }

  // The checkpoint `latest` names in out_dir, checked to be complete and readable.
  std::optional<train::CheckpointMeta> last_checkpoint(const std::string& out) const {
    std::string ckpt = train::latest_checkpoint((root_ / out).string());
    if (ckpt.empty()) return std::nullopt;
    return train::read_checkpoint_meta(ckpt);
  }
  fs::path root_;
};

#define SKIP_WITHOUT_MPI()                                                                      \
  do {                                                                                          \
    if (!kHaveMpi) GTEST_SKIP() << "loom was built without MPI";                                \
    if (mpirun().empty()) GTEST_SKIP() << "mpirun not found; install OpenMPI to test the mpi backend"; \
  } while (0)

#ifdef LOOM_HAVE_MPI
constexpr bool kHaveMpi = true;
#else
constexpr bool kHaveMpi = false;
#endif

TEST_F(TrainerFailure, ThreadsRankThatThrowsEndsTheProcessNamingIt) {
  // Rank 1 of 3 throws at the start of step 4; the others are then in (or entering) step 4's
  // collectives. The timeout is 60 s: ending in much less shows they were released by the
  // failure, not by the timeout.
  const double timeout_s = 60;
  Job job(kLoom + " " + args("threads", 3, 8, timeout_s, "--train.threads 3"), log("threads"),
          "rank=1,step=4,kind=throw");
  ASSERT_TRUE(job.wait_until(Clock::now() + std::chrono::seconds(90))) << "hang: killed after 90 s\n" << job.output();
  std::string out = job.output();
  EXPECT_NE(job.status(), 0) << out;
  EXPECT_LT(job.seconds(), 15.0) << out;
  EXPECT_NE(out.find("rank 1 of 3 failed"), std::string::npos) << out;
  EXPECT_NE(out.find("fails on purpose at step 4"), std::string::npos) << out;
  // Steps 1-3 completed; the checkpoint of step 2 was complete before rank 1 reached step 4.
  auto meta = last_checkpoint("threads");
  ASSERT_TRUE(meta.has_value()) << "no checkpoint survived\n" << out;
  EXPECT_EQ(meta->step, 2);
  std::printf("[ threads throw ] exit %d after %.2f s (timeout %g s)\n", job.status(), job.seconds(), timeout_s);
}

// Rank 1 of 2 sleeps for ever at step 3, outside any collective, where no failure of a peer can
// reach it. Rank 0 times out in its collective and fails; the process then waits for rank 1 as
// long as a collective would, and ends naming both (a thread cannot be stopped from outside).
TEST_F(TrainerFailure, ThreadsStalledRankEndsTheProcessAfterTheTimeout) {
  const double timeout_s = 3;
  Job job(kLoom + " " + args("threads_stall", 2, 8, timeout_s, "--train.threads 2"), log("threads_stall"),
          "rank=1,step=3,kind=stall");
  ASSERT_TRUE(job.wait_until(Clock::now() + std::chrono::seconds(90))) << "hang: killed after 90 s\n" << job.output();
  const std::string out = job.output();
  EXPECT_EQ(job.status(), 1) << out;
  EXPECT_NE(out.find("loom: error: "), std::string::npos) << out;
  EXPECT_NE(out.find("rank 0 of 2 failed: "), std::string::npos) << out;
  EXPECT_NE(out.find("timed out"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 1 did not stop within 3 s of it"), std::string::npos) << out;
  auto meta = last_checkpoint("threads_stall");
  ASSERT_TRUE(meta.has_value()) << "no checkpoint survived\n" << out;
  EXPECT_EQ(meta->step, 2);
  std::printf("[ threads stall ] exit %d after %.2f s (timeout %g s)\n", job.status(), job.seconds(), timeout_s);
}

// A failure every rank reports alike (the checkpoint that rank 1 refused to write, its weights
// being NaN) is the job's failure of the rank that found it, whichever rank reports it first (the
// headline named rank 0, the writing rank, while the detail was rank 1's). (The NaN is in a row of
// the untied input embedding that no batch looks up, so the steps stay finite: inside a streak of
// non-finite steps no checkpoint is written.)
TEST_F(TrainerFailure, ACollectiveFailureIsNamedAsTheRankThatFoundIt) {
  for (int round = 0; round < 3; ++round) {
    const std::string out = fmt::format("threads_nan_{}", round);
    Job job(kLoom + " " + args(out, 1, 6, 30, "--parallel.tp 2 --train.threads 2 --model.tied_embeddings false"),
            log(out), "rank=1,step=2,kind=nan_weight");
    ASSERT_TRUE(job.wait_until(Clock::now() + std::chrono::seconds(90))) << "hang: killed after 90 s\n" << job.output();
    const std::string text = job.output();
    EXPECT_EQ(job.status(), 1) << text;
    EXPECT_NE(text.find("rank 1 of 2 failed: the checkpoint of step 2 could not be written"), std::string::npos)
        << text;
    EXPECT_NE(text.find("rank 1: not writing the checkpoint of step 2: parameter"), std::string::npos) << text;
  }
}

TEST_F(TrainerFailure, BadFaultSpecIsAClearError) {
  Job job(kLoom + " " + args("bad", 2, 2, 10, "--train.threads 2"), log("bad"), "rank=2,step=1,kind=throw");
  ASSERT_TRUE(job.wait_until(Clock::now() + std::chrono::seconds(60))) << job.output();
  EXPECT_NE(job.status(), 0);
  EXPECT_NE(job.output().find("LOOM_FAULT_INJECT"), std::string::npos) << job.output();
  EXPECT_NE(job.output().find("rank 2 is not one of the 2"), std::string::npos) << job.output();
}

// Processes of one job started with different command lines. One that fails before the job's
// communicator exists (its parallel.dp does not match mpirun's count) aborts the job naming itself:
// it unwound into MPI_Finalize while the others waited in MPI_Comm_dup, silently, for ever. Ranks
// given --resume and --overwrite are refused before either acts (the checkpoints were deleted
// before the ranks compared anything).
TEST_F(TrainerFailure, MpiRanksStartedDifferentlyFailNamingTheRankAndChangeNothing) {
  SKIP_WITHOUT_MPI();
  const std::string root = ::geteuid() == 0 ? "--allow-run-as-root " : "";
  auto two = [&](const std::string& a0, const std::string& a1) {
    return fmt::format("{} {}--oversubscribe -n 1 {} {} --parallel.comm mpi --train.threads 1 : -n 1 {} {} "
                       "--parallel.comm mpi --train.threads 1",
                       mpirun(), root, kLoom, a0, kLoom, a1);
  };
  Job dp(two(args("mpi_dp", 2, 3, 10, ""), args("mpi_dp", 1, 3, 10, "")), log("mpi_dp"), "");
  ASSERT_TRUE(dp.wait_until(Clock::now() + std::chrono::seconds(60))) << "hang: killed after 60 s\n" << dp.output();
  EXPECT_NE(dp.status(), 0) << dp.output();
  EXPECT_NE(dp.output().find("loom: rank 1 of 2 failed: command line: parallel.dp is 1 but mpirun started 2 processes"),
            std::string::npos)
      << dp.output();

  Job first(mpi_cmd(2, args("mpi_flags", 2, 2, 10, ""), false), log("mpi_flags"), "");
  ASSERT_TRUE(first.wait_until(Clock::now() + std::chrono::seconds(60))) << first.output();
  ASSERT_EQ(first.status(), 0) << first.output();
  Job mixed(two(args("mpi_flags", 2, 4, 10, "--resume"), args("mpi_flags", 2, 4, 10, "--overwrite")),
            log("mpi_flags2"), "");
  ASSERT_TRUE(mixed.wait_until(Clock::now() + std::chrono::seconds(60))) << "hang\n" << mixed.output();
  EXPECT_NE(mixed.status(), 0) << mixed.output();
  EXPECT_NE(mixed.output().find("ranks disagree before the first step: --resume on rank 1 differs"), std::string::npos)
      << mixed.output();
  auto meta = last_checkpoint("mpi_flags");
  ASSERT_TRUE(meta.has_value()) << "the checkpoint was deleted\n" << mixed.output();
  EXPECT_EQ(meta->step, 2);
  EXPECT_TRUE(fs::exists(root_ / "mpi_flags" / "metrics.jsonl"));
}

TEST_F(TrainerFailure, MpiRankThatThrowsEndsEveryProcessNamingIt) {
  SKIP_WITHOUT_MPI();
  const double timeout_s = 60;
  Job job(mpi_cmd(3, args("mpi_throw", 3, 8, timeout_s, ""), true), log("mpi_throw"), "rank=1,step=4,kind=throw");
  ASSERT_TRUE(job.wait_until(Clock::now() + std::chrono::seconds(90))) << "hang: killed after 90 s\n" << job.output();
  std::string out = job.output();
  EXPECT_NE(job.status(), 0) << out;
  EXPECT_LT(job.seconds(), 20.0) << out;  // mpirun start-up included
  EXPECT_NE(out.find("loom: rank 1 of 3 failed"), std::string::npos) << out;
  EXPECT_NE(out.find("fails on purpose at step 4"), std::string::npos) << out;
  // Rank 0 wrote the step-2 checkpoint before it could enter step 3's collectives.
  auto meta = last_checkpoint("mpi_throw");
  ASSERT_TRUE(meta.has_value()) << "no checkpoint survived\n" << out;
  EXPECT_EQ(meta->step, 2);
  std::printf("[ mpi throw ] mpirun exit %d after %.2f s (timeout %g s)\n", job.status(), job.seconds(), timeout_s);
}

TEST_F(TrainerFailure, MpiRankKilledEndsTheJobWithinTheTimeout) {
  SKIP_WITHOUT_MPI();
  // A run far longer than the test; rank 1's process is SIGKILLed once a checkpoint exists.
  const double timeout_s = 10;
  const std::string out_dir = "mpi_kill";
  Job job(mpi_cmd(3, args(out_dir, 3, 1'000'000, timeout_s, ""), false), log(out_dir), "");
  const auto start_deadline = Clock::now() + std::chrono::seconds(60);
  while (!fs::exists(root_ / out_dir / "latest")) {
    ASSERT_TRUE(job.running()) << "the job ended before a checkpoint\n" << job.output();
    ASSERT_LT(Clock::now(), start_deadline) << "no checkpoint within 60 s\n" << job.output();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto ranks = mpi_rank_pids(job.pid());
  ASSERT_EQ(ranks.size(), 3u) << "expected 3 loom processes under mpirun\n" << job.output();
  ASSERT_EQ(ranks[1].first, 1);
  const pid_t victim = ranks[1].second;
  ASSERT_EQ(::kill(victim, SIGKILL), 0);
  auto t_kill = Clock::now();
  // Deadline: the communicator timeout plus slack for the abort; the test fails past it.
  bool ended = job.wait_until(t_kill + std::chrono::milliseconds(int64_t((timeout_s + 20) * 1000)));
  double after_kill = since(t_kill);
  std::string out = job.output();
  ASSERT_TRUE(ended) << "hang: the job was still running " << after_kill << " s after rank 1 was killed\n" << out;
  EXPECT_NE(job.status(), 0) << out;
  EXPECT_LT(after_kill, timeout_s) << out;
  // mpirun's report: "process rank 1 with PID ... exited on signal 9 (Killed)".
  EXPECT_NE(out.find("process rank 1 "), std::string::npos) << out;
  // mpirun may return while its daemons are still ending the other ranks: each must be gone
  // within a few seconds (no rank outlives the job).
  for (auto [rank, pid] : ranks) {
    const auto gone_by = Clock::now() + std::chrono::seconds(5);
    while (alive(pid) && Clock::now() < gone_by) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_FALSE(alive(pid)) << "rank " << rank << " (pid " << pid << ") still runs 5 s after the job ended";
  }

  // Nothing already written is lost: `latest` names a complete checkpoint, and it resumes.
  auto meta = last_checkpoint(out_dir);
  ASSERT_TRUE(meta.has_value()) << out;
  EXPECT_GE(meta->step, 2);
  EXPECT_EQ(meta->step % 2, 0);
  Job resume(kLoom + " " + args(out_dir, 2, meta->step + 1, 30, "--train.threads 2 --resume --optim.decay_steps 1000000"), log("resume"), "");
  ASSERT_TRUE(resume.wait_until(Clock::now() + std::chrono::seconds(60))) << resume.output();
  EXPECT_EQ(resume.status(), 0) << resume.output();
  auto after = last_checkpoint(out_dir);
  ASSERT_TRUE(after.has_value());
  EXPECT_EQ(after->step, meta->step + 1);
  std::printf("[ mpi kill ] killed rank 1 (pid %d) at checkpoint step %lld; mpirun exit %d %.2f s later "
              "(timeout %g s); resumed from step %lld\n",
              int(victim), static_cast<long long>(meta->step), job.status(), after_kill, timeout_s,
              static_cast<long long>(meta->step));
}

TEST_F(TrainerFailure, MpiStalledRankEndsTheJobAtTheTimeout) {
  SKIP_WITHOUT_MPI();
  // Rank 1 is stopped (SIGSTOP), not killed: only the communicator timeout can notice. The
  // others wait parallel.timeout_s in their next collective, then abort the job.
  const double timeout_s = 4;
  const std::string out_dir = "mpi_stall";
  Job job(mpi_cmd(3, args(out_dir, 3, 1'000'000, timeout_s, "--train.checkpoint_every 0"), false), log(out_dir), "");
  const auto start_deadline = Clock::now() + std::chrono::seconds(60);
  // The last moment step 3 was not yet logged: no rank can have entered step 4's collectives, so
  // no wait can have started, before it. The timeout cannot fire earlier than timeout_s after it,
  // however long this process is descheduled between its polls and the SIGSTOP.
  auto t_before = Clock::now();
  for (;;) {
    auto t = Clock::now();
    if (read_text(root_ / out_dir / "metrics.jsonl").find("\"step\":3,") != std::string::npos) break;
    t_before = t;
    ASSERT_TRUE(job.running()) << "the job ended early\n" << job.output();
    ASSERT_LT(Clock::now(), start_deadline) << "no third step within 60 s\n" << job.output();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto ranks = mpi_rank_pids(job.pid());
  ASSERT_EQ(ranks.size(), 3u) << job.output();
  ASSERT_EQ(::kill(ranks[1].second, SIGSTOP), 0);
  auto t_stop = Clock::now();
  bool ended = job.wait_until(t_stop + std::chrono::milliseconds(int64_t((timeout_s + 30) * 1000)));
  double after = since(t_stop);
  double since_step3 = since(t_before);
  std::string out = job.output();
  ::kill(ranks[1].second, SIGKILL);  // in case mpirun left it stopped
  ASSERT_TRUE(ended) << "hang: the job was still running " << after << " s after rank 1 stalled\n" << out;
  EXPECT_NE(job.status(), 0) << out;
  EXPECT_GE(since_step3, timeout_s) << "ended before the timeout could have fired\n" << out;
  EXPECT_LT(after, timeout_s + 20) << out;
  EXPECT_NE(out.find(fmt::format("timed out after {:g} s", timeout_s)), std::string::npos) << out;
  // Whichever waiting rank times out first names the stalled one among what it can know: its
  // neighbour exactly, or the ranks its data passes through round the ring; or a neighbour that
  // has not arrived because it still waits in an earlier collective for the stalled rank (a rank
  // that finished that collective can be one ahead), which the message then lists among the
  // ranks that timed out, and the joint diagnosis below names the stalled one.
  const std::regex ahead(R"(no data from rank ([0-9]+); rank \1 has not arrived or is stalled; )"
                         R"(ranks ([0-9, ]+) timed out waiting)");
  std::smatch m;
  const bool waited_elsewhere = std::regex_search(out, m, ahead) &&
                                (", " + m[2].str() + ",").find(", " + m[1].str() + ",") != std::string::npos;
  EXPECT_TRUE(names_suspect(out, 1) || waited_elsewhere) << out;
  // One message for the job (the ranks that timed out agree on who speaks), naming the rank that
  // did not time out, and no crash inside MPI from two aborts at once.
  size_t messages = 0;
  for (size_t at = out.find("timed out after"); at != std::string::npos; at = out.find("timed out after", at + 1))
    ++messages;
  EXPECT_EQ(messages, 1u) << out;
  EXPECT_NE(out.find("and rank 1 did not: rank 1 is stalled or dead"), std::string::npos) << out;
  EXPECT_EQ(out.find("corruption"), std::string::npos) << out;
  std::printf("[ mpi stall ] stopped rank 1; mpirun exit %d %.2f s later (timeout %g s)\n", job.status(), after,
              timeout_s);
}

}  // namespace

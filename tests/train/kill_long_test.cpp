// The reliability suite (label long): SIGKILL at random moments, at least 20 times on the threads
// backend and 20 times under mpirun (a random rank's process), kills inside checkpoint writes and
// inside resumes included. Every time the job ends (under MPI within the timeout, naming the rank
// that died), `latest` names a complete checkpoint that verifies, and the run resumed to the end
// has every loss of the uninterrupted run, exactly.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <thread>
#include <tuple>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "noisy_corpus.h"
#include "train/checkpoint.h"

extern char** environ;
namespace fs = std::filesystem;
using namespace loom;
using namespace loom::test;

namespace {

std::vector<std::string> flags(const std::string& data, const std::string& out) {
  return {"train", "--quiet", "--data.dir", data, "--train.out_dir", out, "--model.n_layer", "2", "--model.n_head", "2",
          "--model.n_embd", "32", "--data.seq_len", "16", "--train.batch_size", "4", "--train.steps", "16",
          "--train.checkpoint_every", "1", "--train.eval_every", "8", "--train.eval_batches", "2",
          "--train.sample_tokens", "0", "--train.threads", "1", "--optim.warmup_steps", "4", "--train.keep_checkpoints",
          "2", "--resume", "--parallel.timeout_s", "20"};
}

pid_t spawn(const std::vector<std::string>& args, const std::string& log) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::vector<char*> argv;
  for (auto& s : args) argv.push_back(const_cast<char*>(s.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  EXPECT_EQ(posix_spawnp(&pid, argv[0], &fa, nullptr, argv.data(), environ), 0) << argv[0];
  posix_spawn_file_actions_destroy(&fa);
  return pid;
}

// `mpirun -n ranks loom <train flags> <layout> --parallel.comm mpi`, passing on the environment
// the tests set (the checkpoint pause, and shared memory without single-copy transfers).
pid_t spawn_mpi(int ranks, const std::vector<std::string>& train, const std::vector<std::string>& layout,
                const std::string& log) {
  std::vector<std::string> a{"mpirun"};
  if (::geteuid() == 0) a.push_back("--allow-run-as-root");
  for (const std::string f : {"--oversubscribe", "--bind-to", "none", "-x", "OMPI_MCA_btl_vader_single_copy_mechanism",
                              "-x", "LOOM_CHECKPOINT_PAUSE_MS", "-n"})
    a.push_back(f);
  a.push_back(std::to_string(ranks));
  a.push_back(kLoom);
  a.insert(a.end(), train.begin(), train.end());
  a.insert(a.end(), layout.begin(), layout.end());
  for (const char* f : {"--parallel.comm", "mpi"}) a.push_back(f);
  return spawn(a, log);
}

int wait_exit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Losses by step (validation losses under -step), as printed (exact comparison).
std::map<int64_t, std::string> losses(const std::string& out) {
  std::map<int64_t, std::string> m;
  std::ifstream f(out + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.contains("step")) continue;
    if (j.contains("loss")) m[j["step"].get<int64_t>()] = j["loss"].dump();
    if (j.contains("val_loss")) m[-j["step"].get<int64_t>()] = j["val_loss"].dump();
  }
  return m;
}

int64_t metric_lines(const std::string& out) {
  std::ifstream f(out + "/metrics.jsonl");
  int64_t n = 0;
  for (std::string line; std::getline(f, line);) ++n;
  return n;
}

// The rank processes mpirun started: (rank, pid) of its children with OMPI_COMM_WORLD_RANK.
std::vector<std::pair<int, pid_t>> rank_pids(pid_t mpirun) {
  std::vector<std::pair<int, pid_t>> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.empty() || !std::isdigit(static_cast<unsigned char>(name[0]))) continue;
    std::ifstream st(e.path() / "stat");
    std::string stat;
    std::getline(st, stat);
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state = 0;
    int ppid = 0;
    rest >> state >> ppid;
    if (ppid != mpirun) continue;
    const std::string env = slurp(e.path() / "environ");
    const size_t at = env.find("OMPI_COMM_WORLD_RANK=");
    if (at == std::string::npos) continue;
    out.push_back({std::atoi(env.c_str() + at + 21), pid_t(std::stoi(name))});
  }
  return out;
}

struct Corpus {
  fs::path root;
  std::string data;
  explicit Corpus(const std::string& name) : root(fs::temp_directory_path() / fmt::format("loom_kill_{}_{}", name, ::getpid())) {
    fs::remove_all(root);
    write_noisy_pattern_corpus(root / "data");
    data = (root / "data").string();
  }
  ~Corpus() { fs::remove_all(root); }
};

// Kills at random moments over a whole run's length until `want` kills (one inside a checkpoint
// write and one inside a resume at least), each episode resumed to the end and compared. An
// episode takes at most kMaxEpisodeKills kills and then runs to its end unharmed: where a resume's
// start (verifying and reading the checkpoint) takes most of a whole run's time, most kills land
// before it steps at all, and without the cap an episode could end its attempts short of the end.
constexpr int kMaxEpisodeKills = 30;
// `launch` starts the job for out_dir (logging to log) and returns the pid to wait for; `victim`
// returns the pid to kill in it and the rank it is (-1: the process itself).
template <class Launch, class Victim>
void kill_suite(const Corpus& c, const char* name, int want, Launch&& launch, Victim&& victim, bool mpi) {
  const std::string ref = (c.root / fmt::format("{}_ref", name)).string();
  setenv("LOOM_CHECKPOINT_PAUSE_MS", "0", 1);  // (set, so that mpirun -x passes it on)
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(wait_exit(launch(ref, (c.root / "ref.log").string())), 0) << slurp(c.root / "ref.log");
  const int64_t run_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  const auto want_losses = losses(ref);
  ASSERT_EQ(want_losses.count(16), 1u);
  setenv("LOOM_CHECKPOINT_PAUSE_MS", std::to_string(std::max<int64_t>(20, run_ms / 16 / 2)).c_str(), 1);
  std::mt19937 rng(2026);
  int kills = 0, during_write = 0, during_resume = 0, episodes = 0;
  while (episodes < 40 && (kills < want || during_write < 1 || during_resume < 1)) {
    const std::string out = (c.root / fmt::format("{}_{}", name, episodes++)).string();
    int episode_kills = 0;
    for (int attempt = 0; attempt < 60; ++attempt) {
      const std::string log = (c.root / "attempt.log").string();
      const bool had_checkpoint = !train::latest_checkpoint(out).empty();
      const int64_t lines_before = metric_lines(out);
      const auto launched = fs::file_time_type::clock::now();
      const pid_t job = launch(out, log);
      pid_t target = -1;
      int rank = -1;
      if (episode_kills < kMaxEpisodeKills) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20 + int64_t(rng() % uint64_t(run_ms + 1))));
        std::tie(target, rank) = victim(job, rng);
        if (target > 0) kill(target, SIGKILL);
      }
      const auto k0 = std::chrono::steady_clock::now();
      const int code = wait_exit(job);
      const double end_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - k0).count();
      if (code == 0) break;  // finished before the kill
      const std::string text = slurp(log);
      if (episode_kills >= kMaxEpisodeKills) {  // nobody killed it
        ADD_FAILURE() << name << " episode " << episodes << ": a run nobody killed ended with " << code << ":\n" << text;
        break;
      }
      ++kills;
      ++episode_kills;
      if (mpi) {
        EXPECT_LT(end_s, 60.0) << "the job took " << end_s << " s to end after rank " << rank << " was killed";
        EXPECT_NE(text.find(fmt::format("rank {}", rank)), std::string::npos)
            << "the job's output does not name rank " << rank << ":\n" << text;
      } else {
        EXPECT_EQ(code, 128 + SIGKILL) << text;
      }
      std::error_code ec;
      // A write this attempt began (an older one's leftover stays until the next save removes it).
      for (auto& e : fs::directory_iterator(out, ec))
        if (e.path().filename().string().rfind(".tmp_ckpt_", 0) == 0 && fs::last_write_time(e.path(), ec) >= launched) {
          ++during_write;
          break;
        }
      if (had_checkpoint && metric_lines(out) <= lines_before) ++during_resume;  // died before its first new step
      // Whatever moment the kill hit, `latest` (if any) names a checkpoint that verifies.
      const std::string ckpt = train::latest_checkpoint(out);
      if (!ckpt.empty()) {
        EXPECT_NO_THROW(train::verify_checkpoint(ckpt)) << ckpt;
      }
    }
    if (episode_kills > 0) {
      EXPECT_EQ(losses(out), want_losses) << name << " episode " << episodes;
    }
  }
  unsetenv("LOOM_CHECKPOINT_PAUSE_MS");
  std::printf("[%s] %d SIGKILLs (%d inside checkpoint writes, %d inside resumes) over %d episodes; every resumed run "
              "equal to the uninterrupted one\n",
              name, kills, during_write, during_resume, episodes);
  EXPECT_GE(kills, want);
  EXPECT_GE(during_write, 1);
  EXPECT_GE(during_resume, 1);
}

}  // namespace

TEST(KillSuite, ThreadsBackend) {
  LOOM_REQUIRE_LOOM();
  Corpus c("threads");
  auto launch = [&](const std::string& out, const std::string& log) {
    std::vector<std::string> a{kLoom};
    for (auto& f : flags(c.data, out)) a.push_back(f);
    for (const char* f : {"--parallel.dp", "2"}) a.push_back(f);
    return spawn(a, log);
  };
  auto victim = [](pid_t job, std::mt19937&) { return std::pair<pid_t, int>{job, -1}; };
  kill_suite(c, "threads", 20, launch, victim, false);
}

TEST(KillSuite, MpiRandomRank) {
  LOOM_REQUIRE_LOOM();
  if (mpirun_prefix(2).empty()) GTEST_SKIP() << "mpirun not found or loom built without MPI";
  Corpus c("mpi");
  auto launch = [&](const std::string& out, const std::string& log) {
    return spawn_mpi(2, flags(c.data, out), {"--parallel.dp", "2"}, log);
  };
  auto victim = [](pid_t job, std::mt19937& rng) -> std::pair<pid_t, int> {
    const auto ranks = rank_pids(job);
    if (ranks.empty()) return {-1, -1};  // not started yet (or ended): the job runs on
    const auto& [rank, pid] = ranks[rng() % ranks.size()];
    return {pid, rank};
  };
  setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1);
  kill_suite(c, "mpi", 20, launch, victim, true);
}

// A 4-rank job (dp 2 x tp 2 under mpirun: every rank writes its own part of each checkpoint) with
// one random rank killed at a random moment inside a checkpoint write, 20 times: every time the
// job ends naming the rank, `latest` names the newest complete checkpoint, which verifies and is
// the one --resume takes; the run then resumed to the end has every loss of the uninterrupted run.
TEST(KillSuite, MpiRankKilledInsideFourRankCheckpointWrites) {
  LOOM_REQUIRE_LOOM();
  if (mpirun_prefix(4).empty()) GTEST_SKIP() << "mpirun not found or loom built without MPI";
  Corpus c("mpi4");
  setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1);
  auto launch = [&](const std::string& out, const std::string& log) {
    return spawn_mpi(4, flags(c.data, out), {"--parallel.dp", "2", "--parallel.tp", "2"}, log);
  };
  setenv("LOOM_CHECKPOINT_PAUSE_MS", "0", 1);
  const std::string ref = (c.root / "ref").string();
  ASSERT_EQ(wait_exit(launch(ref, (c.root / "ref.log").string())), 0) << slurp(c.root / "ref.log");
  const auto want = losses(ref);
  ASSERT_EQ(want.count(16), 1u);
  // Each rank pauses this long between its data file and its index: the window the kills aim at.
  const int pause_ms = 300;
  setenv("LOOM_CHECKPOINT_PAUSE_MS", std::to_string(pause_ms).c_str(), 1);
  std::mt19937 rng(4);
  int kills = 0, episodes = 0;
  auto newest_complete = [](const std::string& out) {
    std::string best;
    for (const auto& e : fs::directory_iterator(out)) {
      const std::string n = e.path().filename().string();
      if (e.is_directory() && n.rfind("ckpt_", 0) == 0 && n > best) best = n;
    }
    return best.empty() ? "" : (fs::path(out) / best).string();
  };
  while (kills < 20 && episodes < 10) {
    const std::string out = (c.root / fmt::format("run{}", episodes++)).string();
    for (int attempt = 0; attempt < 12 && kills < 20; ++attempt) {
      const std::string log = (c.root / "attempt.log").string();
      const auto launched = fs::file_time_type::clock::now();
      const pid_t job = launch(out, log);
      // Wait for a checkpoint write this attempt began, then kill a rank somewhere inside it.
      bool writing = false;
      int status = 0;
      pid_t done = 0;
      for (int i = 0; i < 12000 && !writing && done == 0; ++i) {
        std::error_code ec;
        for (auto& e : fs::directory_iterator(out, ec))
          if (e.path().filename().string().rfind(".tmp_ckpt_", 0) == 0 && fs::last_write_time(e.path(), ec) >= launched)
            writing = true;
        if (!writing) {
          done = waitpid(job, &status, WNOHANG);
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
      }
      if (done != 0) break;  // the run finished: the next episode starts a new one
      ASSERT_TRUE(writing) << "no checkpoint write began within a minute\n" << slurp(log);
      std::this_thread::sleep_for(std::chrono::milliseconds(int64_t(rng() % uint64_t(pause_ms))));
      const auto ranks = rank_pids(job);
      ASSERT_FALSE(ranks.empty());
      const auto& [rank, pid] = ranks[rng() % ranks.size()];
      kill(pid, SIGKILL);
      const int code = wait_exit(job);
      ASSERT_NE(code, 0) << "the job survived the kill of rank " << rank;
      ++kills;
      const std::string text = slurp(log);
      EXPECT_NE(text.find(fmt::format("rank {}", rank)), std::string::npos)
          << "the job's output does not name rank " << rank << ":\n" << text;
      // `latest` names the newest complete checkpoint; it verifies, and resuming takes it.
      const std::string newest = newest_complete(out);
      EXPECT_EQ(train::latest_checkpoint(out), newest) << "kill " << kills;
      if (!newest.empty()) {
        EXPECT_NO_THROW(train::verify_checkpoint(newest)) << newest;
        std::vector<std::string> notes;
        EXPECT_EQ(train::resume_checkpoint(out, &notes), newest) << "kill " << kills;
        EXPECT_TRUE(notes.empty());
      }
    }
    setenv("LOOM_CHECKPOINT_PAUSE_MS", "0", 1);  // the rest of the run without kills
    const std::string log = (c.root / "finish.log").string();
    ASSERT_EQ(wait_exit(launch(out, log)), 0) << slurp(log);
    EXPECT_EQ(losses(out), want) << "episode " << episodes;
    setenv("LOOM_CHECKPOINT_PAUSE_MS", std::to_string(pause_ms).c_str(), 1);
  }
  unsetenv("LOOM_CHECKPOINT_PAUSE_MS");
  std::printf("[mpi4] %d SIGKILLs of a random rank inside 4-rank checkpoint writes over %d runs; `latest` the newest "
              "complete checkpoint every time, every resumed run equal to the uninterrupted one\n",
              kills, episodes);
  EXPECT_GE(kills, 20);
}

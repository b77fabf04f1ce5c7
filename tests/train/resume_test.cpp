// Kill training with SIGKILL at random moments (checkpoint writes included): the latest checkpoint
// always loads, and the resumed run's losses equal the uninterrupted run's exactly.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "noisy_corpus.h"
#include "checkpoint_util.h"
#include "train/checkpoint.h"
#include "train/safetensors.h"

extern char** environ;
namespace fs = std::filesystem;
using namespace loom;

namespace {

const std::string kLoom = std::string(LOOM_BINARY_DIR) + "/loom";

std::vector<std::string> train_args(const std::string& data, const std::string& out, bool resume) {
  std::vector<std::string> a = {kLoom, "train", "--quiet", "--data.dir", data, "--train.out_dir", out,
                                "--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", "32",
                                "--data.seq_len", "16", "--train.batch_size", "4", "--train.grad_accum", "2",
                                "--train.steps", "24", "--train.checkpoint_every", "1", "--train.eval_every", "6",
                                "--train.eval_batches", "2", "--train.sample_tokens", "0", "--train.threads", "1",
                                "--optim.warmup_steps", "4", "--train.keep_checkpoints", "2"};
  if (resume) a.push_back("--resume");
  return a;
}

pid_t spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (auto& s : args) argv.push_back(const_cast<char*>(s.c_str()));
  argv.push_back(nullptr);
  pid_t pid;
  EXPECT_EQ(posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ), 0);
  return pid;
}

int wait_exit(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::map<int64_t, std::string> losses(const std::string& out) {
  std::map<int64_t, std::string> m;
  std::ifstream f(out + "/metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    // Exact comparison: the printed shortest round-trip form of the double.
    if (j.contains("loss")) m[j["step"].get<int64_t>()] = j["loss"].dump();
    if (j.contains("val_loss")) m[-j["step"].get<int64_t>()] = j["val_loss"].dump();
  }
  return m;
}

}  // namespace

TEST(Resume, SigkillAtRandomMomentsThenResumeIsBitIdentical) {
  if (!fs::exists(kLoom)) GTEST_SKIP() << "the loom executable is not built at " << kLoom;
  fs::path root = fs::temp_directory_path() / fmt::format("loom_resume_{}", ::getpid());
  fs::remove_all(root);
  test::write_noisy_pattern_corpus(root / "data");
  std::string data = (root / "data").string();

  std::string ref = (root / "ref").string();
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(wait_exit(spawn(train_args(data, ref, false))), 0);
  // Kill moments are drawn over the length of a whole run (start-up included), with checkpoint
  // writes slowed down so that some kills land inside them.
  int64_t run_ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0).count();
  int64_t pause_ms = std::max<int64_t>(20, run_ms / 24 / 2);
  auto want = losses(ref);
  ASSERT_EQ(want.count(24), 1u);

  setenv("LOOM_CHECKPOINT_PAUSE_MS", std::to_string(pause_ms).c_str(), 1);
  std::mt19937 rng(12345);
  int kills = 0, during_write = 0, episodes = 0;
  // Each episode trains from scratch to the end through up to kKillsPerEpisode kill-and-resume
  // cycles, kill moments uniform over the length of a whole run, and then one last resume that
  // runs to the end unkilled. The reference run's length is one measurement: on a loaded host the
  // resumed runs may be slower than it by more than the pauses, and an episode must still end.
  constexpr int kKillsPerEpisode = 12;
  while (episodes < 8 && (kills < 6 || during_write < 1)) {
    std::string out = (root / fmt::format("killed_{}", episodes++)).string();
    int episode_kills = 0;
    for (;;) {
      pid_t pid = spawn(train_args(data, out, true));
      if (episode_kills == kKillsPerEpisode) {
        ASSERT_EQ(wait_exit(pid), 0) << "training failed after a resume";
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10 + int64_t(rng() % uint64_t(run_ms + 1))));
      kill(pid, SIGKILL);
      int code = wait_exit(pid);
      if (code == 0) break;  // finished before the kill
      ASSERT_EQ(code, 128 + SIGKILL) << "training failed after a resume";
      ++kills;
      ++episode_kills;
      // A kill can land before the run created its output directory.
      std::error_code ec;
      for (auto& e : fs::directory_iterator(out, ec))
        if (e.path().filename().string().rfind(".tmp_ckpt_", 0) == 0) ++during_write;
      // Whatever moment the kill hit, `latest` names a complete checkpoint that loads.
      std::string ckpt = train::latest_checkpoint(out);
      if (!ckpt.empty()) {
        auto meta = train::read_checkpoint_meta(ckpt);
        const auto tensors = test::checkpoint_tensors(ckpt);  // every checksum checked
        EXPECT_EQ(tensors.size(), size_t(3 * 28));  // params and two moments of 28 tensors (L=2, tied)
        EXPECT_EQ(tensors.at("param/wte.weight").size(), size_t(97 * 32));
        EXPECT_GE(meta.step, 1);
      }
    }
    // Every step's loss and every validation loss equal the uninterrupted run's exactly.
    if (episode_kills > 0) {
      EXPECT_EQ(losses(out), want) << "episode " << episodes << " with " << episode_kills << " kills";
    }
  }
  unsetenv("LOOM_CHECKPOINT_PAUSE_MS");
  std::printf("%d SIGKILLs (%d inside checkpoint writes) over %d episodes; every resumed run equal\n", kills,
              during_write, episodes);
  EXPECT_GE(kills, 6);
  EXPECT_GE(during_write, 1) << "no kill landed inside a checkpoint write";
  fs::remove_all(root);
}

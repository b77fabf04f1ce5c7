// Data at scale: a job's ranks share the verification of its token shards (data::VerifyShare), so
// a damaged shard fails the whole job before its first step, naming the rank that found it and
// the file; `loom prepare` holds one input file and one shard in memory, not the corpus.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "cli_util.h"
#include "data/shard.h"

namespace fs = std::filesystem;
using namespace loom::test;

TEST(DataCli, ADamagedShardFailsTheJobNamingTheRankThatVerifiedIt) {
  LOOM_REQUIRE_LOOM();
  TrainScratch r("loom_data_cli");
  // The pattern corpus again as two train shards; one byte of the second's tokens changed.
  const fs::path data = r.root / "data";
  std::vector<uint32_t> toks(20000);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = uint32_t((i * 7 + (i / 13) * 5) % 97);
  fs::remove(data / "train_000.bin");
  loom::data::write_shard((data / "train_000.bin").string(), std::vector<uint32_t>(toks.begin(), toks.begin() + 10000), 97);
  loom::data::write_shard((data / "train_001.bin").string(), std::vector<uint32_t>(toks.begin() + 10000, toks.end()), 97);
  {
    std::fstream f(data / "train_001.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(std::streamoff(loom::data::kShardHeaderBytes + 100));
    f.put(char(0x7f));
  }
  const CliRun run = r.train("run", "--model.n_layer 1 --model.n_head 2 --model.n_embd 32 --data.seq_len 16 "
                                    "--train.batch_size 4 --train.steps 2 --train.sample_tokens 0 --parallel.dp 2 "
                                    "--train.threads 2");
  EXPECT_EQ(run.code, 1) << run.out << run.err;
  EXPECT_NE(run.err.find("rank 1 of 2 failed"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("train_001.bin"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("payload checksum"), std::string::npos) << run.err;
  EXPECT_FALSE(fs::exists(r.root / "run" / "metrics.jsonl")) << "no step was trained";
}

namespace {

// Peak resident set of a shell command's processes, in bytes (-1 when it failed): measured in a
// child process of its own, so no earlier child of this test binary counts.
int64_t peak_rss_of(const std::string& cmd) {
  int fds[2];
  if (::pipe(fds) != 0) return -1;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    const int st = std::system(cmd.c_str());
    rusage ru{};
    ::getrusage(RUSAGE_CHILDREN, &ru);
    const int64_t bytes = WIFEXITED(st) && WEXITSTATUS(st) == 0 ? int64_t(ru.ru_maxrss) * 1024 : -1;
    ssize_t ignored = ::write(fds[1], &bytes, sizeof bytes);
    (void)ignored;
    ::_exit(0);
  }
  ::close(fds[1]);
  int64_t bytes = -1;
  if (::read(fds[0], &bytes, sizeof bytes) != ssize_t(sizeof bytes)) bytes = -1;
  ::close(fds[0]);
  ::waitpid(pid, nullptr, 0);
  return bytes;
}

}  // namespace

// Four times the input files, the same peak memory: prepare reads one input at a time (once to
// train the vocabulary, once to encode it), writes its tokens to a file and cuts the shards from it.
// (It held every input's text, then all the tokens twice: 234 MB for a 48 MB corpus, 70 MB now.)
TEST(DataCli, PrepareHoldsOneInputAndOneShardNotTheCorpus) {
  LOOM_REQUIRE_LOOM();
  const fs::path root = fs::temp_directory_path() / ("loom_prepare_memory_" + std::to_string(::getpid()));
  fs::remove_all(root);
  fs::create_directories(root);
  const char* words[] = {"the ", "and ", "of ", "light ", "water ", "said ", "unto ", "them ", "earth ", "day.\n"};
  std::mt19937 g(7);
  std::string text;
  while (text.size() < (size_t(4) << 20)) text += words[g() % 10];
  std::vector<std::string> files;
  for (int i = 0; i < 24; ++i) {
    files.push_back((root / ("part" + std::to_string(i) + ".txt")).string());
    std::ofstream(files.back()) << text.substr(size_t(i) * 17);  // (not all alike)
  }
  auto prepare = [&](int n) {
    std::string cmd = "'" + kLoom + "' prepare";
    for (int i = 0; i < n; ++i) cmd += " '" + files[size_t(i)] + "'";
    cmd += " --out '" + (root / ("out" + std::to_string(n))).string() + "' --vocab-size 300 --shard-tokens 65536 >/dev/null";
    return peak_rss_of(cmd);
  };
  const int64_t six = prepare(6), all = prepare(24);
  ASSERT_GT(six, 0);
  ASSERT_GT(all, 0);
  std::printf("peak RSS: 6 inputs (24 MiB) %.1f MiB, 24 inputs (96 MiB) %.1f MiB\n", double(six) / (1 << 20),
              double(all) / (1 << 20));
  // 72 MiB more input: at most a quarter of it more memory (holding the corpus took 3-4 times it).
  EXPECT_LT(all - six, (int64_t(72) << 20) / 4);
  fs::remove_all(root);
}

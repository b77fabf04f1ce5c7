// Running the loom executable (built next to the tests) from tests: shell commands with their
// output, loom with stdout and stderr apart, and the metrics a training run writes.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "data/shard.h"

namespace loom::test {

// The loom executable: in the build directory, else beside the running test binary or one folder
// above it (the executables of a build copied together to another machine).
inline std::string locate_loom() {
  const std::filesystem::path built = std::filesystem::path(LOOM_BINARY_DIR) / "loom";
  if (std::filesystem::exists(built)) return built.string();
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec)
    for (const auto& p : {self.parent_path() / "loom", self.parent_path().parent_path() / "loom"})
      if (std::filesystem::exists(p)) return p.string();
  return built.string();
}

inline const std::string kLoom = locate_loom();

// Skips the test when the loom executable is not built.
#define LOOM_REQUIRE_LOOM()                                                                         \
  do {                                                                                              \
    if (!std::filesystem::exists(::loom::test::kLoom))                                              \
      GTEST_SKIP() << "the loom executable is not built at " << ::loom::test::kLoom << " (ninja loom)"; \
  } while (0)

// The first executable `name` on PATH, or "" when there is none.
inline std::string find_in_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  const std::string p = path ? path : "";
  size_t start = 0;
  while (start <= p.size()) {
    size_t end = p.find(':', start);
    if (end == std::string::npos) end = p.size();
    const std::filesystem::path cand = std::filesystem::path(p.substr(start, end - start)) / name;
    if (end > start && ::access(cand.c_str(), X_OK) == 0) return cand.string();
    start = end + 1;
  }
  return "";
}

// `timeout ... mpirun ... -n n` to put before a loom command, or "" when mpirun is not on PATH or
// loom was built without MPI:
// shared-memory transport without cross-process memory attach (often forbidden in containers),
// the processes unbound (each runs its own OpenMP threads), LOOM_FAULT_INJECT forwarded when asked.
inline std::string mpirun_prefix(int n, bool with_fault = false) {
#ifndef LOOM_HAVE_MPI
  return "";
#endif
  const std::string mpirun = find_in_path("mpirun");
  if (mpirun.empty()) return "";
  return "OMPI_MCA_btl_vader_single_copy_mechanism=none timeout -k 10 240 " + mpirun +
         (::geteuid() == 0 ? " --allow-run-as-root" : "") + " --oversubscribe --bind-to none" +
         (with_fault ? " -x LOOM_FAULT_INJECT" : "") + " -n " + std::to_string(n);
}

struct CmdRun {
  int status = -1;
  std::string output;
};

// Runs a shell command, stdout and stderr together; the status is the exit code or 128 + signal.
inline CmdRun sh(const std::string& cmd) {
  CmdRun r;
  FILE* f = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!f) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) r.output.append(buf, n);
  int st = ::pclose(f);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

struct CliRun {
  int code = -1;  // exit code (-1: killed by a signal)
  std::string out, err;
};

// `env loom args` with stdout and stderr captured apart through files in `dir` (which must exist).
inline CliRun loom_cli(const std::string& args, const std::filesystem::path& dir, const std::string& env = "") {
  const std::filesystem::path out = dir / "stdout.txt", err = dir / "stderr.txt";
  const std::string cmd = (env.empty() ? "" : env + " ") + "'" + kLoom + "' " + args + " >'" + out.string() +
                          "' 2>'" + err.string() + "'";
  CliRun r;
  const int status = std::system(cmd.c_str());
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  auto slurp = [](const std::filesystem::path& p) {
    std::ifstream f(p);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  };
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

// step -> value of `key` in a metrics.jsonl file (lines without the key are skipped).
inline std::map<int64_t, double> read_metrics(const std::filesystem::path& metrics_jsonl, const char* key) {
  std::map<int64_t, double> m;
  std::ifstream f(metrics_jsonl);
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains(key)) m[j["step"].get<int64_t>()] = j[key].get<double>();
  }
  return m;
}

// DIR/train_000.bin (20000 tokens of a repeating pattern over a vocabulary of 97) and
// DIR/val_000.bin (its first 2000), for training runs of tiny models.
inline void write_pattern_corpus(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  std::vector<uint32_t> toks(20000);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = uint32_t((i * 7 + (i / 13) * 5) % 97);
  data::write_shard((dir / "train_000.bin").string(), toks, 97);
  data::write_shard((dir / "val_000.bin").string(), std::vector<uint32_t>(toks.begin(), toks.begin() + 2000), 97);
}

// A scratch directory for a test's runs of `loom train`: ROOT/data holds the pattern corpus,
// ROOT/logs the runs' captured output; removed at the end.
struct TrainScratch {
  std::filesystem::path root;
  explicit TrainScratch(const std::string& name)
      : root(std::filesystem::temp_directory_path() / (name + "_" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(root);
    std::filesystem::create_directories(root / "logs");
    write_pattern_corpus(root / "data");
  }
  ~TrainScratch() { std::filesystem::remove_all(root); }
  TrainScratch(const TrainScratch&) = delete;
  TrainScratch& operator=(const TrainScratch&) = delete;
  // `loom train --data.dir ROOT/data --train.out_dir ROOT/OUT ARGS`, with `env` in front.
  CliRun train(const std::string& out, const std::string& args, const std::string& env = "") const {
    return loom_cli(fmt::format("train --data.dir '{}' --train.out_dir '{}' {}", (root / "data").string(),
                                (root / out).string(), args),
                    root / "logs", env);
  }
};

}  // namespace loom::test

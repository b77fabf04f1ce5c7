// `loom bench train` end to end on a tiny model: the pool's peak bytes equal the declarations for
// every tag (the command exits with status 2 otherwise), the workspace declaration including the
// attention kernel's scratch at the run's thread count. Skips when the loom executable has not
// been built next to the tests.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "cli_util.h"

namespace fs = std::filesystem;

namespace {

using loom::test::CliRun;
using loom::test::kLoom;

// loom with stdout and stderr apart, in a directory of its own for the run.
CliRun loom_cli(const std::string& args) {
  const fs::path dir = fs::temp_directory_path() / ("loom_bench_cli_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  CliRun r = loom::test::loom_cli(args, dir);
  fs::remove_all(dir);
  return r;
}

}  // namespace

TEST(BenchTrainCli, MemoryByTagEqualsTheDeclarations) {
  LOOM_REQUIRE_LOOM();
  for (int threads : {1, 2}) {
    const CliRun r = loom_cli("bench train --model gpt2-tiny --batch 2 --seq 48 --steps 1 --warmup 1 "
                              "--gemm-seconds 0.01 --threads " + std::to_string(threads));
    ASSERT_EQ(r.code, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("memory_matches=1"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("DIFFERENT"), std::string::npos) << r.out;
    // The workspace line reads "equal"; the declaration is the backward scratch 24 B T C plus a
    // nonzero attention scratch.
    const size_t tag = r.out.find("\n  workspace ");
    ASSERT_NE(tag, std::string::npos) << r.out;
    const std::string line = r.out.substr(tag + 1, r.out.find('\n', tag + 1) - tag - 1);
    EXPECT_NE(line.find(" equal "), std::string::npos) << line;
    long long total = 0, backward = 0, attention = 0;
    const size_t at = r.out.find("workspace: ");
    ASSERT_NE(at, std::string::npos) << r.out;
    ASSERT_EQ(std::sscanf(r.out.c_str() + at, "workspace: %lld bytes = backward scratch %lld", &total, &backward), 2)
        << r.out;
    const size_t att = r.out.find("attention scratch ", at);
    ASSERT_NE(att, std::string::npos) << r.out;
    ASSERT_EQ(std::sscanf(r.out.c_str() + att, "attention scratch %lld", &attention), 1) << r.out;
    EXPECT_EQ(backward, 24LL * 2 * 48 * 64);  // gpt2-tiny: n_embd 64
    EXPECT_GT(attention, 0);
  }
}

// Ranks started differently (mpirun's MPMD form: each rank its own command line) are refused
// before the first step, every rank naming the same item and the ranks that differ: another model
// shape (which crashed inside MPI_Testall) and another seed (which trained diverging replicas and
// saved rank 0's alone). The same command on every rank trains.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include <fmt/format.h>

#include "cli_util.h"

namespace fs = std::filesystem;
using namespace loom::test;

TEST(RankAgreementCli, RanksStartedDifferentlyAreRefusedBeforeTheFirstStep) {
  LOOM_REQUIRE_LOOM();
  const std::string one = mpirun_prefix(1);
  if (one.empty()) GTEST_SKIP() << "mpirun not found or loom built without MPI";
  const fs::path root = fs::temp_directory_path() / fmt::format("loom_agree_cli_{}", ::getpid());
  fs::remove_all(root);
  fs::create_directories(root);
  write_pattern_corpus(root / "data");
  const std::string base = fmt::format(
      "{} train --data.dir '{}' --model.n_layer 1 --model.n_head 2 --data.seq_len 16 --train.batch_size 4 "
      "--train.steps 2 --train.eval_every 0 --train.sample_tokens 0 --train.threads 1 --quiet --parallel.dp 2 "
      "--parallel.comm mpi",
      kLoom, (root / "data").string());
  // `mpirun ... -n 1 A : -n 1 B`: rank 0 runs A, rank 1 runs B.
  auto mpmd = [&](const std::string& a, const std::string& b, const std::string& out) {
    return sh(fmt::format("cd '{}' && {} {} --train.out_dir '{}' : -n 1 {} --train.out_dir '{}' 2>&1", root.string(),
                          one, a, (root / out).string(), b, (root / out).string()));
  };
  CmdRun shape = mpmd(base + " --model.n_embd 32", base + " --model.n_embd 64", "shape");
  EXPECT_NE(shape.status, 0);
  EXPECT_NE(shape.output.find("ranks disagree before the first step: model.n_embd on rank 1 differs from rank 0's"),
            std::string::npos)
      << shape.output;
  CmdRun seed = mpmd(base + " --model.n_embd 32", base + " --model.n_embd 32 --train.seed 7", "seed");
  EXPECT_NE(seed.status, 0);
  EXPECT_NE(seed.output.find("train.seed on rank 1 differs from rank 0's"), std::string::npos) << seed.output;
  CmdRun same = mpmd(base + " --model.n_embd 32", base + " --model.n_embd 32", "same");
  EXPECT_EQ(same.status, 0) << same.output;
  fs::remove_all(root);
}

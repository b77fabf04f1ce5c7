// Sizes far beyond any host's memory are refused before anything is allocated, naming the fields
// and where their values came from: a command-line flag is named as such, a config file's value
// by the file (not "out of host memory allocating N bytes").
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>

#include "cli_util.h"

namespace fs = std::filesystem;
using namespace loom::test;

namespace {

struct Limits : TrainScratch {
  Limits() : TrainScratch("loom_limits_cli") {}
  CliRun train(const std::string& args) { return TrainScratch::train("out", args + " --train.steps 1 --quiet"); }
};

}  // namespace

TEST(LimitsCli, SizesBeyondTheHostAreRefusedNamingTheFieldAndTheFlag) {
  LOOM_REQUIRE_LOOM();
  Limits l;
  // 2.6e13 parameters: hundreds of TiB.
  CliRun wide = l.train("--model.n_embd 1048576 --model.n_head 1");
  EXPECT_NE(wide.code, 0);
  EXPECT_NE(wide.err.find("command line (--model.n_embd): model.n_layer"), std::string::npos) << wide.err;
  EXPECT_NE(wide.err.find("more than this host's"), std::string::npos) << wide.err;
  // The same from a config file names the file.
  const fs::path toml = l.root / "wide.toml";
  std::ofstream(toml) << "[model]\nn_embd = 1048576\nn_head = 1\n";
  CliRun file = l.train(fmt::format("'{}'", toml.string()));
  EXPECT_NE(file.code, 0);
  EXPECT_NE(file.err.find(toml.string() + ": model.n_layer"), std::string::npos) << file.err;
  EXPECT_EQ(file.err.find("command line"), std::string::npos) << file.err;
  // A batch whose token ids and logits alone exceed the host (6.4e9 tokens).
  CliRun batch = l.train("--train.batch_size 100000000 --data.seq_len 64");
  EXPECT_NE(batch.code, 0);
  EXPECT_NE(batch.err.find("command line (--train.batch_size, --data.seq_len): train.batch_size 100000000"),
            std::string::npos)
      << batch.err;
  EXPECT_EQ(batch.err.find("out of host memory"), std::string::npos) << batch.err;
  EXPECT_FALSE(fs::exists(l.root / "out" / "metrics.jsonl"));
}

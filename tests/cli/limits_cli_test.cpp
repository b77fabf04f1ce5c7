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

// Thread counts beyond 8 per core (libgomp crashed starting 100000 threads, with no message) and
// inputs that never end (a device such as /dev/zero was read until memory ran out) are refused,
// naming what was given; bench's --gemm-seconds takes calibrate's range.
TEST(LimitsCli, ThreadCountsAndEndlessInputsAreRefused) {
  LOOM_REQUIRE_LOOM();
  Limits l;
  CliRun omp = l.TrainScratch::train("omp", "--train.steps 1 --quiet", "OMP_NUM_THREADS=100000");
  EXPECT_EQ(omp.code, 1) << omp.err;
  EXPECT_NE(omp.err.find("OMP_NUM_THREADS = 100000: 100000 threads is more than 8 per core"), std::string::npos)
      << omp.err;
  CliRun bench = loom_cli("bench train --model gpt2-tiny --batch 2 --seq 16 --steps 1 --threads 100000", l.root);
  EXPECT_EQ(bench.code, 1) << bench.err;
  EXPECT_NE(bench.err.find("--threads must be from 0"), std::string::npos) << bench.err;
  for (const char* seconds : {"0", "-1", "nan", "1e9"}) {
    CliRun g = loom_cli(fmt::format("bench train --model gpt2-tiny --batch 2 --seq 16 --steps 1 --gemm-seconds {}",
                                    seconds),
                        l.root);
    EXPECT_EQ(g.code, 1) << seconds;
    EXPECT_NE(g.err.find("--gemm-seconds must be from 0.01 to 60"), std::string::npos) << g.err;
  }
  // A flag that would be ignored is refused: bench's --trace traces only the data-parallel bench.
  CliRun trace = loom_cli("bench train --model gpt2-tiny --batch 2 --seq 16 --steps 1 --trace t.json", l.root);
  EXPECT_EQ(trace.code, 1) << trace.err;
  EXPECT_NE(trace.err.find("--trace traces the data-parallel benchmark"), std::string::npos) << trace.err;
  for (const std::string cmd : {"tokenizer train /dev/zero --vocab-size 300 --out tz", "prepare /dev/zero --out pz"}) {
    CliRun zero = loom_cli(cmd, l.root);
    EXPECT_EQ(zero.code, 1) << cmd << ": " << zero.err;
    EXPECT_NE(zero.err.find("/dev/zero: is a device, not a file"), std::string::npos) << zero.err;
  }
}

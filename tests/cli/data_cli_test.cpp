// A job's ranks share the verification of its token shards (data::VerifyShare): a damaged shard
// fails the whole job before its first step, naming the rank that found it and the file, and no
// rank trains on it.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
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

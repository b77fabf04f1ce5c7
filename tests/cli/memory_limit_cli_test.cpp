// train.memory_limit: a model whose single-device need exceeds the limit is refused before its
// first step, naming the field and what the rank needs; under the same limit it trains at tp 4,
// pp 4 and dp 4 with ZeRO-3, which split it; and a run that does not fit without activation
// recomputation trains with it. The limits are fractions of what the single device measured.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "core/file.h"

namespace fs = std::filesystem;
using namespace loom::test;

namespace {

struct LimitRun : TrainScratch {
  LimitRun() : TrainScratch("loom_memory_limit_cli") {}
  CliRun train(const std::string& args) {
    return TrainScratch::train("out",
                               "--model.n_layer 4 --model.n_head 4 --model.n_embd 64 --data.seq_len 64 "
                               "--train.batch_size 16 --train.steps 2 --train.eval_every 0 --train.sample_tokens 0 "
                               "--train.threads 4 --overwrite " + args);
  }
  // The run's "all tags" peak of rank 0, in bytes.
  static double all_tags(const std::string& out) {
    std::smatch m;
    if (!std::regex_search(out, m, std::regex(R"(all tags ([0-9.]+) (B|KiB|MiB|GiB))"))) return -1;
    const double v = std::stod(m[1].str());
    const std::string u = m[2].str();
    return v * (u == "B" ? 1.0 : u == "KiB" ? 1024.0 : u == "MiB" ? 1048576.0 : 1073741824.0);
  }
};

}  // namespace

TEST(MemoryLimitCli, ALimitTheSingleDeviceExceedsIsMetBySplittingLayouts) {
  LOOM_REQUIRE_LOOM();
  LimitRun r;
  CliRun whole = r.train("");
  ASSERT_EQ(whole.code, 0) << whole.err;
  const double single = LimitRun::all_tags(whole.out);
  ASSERT_GT(single, 0) << whole.out;
  const int64_t limit = int64_t(0.6 * single);
  const std::string metrics = loom::read_file((r.root / "out" / "metrics.jsonl").string());
  CliRun refused = r.train(fmt::format("--train.memory_limit {}", limit));
  EXPECT_NE(refused.code, 0);
  EXPECT_NE(refused.err.find("train.memory_limit"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("this rank needs"), std::string::npos) << refused.err;
  // Refused before its first step: the run it was to --overwrite is as it was.
  EXPECT_EQ(loom::read_file((r.root / "out" / "metrics.jsonl").string()), metrics);
  for (const std::string layout : {"--parallel.tp 4", "--parallel.pp 4 --train.grad_accum 4",
                                   "--parallel.dp 4 --parallel.zero 3"}) {
    CliRun split = r.train(fmt::format("--train.memory_limit {} {}", limit, layout));
    EXPECT_EQ(split.code, 0) << layout << "\n" << split.err;
    EXPECT_LE(LimitRun::all_tags(split.out), double(limit)) << layout << "\n" << split.out;
    // Every rank's peaks (memory.json, and a line each in the output): all four under the limit,
    // each with its mesh coordinates.
    std::ifstream in(r.root / "out" / "memory.json");
    ASSERT_TRUE(in.good()) << layout;
    const nlohmann::json j = nlohmann::json::parse(in);
    ASSERT_EQ(j["ranks"].size(), 4u) << layout;
    int along = 0;
    for (int rk = 0; rk < 4; ++rk) {
      const nlohmann::json& row = j["ranks"][size_t(rk)];
      EXPECT_EQ(row["rank"].get<int>(), rk);
      EXPECT_LE(row["all_tags_peak_bytes"].get<double>(), double(limit)) << layout << " rank " << rk;
      EXPECT_GT(row["peak_bytes"]["params"].get<double>(), 0) << layout << " rank " << rk;
      for (const char* d : {"pp", "dp", "tp"}) along += row["coords"][d].get<int>();
      EXPECT_NE(split.out.find(fmt::format("memory of rank {} (", rk)), std::string::npos) << split.out;
    }
    EXPECT_EQ(along, 0 + 1 + 2 + 3) << "the four ranks' coordinates along the split dimension: " << j.dump();
  }
}

TEST(MemoryLimitCli, RecomputationFitsWhatKeepingEveryActivationDoesNot) {
  LOOM_REQUIRE_LOOM();
  LimitRun r;
  CliRun keep = r.train(""), recompute = r.train("--memory.recompute full");
  ASSERT_EQ(keep.code, 0) << keep.err;
  ASSERT_EQ(recompute.code, 0) << recompute.err;
  const double a = LimitRun::all_tags(keep.out), b = LimitRun::all_tags(recompute.out);
  ASSERT_LT(b, 0.8 * a) << keep.out << recompute.out;
  const int64_t limit = int64_t((a + b) / 2);
  CliRun refused = r.train(fmt::format("--train.memory_limit {}", limit));
  EXPECT_NE(refused.code, 0);
  EXPECT_NE(refused.err.find("train.memory_limit"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("memory.recompute = none"), std::string::npos) << refused.err;
  CliRun fits = r.train(fmt::format("--train.memory_limit {} --memory.recompute full", limit));
  EXPECT_EQ(fits.code, 0) << fits.err;
}

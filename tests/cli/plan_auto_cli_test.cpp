// `loom train --plan auto` (issue "How to choose"): the run takes the planner's first choice of
// layout for its number of ranks, says what it chose, and trains with it; a memory limit steers
// the choice to a layout that splits the model, and trains under it; what cannot be planned is
// refused naming why.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "core/dtype.h"

using namespace loom::test;

namespace {

const char* kModel = "--model.n_layer 4 --model.n_head 4 --model.n_embd 128 --data.seq_len 64 --train.batch_size 16 "
                     "--train.steps 2 --train.eval_every 0 --train.sample_tokens 0 --train.threads 1";

struct Chosen {
  std::string layout;
  double predicted_mib = 0;
};

Chosen chosen(const std::string& out) {
  std::smatch m;
  Chosen c;
  if (std::regex_search(out, m, std::regex(R"(chose (\S+) \(predicted [0-9]+ tokens/s, ([0-9.]+) MiB per rank\))")))
    c.layout = m[1].str(), c.predicted_mib = std::stod(m[2].str());
  return c;
}

// The fullest rank's pool peak, all tags, in MiB.
double measured_mib(const std::filesystem::path& out) {
  std::ifstream in(out / "memory.json");
  const nlohmann::json mem = nlohmann::json::parse(in);
  double most = 0;
  for (const auto& r : mem["ranks"]) most = std::max(most, r["all_tags_peak_bytes"].get<double>());
  return most / 1048576.0;
}

}  // namespace

TEST(PlanAutoCli, TrainsWithThePlannersFirstChoice) {
  LOOM_REQUIRE_LOOM();
  TrainScratch r("loom_plan_auto_cli");
  CliRun run = r.train("free", fmt::format("{} --parallel.dp 2 --plan auto", kModel));
  ASSERT_EQ(run.code, 0) << run.err;
  const Chosen free = chosen(run.out);
  ASSERT_FALSE(free.layout.empty()) << run.out;
  // The choice keeps the two ranks, and its predicted memory is what the ranks' pools reach.
  std::ifstream in(r.root / "free" / "memory.json");
  EXPECT_EQ(nlohmann::json::parse(in)["ranks"].size(), 2u);
  const double measured = measured_mib(r.root / "free");
  EXPECT_LE(std::abs(free.predicted_mib - measured) / measured, 0.05)
      << free.layout << ": predicted " << free.predicted_mib << " MiB, measured " << measured << " MiB";

  // 70% of that as the limit: the first choice must split the model further, and trains under it.
  const int64_t limit = int64_t(measured * 0.7 * 1048576.0);
  CliRun tight = r.train("tight", fmt::format("{} --parallel.dp 2 --plan auto --train.memory_limit {}", kModel, limit));
  ASSERT_EQ(tight.code, 0) << tight.err << tight.out;
  const Chosen split = chosen(tight.out);
  ASSERT_FALSE(split.layout.empty()) << tight.out;
  EXPECT_NE(split.layout, free.layout);
  EXPECT_LE(measured_mib(r.root / "tight") * 1048576.0, double(limit)) << split.layout;
  std::printf("  free: %s (%.2f MiB measured); under %.2f MiB: %s (%.2f MiB measured)\n", free.layout.c_str(), measured,
              double(limit) / 1048576.0, split.layout.c_str(), measured_mib(r.root / "tight"));

  // Nothing of two ranks fits 1 MB; the GPU runs data parallelism only.
  CliRun none = r.train("none", fmt::format("{} --parallel.dp 2 --plan auto --train.memory_limit 1000000", kModel));
  EXPECT_NE(none.code, 0);
  EXPECT_NE(none.err.find("--plan auto: no layout of 2 ranks fits"), std::string::npos) << none.err;
  EXPECT_NE(none.err.find("train.memory_limit"), std::string::npos) << none.err;
  CliRun bad = r.train("bad", fmt::format("{} --plan manual", kModel));
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("--plan"), std::string::npos) << bad.err;
}

// A bf16 run (where the CPU has bf16 dot products) is planned as its f32 twin, and the run says so.
TEST(PlanAutoCli, Bf16RunSaysItWasPlannedInF32) {
  LOOM_REQUIRE_LOOM();
  if (const std::string missing = loom::cpu_bf16_missing(); !missing.empty()) GTEST_SKIP() << "this CPU lacks " << missing;
  TrainScratch r("loom_plan_auto_bf16_cli");
  CliRun run = r.train("bf16", fmt::format("{} --parallel.dp 2 --plan auto --train.precision bf16", kModel));
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_FALSE(chosen(run.out).layout.empty()) << run.out;
  EXPECT_NE(run.out.find("planned with f32 matmuls (train.precision = bf16"), std::string::npos) << run.out;
}

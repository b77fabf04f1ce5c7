// The planner's memory per rank against what loom's pools reach (issue "How to choose", local
// truth): for layouts of data, tensor (with sp), context and pipeline parallelism (GPipe, 1F1B and ZB-H1,
// composed with dp (ZeRO 1-3) and tp; interleaved), ZeRO stages and recomputation, `loom plan --layout ... --precision f32
// --cluster cpu --json` predicts the fullest rank's peak, all tags, within 5% of `loom train`'s
// OUT/memory.json (measured within 2.5% on a 4-layer model; the attention kernel's own scratch is
// what the prediction leaves out). The interleaved schedule's chunks, each its own size, are
// counted at their peak along the rank's list (bench/README.md, "Local truth").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_util.h"

namespace fs = std::filesystem;
using namespace loom::test;

TEST(PlanTruthCli, PredictedPeakMemoryPerRankIsWithinFivePercentOfTheMeasured) {
  LOOM_REQUIRE_LOOM();
  TrainScratch r("loom_plan_truth_cli");
  const int L = 4, H = 4, C = 128, T = 64, batch = 16;
  struct Case {
    std::string plan, train;
    int ranks;
  };
  const Case cases[] = {
      {"dp=1,mbs=16", "", 1},
      {"dp=2,zero=1,mbs=8", "--parallel.dp 2 --parallel.zero 1", 2},
      {"dp=2,zero=3,mbs=8", "--parallel.dp 2 --parallel.zero 3", 2},
      {"tp=2,sp=1,mbs=16", "--parallel.tp 2 --parallel.sp true", 2},
      {"cp=2,mbs=16", "--parallel.cp 2", 2},
      {"dp=2,tp=2,zero=2,mbs=8", "--parallel.dp 2 --parallel.tp 2 --parallel.zero 2", 4},
      {"dp=1,recompute=full,mbs=16", "--memory.recompute full", 1},
      {"pp=2,schedule=1f1b,mbs=4", "--parallel.pp 2 --train.grad_accum 4 --parallel.schedule 1f1b", 2},
      {"pp=2,schedule=gpipe,mbs=4", "--parallel.pp 2 --train.grad_accum 4 --parallel.schedule gpipe", 2},
      {"pp=2,schedule=zb-h1,mbs=4", "--parallel.pp 2 --train.grad_accum 4 --parallel.schedule zb-h1", 2},
      {"pp=2,v=2,schedule=interleaved,mbs=4",
       "--parallel.pp 2 --train.grad_accum 4 --parallel.schedule interleaved --parallel.virtual_stages 2", 2},
      {"pp=4,schedule=1f1b,mbs=4", "--parallel.pp 4 --train.grad_accum 4 --parallel.schedule 1f1b", 4},
      {"dp=2,pp=2,zero=1,mbs=2", "--parallel.dp 2 --parallel.pp 2 --train.grad_accum 4 --parallel.zero 1", 4},
      {"dp=2,pp=2,zero=2,mbs=2", "--parallel.dp 2 --parallel.pp 2 --train.grad_accum 4 --parallel.zero 2", 4},
      {"dp=2,pp=2,zero=3,mbs=2", "--parallel.dp 2 --parallel.pp 2 --train.grad_accum 4 --parallel.zero 3", 4},
      {"tp=2,pp=2,mbs=4", "--parallel.tp 2 --parallel.pp 2 --train.grad_accum 4", 4},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.plan);
    CliRun run = r.train("out", fmt::format("--model.n_layer {} --model.n_head {} --model.n_embd {} --data.seq_len {} "
                                            "--train.batch_size {} --train.steps 2 --train.eval_every 0 "
                                            "--train.sample_tokens 0 --train.threads 1 --overwrite {}",
                                            L, H, C, T, batch, c.train));
    ASSERT_EQ(run.code, 0) << run.err;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(run.out, m, std::regex(R"(\(padded ([0-9]+)\))"))) << run.out;
    const int vocab = std::stoi(m[1].str());
    std::ofstream(r.root / "model.toml") << fmt::format(
        "[model]\nname = \"truth\"\nlayers = {}\nhidden = {}\nheads = {}\nvocab = {}\nseq = {}\n", L, C, H, vocab, T);
    CliRun plan = loom_cli(fmt::format("plan --model '{}' --cluster cpu --gpus {} --global-batch {} --seq {} --precision "
                                       "f32 --layout {} --json",
                                       (r.root / "model.toml").string(), c.ranks, batch, T, c.plan),
                           r.root / "logs");
    ASSERT_EQ(plan.code, 0) << plan.err;
    const nlohmann::json p = nlohmann::json::parse(plan.out);
    double predicted = 0;
    for (const auto& [tag, bytes] : p["memory_bytes_per_gpu"].items()) predicted += bytes.get<double>();
    std::ifstream in(r.root / "out" / "memory.json");
    const nlohmann::json mem = nlohmann::json::parse(in);
    ASSERT_EQ(int(mem["ranks"].size()), c.ranks);
    double measured = 0;
    for (const auto& rank : mem["ranks"]) measured = std::max(measured, rank["all_tags_peak_bytes"].get<double>());
    const double err = (predicted - measured) / measured;
    EXPECT_LE(std::fabs(err), 0.05) << "predicted " << predicted << " B, measured " << measured << " B";
    std::printf("%-28s measured %.3f MiB, predicted %.3f MiB (%+.1f%%)\n", c.plan.c_str(), measured / 1048576.0,
                predicted / 1048576.0, 100 * err);
  }
}

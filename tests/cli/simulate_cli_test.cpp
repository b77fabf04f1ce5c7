// `loom simulate` (issue "How to choose"): one layout's predicted step, drawn from the schedule's
// own instruction lists with the planner's durations, beside the computes a `loom train --trace`
// of the same layout measured; a trace without pipeline computes and a layout that is not one are
// refused naming them.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>

#include <fmt/format.h>

#include "cli_util.h"

using namespace loom::test;

TEST(SimulateCli, DrawsThePredictionBesideTheMeasuredTrace) {
  LOOM_REQUIRE_LOOM();
  TrainScratch r("loom_simulate_cli");
  const std::string model = "--model.n_layer 4 --model.n_head 4 --model.n_embd 128 --data.seq_len 64 "
                            "--train.batch_size 16 --train.steps 2 --train.eval_every 0 --train.sample_tokens 0 "
                            "--train.threads 1";
  const std::string trace = (r.root / "pp.json").string(), dp_trace = (r.root / "dp.json").string();
  CliRun pp = r.train("pp", fmt::format("{} --parallel.pp 2 --train.grad_accum 4 --trace '{}'", model, trace));
  ASSERT_EQ(pp.code, 0) << pp.err;
  {
    // Each compute carries its rank thread's CPU time (at most its duration: the rest is time the
    // OS ran another thread on its core).
    std::ifstream f(trace);
    const nlohmann::json j = nlohmann::json::parse(f);
    int computes = 0;
    for (const auto& e : j.at("traceEvents")) {
      if (e.at("ph") != "X") continue;
      ++computes;
      const double cpu_ms = e.at("args").at("cpu_ms").get<double>(), dur_ms = e.at("dur").get<double>() / 1e3;
      EXPECT_GT(cpu_ms, 0) << e.dump();
      EXPECT_LE(cpu_ms, dur_ms + 0.05) << e.dump();  // two clocks read apart: 50 us of slack
    }
    EXPECT_EQ(computes, 2 * 8);  // 2 ranks x (4 forwards + 4 backwards) of the last step
  }
  std::smatch m;
  ASSERT_TRUE(std::regex_search(pp.out, m, std::regex(R"(\(padded ([0-9]+)\))"))) << pp.out;
  std::ofstream(r.root / "model.toml") << fmt::format(
      "[model]\nname = \"sim\"\nlayers = 4\nhidden = 128\nheads = 4\nvocab = {}\nseq = 64\n", m[1].str());
  const std::string job = fmt::format("--model '{}' --cluster cpu --gpus 2 --global-batch 16 --seq 64 --precision f32",
                                      (r.root / "model.toml").string());
  const std::string png = (r.root / "sim.png").string();
  CliRun sim = loom_cli(fmt::format("simulate {} --layout pp=2,schedule=1f1b,mbs=4 --png '{}' --trace '{}'", job, png,
                                    trace),
                        r.root / "logs");
  // A build without Cairo says so instead of drawing.
  if (sim.code != 0 && sim.err.find("Cairo") != std::string::npos) GTEST_SKIP() << sim.err;
  ASSERT_EQ(sim.code, 0) << sim.err;
  EXPECT_TRUE(std::regex_search(sim.out, std::regex(R"(predicted step [0-9.]+ ms, measured [0-9.]+ ms)"))) << sim.out;
  ASSERT_TRUE(std::filesystem::exists(png));
  std::ifstream f(png, std::ios::binary);
  char sig[8] = {};
  f.read(sig, 8);
  EXPECT_EQ(std::string(sig + 1, 3), "PNG");

  // Without a trace: the prediction alone.
  CliRun alone = loom_cli(fmt::format("simulate {} --layout pp=2,schedule=zb-h1,mbs=4 --png '{}'", job, png),
                          r.root / "logs");
  EXPECT_EQ(alone.code, 0) << alone.err;
  EXPECT_EQ(alone.out.find("measured"), std::string::npos) << alone.out;

  // A data-parallel run's trace has no pipeline computes; 3 heads do not split over tp = 2.
  CliRun dp = r.train("dp", fmt::format("{} --parallel.dp 2 --trace '{}'", model, dp_trace));
  ASSERT_EQ(dp.code, 0) << dp.err;
  CliRun no_pipe = loom_cli(fmt::format("simulate {} --layout pp=2,mbs=4 --png '{}' --trace '{}'", job, png, dp_trace),
                            r.root / "logs");
  EXPECT_NE(no_pipe.code, 0);
  EXPECT_NE(no_pipe.err.find("no pipeline computes"), std::string::npos) << no_pipe.err;
  CliRun bad = loom_cli(fmt::format("simulate {} --layout tp=3 --png '{}'", job, png), r.root / "logs");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("--layout"), std::string::npos) << bad.err;
  // A --png that is a folder is refused before the work and left as it was; a device is written in
  // place (the picture's temporary file was renamed over /dev/null).
  CliRun folder = loom_cli(fmt::format("simulate {} --layout pp=2,mbs=4 --png '{}'", job, (r.root / "logs").string()),
                           r.root / "logs");
  EXPECT_NE(folder.code, 0);
  EXPECT_NE(folder.err.find("--png = " + (r.root / "logs").string() + ": is a directory"), std::string::npos)
      << folder.err;
  EXPECT_TRUE(std::filesystem::is_directory(r.root / "logs"));
  CliRun null = loom_cli(fmt::format("simulate {} --layout pp=2,mbs=4 --png /dev/null", job), r.root / "logs");
  EXPECT_EQ(null.code, 0) << null.err;
  EXPECT_FALSE(std::filesystem::is_regular_file("/dev/null"));
  EXPECT_FALSE(std::filesystem::exists("/dev/null.tmp"));
  // A key given twice is refused, not the last one taken.
  CliRun twice = loom_cli(fmt::format("simulate {} --layout pp=2,pp=4 --png '{}'", job, png), r.root / "logs");
  EXPECT_NE(twice.err.find("--layout: pp is given twice"), std::string::npos) << twice.err;
}

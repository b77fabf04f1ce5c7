// `loom train --plan auto` (issue "How to choose"): the run takes the planner's first choice of
// layout for its number of ranks, says what it chose, and trains with it; a memory limit steers
// the choice to a layout that splits the model, and trains under it; what cannot be planned is
// refused naming why. On the CPU and on the emulated device (a GPU's pools, planned with `loom
// plan --precision device`); the GPU's own case is tests/train/train_cuda_test.cu's.
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
#include "plan/planner.h"

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

// Through `loom train` on `device` (its flags in `device_flags`): refused where nothing fits, the
// first choice's predicted memory the measured one within 5%, and under a tighter limit a layout
// needing less that trains within it.
void trains_with_the_first_choice(const std::string& name, const std::string& device_flags) {
  TrainScratch r(name);
  const std::string model = fmt::format("{} {}", kModel, device_flags);
  // Nothing of two ranks fits 1 MB: the refusal names the limit and what the least demanding
  // layout needs.
  CliRun none = r.train("none", fmt::format("{} --parallel.dp 2 --plan auto --train.memory_limit 1000000", model));
  EXPECT_NE(none.code, 0);
  EXPECT_NE(none.err.find("--plan auto: no layout of 2 ranks fits"), std::string::npos) << none.err;
  EXPECT_NE(none.err.find("train.memory_limit"), std::string::npos) << none.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(none.err, m, std::regex(R"(the least any needs is ([0-9.]+) MiB per rank \(\S+\), )"
                                                        R"(which fits a limit of ([0-9.]+) MiB)")))
      << none.err;
  const double least_mib = std::stod(m[1].str()), least_limit_mib = std::stod(m[2].str());
  EXPECT_NEAR(least_limit_mib, least_mib / loom::plan::kUsableMemory, 0.011) << none.err;

  CliRun run = r.train("free", fmt::format("{} --parallel.dp 2 --plan auto", model));
  ASSERT_EQ(run.code, 0) << run.err;
  const Chosen free = chosen(run.out);
  ASSERT_FALSE(free.layout.empty()) << run.out;
  // The choice keeps the two ranks, and its predicted memory is what the ranks' pools reach.
  std::ifstream in(r.root / "free" / "memory.json");
  EXPECT_EQ(nlohmann::json::parse(in)["ranks"].size(), 2u);
  const double measured = measured_mib(r.root / "free");
  EXPECT_LE(std::abs(free.predicted_mib - measured) / measured, 0.05)
      << free.layout << ": predicted " << free.predicted_mib << " MiB, measured " << measured << " MiB";

  // A limit halfway between what the least demanding layout and the first choice need (each within
  // the planner's margin): the first choice no longer fits, so the run takes one that needs less,
  // and trains under the limit. (Which layout is first depends on the host's rates, e.g. its
  // OpenMP threads; the limit follows it.)
  ASSERT_LT(least_mib, free.predicted_mib) << free.layout << " is already the layout needing least memory";
  const int64_t limit = int64_t((least_mib + free.predicted_mib) / 2 / loom::plan::kUsableMemory * 1048576.0);
  CliRun tight = r.train("tight", fmt::format("{} --parallel.dp 2 --plan auto --train.memory_limit {}", model, limit));
  ASSERT_EQ(tight.code, 0) << tight.err << tight.out;
  const Chosen split = chosen(tight.out);
  ASSERT_FALSE(split.layout.empty()) << tight.out;
  EXPECT_NE(split.layout, free.layout);
  EXPECT_LT(split.predicted_mib, free.predicted_mib) << split.layout;
  EXPECT_LE(measured_mib(r.root / "tight") * 1048576.0, double(limit)) << split.layout;
  std::printf("  %s: free: %s (%.2f MiB measured); under %.2f MiB: %s (%.2f MiB measured); the least any needs: %.2f MiB\n",
              device_flags.c_str(), free.layout.c_str(), measured, double(limit) / 1048576.0, split.layout.c_str(),
              measured_mib(r.root / "tight"), least_mib);
}

}  // namespace

TEST(PlanAutoCli, TrainsWithThePlannersFirstChoice) {
  LOOM_REQUIRE_LOOM();
  trains_with_the_first_choice("loom_plan_auto_cli", "--train.device cpu");
  TrainScratch r("loom_plan_auto_bad_cli");
  // Layout fields the config gave are replaced by the plan's, and the line says which; an
  // activation budget (optimal recomputation's) is refused: the plan chooses the policy.
  CliRun given = r.train("given", fmt::format("{} --parallel.dp 2 --parallel.zero 3 --memory.recompute every-k "
                                              "--plan auto",
                                              kModel));
  ASSERT_EQ(given.code, 0) << given.err;
  EXPECT_NE(given.out.find("in place of the config's "), std::string::npos) << given.out;
  EXPECT_NE(given.out.find("memory.recompute every-k -> "), std::string::npos) << given.out;  // (never chosen)
  if (chosen(given.out).layout.find("zero=3") == std::string::npos) {
    EXPECT_NE(given.out.find("parallel.zero 3 -> "), std::string::npos) << given.out;
  }
  CliRun budget = r.train("budget", fmt::format("{} --parallel.dp 2 --memory.recompute optimal "
                                               "--memory.activation_budget 100000 --plan auto",
                                               kModel));
  EXPECT_NE(budget.code, 0);
  EXPECT_NE(budget.err.find("--plan auto: chooses memory.recompute (none, selective or full) to fit "
                            "train.memory_limit; memory.activation_budget"),
            std::string::npos)
      << budget.err;
  CliRun bad = r.train("bad", fmt::format("{} --plan manual", kModel));
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("--plan"), std::string::npos) << bad.err;
}

// The emulated device: the ranks hold what GPUs' pools hold (bf16 compute copies and activations,
// f32 masters; `loom plan --precision device`), and the planner's device accounting chooses.
TEST(PlanAutoCli, PlansTheEmulatedDevicesPools) {
  LOOM_REQUIRE_LOOM();
  trains_with_the_first_choice("loom_plan_auto_emu_cli", "--train.device emu");
  // A Llama-family model (grouped-query heads, SwiGLU of its own width, no biases, rotary
  // positions): the planner sizes what the run builds (it saw a GPT-2 of the same width: 12.86 MiB
  // predicted for 27.48 measured).
  trains_with_the_first_choice("loom_plan_auto_llama_cli",
                               "--train.device emu --model.preset llama-tiny --model.ffn_hidden 1024");
  TrainScratch r("loom_plan_auto_emu_line_cli");
  CliRun run = r.train("emu", fmt::format("{} --train.device emu --parallel.dp 2 --plan auto", kModel));
  ASSERT_EQ(run.code, 0) << run.err;
  EXPECT_NE(run.out.find("the emulated device planned as this host's CPU ranks"), std::string::npos) << run.out;
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

// `loom plan` where nothing fits: exit 1, and the layout needing least memory per device, with the
// device memory that would fit it.
TEST(PlanCli, NothingFitsNamesTheLeastDemandingLayout) {
  LOOM_REQUIRE_LOOM();
  const auto logs = std::filesystem::temp_directory_path() / ("loom_plan_cli_" + std::to_string(::getpid()));
  std::filesystem::create_directories(logs);
  CliRun r = loom_cli("plan --model llama3-405b --gpus 8 --global-batch 16", logs);
  std::filesystem::remove_all(logs);
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.out.find("0 fit"), std::string::npos) << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(the least any needs is ([0-9.]+) GB per device \((\S+)\): )"
                                                     R"(it needs a device of at least ([0-9.]+) GB)")))
      << r.out;
  EXPECT_GT(std::stod(m[1].str()), 80.0) << r.out;  // more than an A100's 80 GB
  EXPECT_NEAR(std::stod(m[3].str()), std::stod(m[1].str()) / loom::plan::kUsableMemory, 0.011) << r.out;
  EXPECT_NO_THROW(loom::plan::parse_layout(m[2].str())) << r.out;
  // Devices no layout divides: said why, not only "no layout fits".
  std::filesystem::create_directories(logs);
  CliRun seven = loom_cli("plan --gpus 7 --global-batch 64", logs);
  std::filesystem::remove_all(logs);
  EXPECT_EQ(seven.code, 1) << seven.err;
  EXPECT_NE(seven.out.find("0 layouts considered"), std::string::npos) << seven.out;
  EXPECT_NE(seven.out.find("no layout divides 7 devices for this job: dp x tp x pp x cp must be the devices"),
            std::string::npos)
      << seven.out;
}

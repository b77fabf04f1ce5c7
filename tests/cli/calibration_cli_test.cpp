// The GEMM peak behind the MFU `loom train` prints: a host calibration (src/plan/calibration.h)
// is reused across runs when it is the larger figure, and no MFU above 100% is ever printed or
// recorded (a peak below what the steps reach, measured while the host was busy, is raised to it
// and the run says so). `loom calibrate` writes the cache it reads.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <vector>

#include <fmt/format.h>

#include "cli_util.h"
#include "plan/calibration.h"
#include "train/run_util.h"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::test;

namespace {

struct CacheDir {
  fs::path dir = fs::temp_directory_path() / fmt::format("loom_calibration_{}", ::getpid());
  CacheDir() {
    fs::remove_all(dir);
    fs::create_directories(dir);
    setenv("LOOM_CACHE_DIR", dir.c_str(), 1);
  }
  ~CacheDir() {
    unsetenv("LOOM_CACHE_DIR");
    fs::remove_all(dir);
  }
};

const char* kSmall =
    "--model.n_layer 1 --model.n_head 2 --model.n_embd 32 --data.seq_len 16 --train.batch_size 2 --train.steps 3 "
    "--train.eval_every 0 --train.sample_tokens 0 --train.threads 1 --train.log_every 1";

}  // namespace

// A cached calibration larger than the quick measurement is the peak, and the header says so.
TEST(CalibrationCli, ACachedCalibrationIsThePeakWhenLarger) {
  LOOM_REQUIRE_LOOM();
  CacheDir cache;
  TrainScratch s("loom_calibration_cli");
  plan::HostProfile p;
  p.cpu = plan::host_cpu_name();
  p.cores = plan::host_cores();
  p.threads = 1;
  p.gemm_peak = 1e15;  // far above any CPU: every MFU is tiny
  p.source = "the test";
  p.date = "2026-01-02";
  plan::save_profile(p);
  CliRun r = s.train("cached", kSmall, fmt::format("LOOM_CACHE_DIR='{}'", cache.dir.string()));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("GEMM peak (calibrated 2026-01-02 by the test) 1000.0 TFLOP/s"), std::string::npos) << r.out;
  for (const auto& [step, mfu] : read_metrics(s.root / "cached" / "metrics.jsonl", "mfu")) EXPECT_LT(mfu, 1e-3);
}

// A peak below what the steps reach (as measured on a busy host) never yields an MFU above 100%.
TEST(CalibrationCli, NoMfuAboveOneHundredPercent) {
  TrainScratch s("loom_calibration_mfu");
  train::TrainConfig cfg;
  cfg.steps = 3;
  cfg.batch_size = 2;
  cfg.seq_len = 16;
  cfg.log_every = 1;
  const std::string metrics = (s.root / "metrics.jsonl").string();
  {
    // 1 FLOP/s of peak: every step is "faster than the peak".
    train::RunLog log(cfg, metrics, 0, /*lead=*/true, /*quiet=*/true, /*flops_per_token=*/1e6, /*peak=*/1.0, 5.0);
    for (int64_t step = 1; step <= 3; ++step) log.record(step, 4.0, 1e-3f, 1.0, 0.01 * double(step));
  }
  const auto mfu = read_metrics(s.root / "metrics.jsonl", "mfu");
  ASSERT_EQ(mfu.size(), 3u);
  for (const auto& [step, m] : mfu) EXPECT_LE(m, 1.0) << "step " << step;
  EXPECT_DOUBLE_EQ(mfu.at(1), 1.0);  // the first step raises the peak to its own rate
  EXPECT_LT(mfu.at(3), 1.0);         // later, slower steps are a share of it
}

// loom calibrate measures and caches this host; the cache holds one entry per thread count.
TEST(CalibrationCli, CalibrateWritesTheCache) {
  LOOM_REQUIRE_LOOM();
  CacheDir cache;
  CliRun r = loom_cli("calibrate --threads 1 --seconds 0.02", cache.dir,
                      fmt::format("LOOM_CACHE_DIR='{}'", cache.dir.string()));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("f32 GEMM over transformer shapes"), std::string::npos) << r.out;
  const auto p = plan::cached_profile(1);
  ASSERT_TRUE(p.has_value());
  EXPECT_GT(p->gemm_peak, 1e8);
  EXPECT_GE(p->gemm_peak, p->gemm_typical);
  EXPECT_GE(p->gemm_peak, p->gemm_small);  // the peak is the best rate measured, at any size
  EXPECT_GT(p->gemm_small, 1e8);  // the small products' rate, for the planner's size effect
  EXPECT_GT(p->memory_bw, 1e8);
  // loom's own kernels and the linear layers' grid, for the planner's cpu profile.
  for (const char* k : plan::kKernelNames) {
    ASSERT_TRUE(p->kernels.count(k)) << k;
    EXPECT_GT(p->kernels.at(k).unit, 0) << k;
  }
  EXPECT_GE(p->linear.size(), 8u);
  for (const plan::LinearRate& x : p->linear) EXPECT_GT(x.forward, 1e8) << x.tokens << " x " << x.width;
  // loom's own blocks: one rank (one thread) at 64, 256 and 1024 tokens of widths 128 and 384.
  ASSERT_EQ(p->blocks.size(), 6u);
  for (const plan::BlockTime& b : p->blocks) {
    EXPECT_EQ(b.ranks, 1);
    for (double t : {b.layer_forward, b.layer_backward, b.head_forward, b.head_backward}) EXPECT_GT(t, 0) << b.tokens;
  }
  EXPECT_LT(p->blocks.front().layer_forward, p->blocks[2].layer_forward);  // 64 against 1024 tokens
  // The OS's scheduling of one-thread ranks (the pipeline simulation's wake-ups and balancing):
  // measured, and bounded by the waits that measure them (0.2 s for the balance).
  EXPECT_NE(r.out.find("a rank asleep in a receive runs"), std::string::npos) << r.out;
  EXPECT_GT(p->wake, 0);
  EXPECT_LT(p->wake, 0.1);
  EXPECT_GT(p->crowded_wake, 0);
  EXPECT_LT(p->crowded_wake, 0.1);
  EXPECT_GE(p->balance, 0);
  EXPECT_LE(p->balance, 0.2 + 0.05);
  EXPECT_EQ(p->source, "loom calibrate");
  EXPECT_FALSE(plan::cached_profile(7).has_value());
}

// An entry whose numbers no measurement gives (edited or corrupt) is ignored as a missing one is,
// so nothing divides by it: a negative latency gave a negative step time, a tiny GEMM rate an
// infinite MFU, a small-product rate above the peak an MFU above 100%. A cache that cannot be read
// (a folder under its name) is ignored too, and a training run still runs.
TEST(CalibrationCli, AnEntryOfImpossibleNumbersOrAnUnreadableCacheIsIgnored) {
  LOOM_REQUIRE_LOOM();
  CacheDir cache;
  auto good = [] {
    plan::HostProfile p;
    p.cpu = plan::host_cpu_name();
    p.cores = plan::host_cores();
    p.threads = 1;
    p.gemm_peak = 1e11;
    p.gemm_typical = 8e10;
    p.gemm_small = 2e10;
    p.memory_bw = 1e10;
    p.allreduce_latency = 1e-5;
    p.allreduce_bw = 1e9;
    p.source = "the test";
    p.date = "2026-01-02";
    return p;
  };
  plan::save_profile(good());
  ASSERT_TRUE(plan::cached_profile(1).has_value());
  const std::vector<std::pair<const char*, std::function<void(plan::HostProfile&)>>> bad{
      {"a negative all-reduce latency", [](plan::HostProfile& p) { p.allreduce_latency = -1; }},
      {"a latency of hours", [](plan::HostProfile& p) { p.crowded_sync = 3600; }},
      {"a GEMM peak of 1 FLOP/s", [](plan::HostProfile& p) { p.gemm_peak = 1; }},
      {"a GEMM peak of 1e30 FLOP/s", [](plan::HostProfile& p) { p.gemm_peak = 1e30; }},
      {"a small-product rate above the peak", [](plan::HostProfile& p) { p.gemm_small = 2e11; }},
      {"a median rate above the peak", [](plan::HostProfile& p) { p.gemm_typical = 2e11; }},
      {"a memory bandwidth of 1 byte/s", [](plan::HostProfile& p) { p.memory_bw = 1; }},
  };
  for (const auto& [what, spoil] : bad) {
    plan::HostProfile p = good();
    spoil(p);
    plan::save_profile(p);
    EXPECT_FALSE(plan::cached_profile(1).has_value()) << what;
  }
  // A kernel, linear-layer or block figure out of range drops that figure, not the entry.
  plan::HostProfile p = good();
  p.kernels["adamw"] = plan::KernelCost{1e-6, 1e-30};
  p.kernels["gelu_forward"] = plan::KernelCost{1e-6, 1e-9};
  p.linear = {{64, 128, 1e-3, 1e10}, {64, 256, 1e10, 1e10}};
  plan::save_profile(p);
  auto q = plan::cached_profile(1);
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(q->kernels.size(), 1u);
  EXPECT_EQ(q->linear.size(), 1u);

  fs::remove(fs::path(plan::calibration_path()));
  fs::create_directories(fs::path(plan::calibration_path()));
  EXPECT_FALSE(plan::cached_profile(1).has_value());
  TrainScratch s("loom_calibration_unreadable");
  CliRun r = s.train("folder", kSmall, fmt::format("LOOM_CACHE_DIR='{}'", cache.dir.string()));
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("GEMM peak (measured now)"), std::string::npos) << r.out;
}

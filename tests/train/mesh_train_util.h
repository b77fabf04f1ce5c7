// The fixture of the `loom train` mesh tests (tensor, sequence, context and pipeline parallelism,
// threads and MPI): a tiny corpus, the loom executable run with a tiny model, and readers of the
// metrics and checkpoints it writes.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "checkpoint_util.h"
#include "cli_util.h"
#include "data/shard.h"
#include "train/checkpoint.h"
#include "train/safetensors.h"

namespace loom::test {

namespace fs = std::filesystem;

class MeshTrainFixture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = fs::temp_directory_path() / fmt::format("loom_train_parallel_{}", ::getpid());
    fs::create_directories(root_ / "data");
    // A noisy repeating pattern over a vocabulary of 97 (not divisible by tp: padded shards).
    std::mt19937 g(11);
    std::vector<uint32_t> toks(20000);
    for (size_t i = 0; i < toks.size(); ++i) toks[i] = (g() % 4 == 0) ? g() % 97 : uint32_t((i * 7) % 97);
    data::write_shard((root_ / "data" / "train_000.bin").string(), toks, 97);
    data::write_shard((root_ / "data" / "val_000.bin").string(),
                      std::vector<uint32_t>(toks.begin(), toks.begin() + 2000), 97);
  }
  static void TearDownTestSuite() {
    fs::remove_all(root_);
    ref_done_.clear();
  }

  // `steps` steps of the tiny model into root/out, with `layout` (more options, overriding these)
  // appended; `prefix` goes before the executable (environment variables, mpirun ...).
  static CmdRun train_steps(const std::string& out, const std::string& layout, int steps,
                            const std::string& prefix = "", bool quiet = true) {
    return sh(fmt::format(
        "{}{} train{} --data.dir {} --train.out_dir {} --model.n_layer 2 --model.n_head 4 --model.n_embd 32 "
        "--data.seq_len 16 --train.batch_size 4 --train.grad_accum 2 --train.steps {} --train.eval_every 5 "
        "--train.eval_batches 2 --train.sample_tokens 0 --train.threads 1 --optim.warmup_steps 2 --optim.lr 3e-3 {}",
        prefix.empty() ? "" : prefix + " ", kLoom, quiet ? " --quiet" : "", (root_ / "data").string(), (root_ / out).string(), steps, layout));
  }
  static CmdRun train(const std::string& out, const std::string& layout, const std::string& prefix = "") {
    return train_steps(out, layout, 10, prefix);
  }
  // step -> value of `key` in root/out/metrics.jsonl.
  static std::map<int64_t, double> metric(const std::string& out, const char* key) {
    return read_metrics(root_ / out / "metrics.jsonl", key);
  }
  // Every full tensor of the latest checkpoint of root/out.
  static std::map<std::string, std::vector<float>> state(const std::string& out) {
    return checkpoint_tensors(train::latest_checkpoint((root_ / out).string()));
  }
  // The single-device reference of a run length, run once for the suite.
  static std::string ref_dir(int steps) { return steps == 10 ? "ref" : fmt::format("ref{}", steps); }
  static void ensure_reference(int steps = 10) {
    if (ref_done_.count(steps)) return;
    CmdRun r = train_steps(ref_dir(steps), "", steps);
    ASSERT_EQ(r.status, 0) << r.output;
    ref_done_.insert(steps);
  }

  // Every loss and validation loss of root/out within 1e-5 relative of the single-device run's.
  // (`ref`: another run of `steps` steps to compare with instead.)
  static void expect_losses_near_reference(const std::string& out, const std::string& what, int steps = 10,
                                           const std::string& ref = "") {
    if (ref.empty()) ensure_reference(steps);
    for (const char* key : {"loss", "val_loss"}) {
      auto want = metric(ref.empty() ? ref_dir(steps) : ref, key), got = metric(out, key);
      ASSERT_EQ(got.size(), want.size()) << what << " " << key;
      ASSERT_EQ(want.size(), size_t(std::string(key) == "loss" ? steps : steps / 5));
      double worst = 0;
      for (auto& [step, v] : want) {
        ASSERT_EQ(got.count(step), 1u) << what << " " << key << " step " << step;
        const double rel = std::abs(got[step] - v) / std::abs(v);
        worst = std::max(worst, rel);
        EXPECT_LE(rel, kTol) << what << " " << key << " step " << step << ": " << got[step] << " vs " << v;
      }
      std::printf("%-44s %-8s max relative difference %.2e over %zu steps\n", what.c_str(), key, worst, want.size());
    }
  }

  // Runs `layout` for `steps` steps and compares every loss and validation loss with the
  // single-device run.
  static void expect_same_losses(const std::string& out, const std::string& layout, int steps = 10) {
    ensure_reference(steps);
    CmdRun r = train_steps(out, layout, steps);
    ASSERT_EQ(r.status, 0) << layout << "\n" << r.output;
    expect_losses_near_reference(out, layout, steps);
  }

  // The metric lines of two runs hold the same steps and bit-identical values of `keys` (the
  // JSON text of each double is its shortest round-trip form).
  static void expect_identical_metrics(const std::string& a, const std::string& b,
                                       std::initializer_list<const char*> keys) {
    for (const char* key : keys) {
      auto x = metric(a, key), y = metric(b, key);
      ASSERT_FALSE(x.empty()) << a << " has no " << key;
      ASSERT_EQ(x.size(), y.size()) << a << " vs " << b << " " << key;
      for (auto& [step, v] : x) {
        ASSERT_EQ(y.count(step), 1u) << b << " lacks " << key << " of step " << step;
        EXPECT_EQ(nlohmann::json(v).dump(), nlohmann::json(y[step]).dump()) << key << " step " << step;
      }
    }
  }

  // The final checkpoints of two runs hold the same tensors, bit for bit, and the same step
  // counters.
  static void expect_identical_checkpoints(const std::string& a, const std::string& b) {
    const std::string ca = train::latest_checkpoint((root_ / a).string()), cb = train::latest_checkpoint((root_ / b).string());
    ASSERT_FALSE(ca.empty()) << a;
    ASSERT_FALSE(cb.empty()) << b;
    auto ma = train::read_checkpoint_meta(ca), mb = train::read_checkpoint_meta(cb);
    EXPECT_EQ(ma.step, mb.step);
    EXPECT_EQ(ma.optimizer_steps, mb.optimizer_steps);
    const auto x = checkpoint_tensors(ca), y = checkpoint_tensors(cb);
    ASSERT_EQ(x.size(), y.size());
    for (const auto& [name, u] : x) {
      ASSERT_TRUE(y.count(name)) << b << " lacks " << name;
      const auto& v = y.at(name);
      ASSERT_EQ(u.size(), v.size()) << name;
      EXPECT_EQ(std::memcmp(u.data(), v.data(), u.size() * sizeof(float)), 0) << name << " differs";
    }
  }

  static constexpr double kTol = 1e-5;
  static inline fs::path root_;
  static inline std::set<int> ref_done_;
};

}  // namespace loom::test

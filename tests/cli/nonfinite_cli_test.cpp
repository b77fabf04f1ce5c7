// A step whose loss or gradient norm is not finite is skipped (no update), said with where the
// first non-finite value was, and written to metrics.jsonl as skipped; after train.skip_nonfinite
// of them in a row, or at its end inside such a streak, the run stops with an error naming the
// step, the place and the field, keeping the checkpoints before (none is written inside a streak). NaNs come from LOOM_FAULT_INJECT (kind=nan: one step's gradients;
// kind=nan_weight: a weight from then on), on one rank of several layouts.
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

struct NanRun : TrainScratch {
  NanRun() : TrainScratch("loom_nonfinite_cli") {}
  CliRun train(const std::string& out, const std::string& args, const std::string& fault) {
    return TrainScratch::train(out,
                               "--model.n_layer 1 --model.n_head 2 --model.n_embd 32 --data.seq_len 16 "
                               "--train.batch_size 4 --train.steps 6 --train.eval_every 0 --train.sample_tokens 0 "
                               "--train.threads 2 --train.checkpoint_every 2 --overwrite " + args,
                               fault.empty() ? "" : "LOOM_FAULT_INJECT=" + fault);
  }
  std::string metrics(const std::string& out) {
    std::ifstream f(root / out / "metrics.jsonl");
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
};

}  // namespace

TEST(NonFiniteCli, OneBadStepIsSkippedAndTheRunGoesOn) {
  LOOM_REQUIRE_LOOM();
  NanRun r;
  for (const std::string layout : {"", "--parallel.dp 2 --parallel.zero 3", "--parallel.tp 2 --parallel.dp 2"}) {
    SCOPED_TRACE(layout);
    CliRun run = r.train("transient", layout, layout.empty() ? "rank=0,step=3,kind=nan" : "rank=1,step=3,kind=nan");
    ASSERT_EQ(run.code, 0) << run.out << run.err;
    EXPECT_NE(run.out.find("step 3: the loss is"), std::string::npos) << run.out;
    EXPECT_NE(run.out.find("first non-finite: the gradient of"), std::string::npos) << run.out;
    EXPECT_NE(run.out.find("step skipped, no update (1 of train.skip_nonfinite = 3 in a row)"), std::string::npos)
        << run.out;
    const std::string m = r.metrics("transient");
    EXPECT_NE(m.find("\"skipped\":true"), std::string::npos) << m;
    EXPECT_NE(m.find("\"step\":6"), std::string::npos) << m;
    EXPECT_TRUE(fs::exists(r.root / "transient" / "ckpt_00000006"));
    // A skipped step makes no update and does not move the schedule (Megatron-LM's rule): step 4
    // runs at step 3's rate, inside the warm-up where every update raises it.
    const auto lr = read_metrics(r.root / "transient" / "metrics.jsonl", "lr");
    ASSERT_TRUE(lr.count(2) && lr.count(3) && lr.count(4) && lr.count(5)) << m;
    EXPECT_LT(lr.at(2), lr.at(3));
    EXPECT_EQ(lr.at(4), lr.at(3));
    EXPECT_LT(lr.at(4), lr.at(5));
  }
}

TEST(NonFiniteCli, ABadWeightStopsTheRunAfterTheSkipsAllowed) {
  LOOM_REQUIRE_LOOM();
  NanRun r;
  // (On the emulated device with the optimizer offloaded, the f32 master weights are the host's
  // alone: the weight is poisoned there and in the device's bf16 copy, and found in the masters.)
  for (const std::string layout : {"", "--parallel.dp 2", "--parallel.tp 2",
                                   "--train.device emu --parallel.dp 2 --parallel.zero 2 --parallel.offload true"}) {
    SCOPED_TRACE(layout);
    CliRun run = r.train("persistent", layout + " --train.skip_nonfinite 1", "rank=0,step=3,kind=nan_weight");
    EXPECT_NE(run.code, 0) << run.out;
    EXPECT_NE(run.err.find("step 4: the loss is nan"), std::string::npos) << run.err;
    EXPECT_NE(run.err.find("first non-finite: the weights of wte.weight"), std::string::npos) << run.err;
    EXPECT_NE(run.err.find("2 steps in a row not finite (train.skip_nonfinite = 1)"), std::string::npos) << run.err;
    EXPECT_TRUE(fs::exists(r.root / "persistent" / "ckpt_00000002"));
    EXPECT_FALSE(fs::exists(r.root / "persistent" / "ckpt_00000004"));
  }
  // A pipeline whose first stage's wte (not its last stage's copy, which the head reads) holds a
  // NaN: the batches look its row up, so the last stage's losses are NaN from step 4 on, within
  // train.skip_nonfinite = 3; no checkpoint is written inside the streak, and the run fails at its
  // end. (A NaN no batch looks up is refused by the checkpoint itself: sharded_checkpoint_test.)
  CliRun pipe = r.train("pipeline", "--parallel.pp 2", "rank=0,step=3,kind=nan_weight");
  EXPECT_NE(pipe.code, 0);
  EXPECT_NE(pipe.err.find("step 6: the run ends after 3 steps in a row not finite"), std::string::npos) << pipe.err;
  EXPECT_TRUE(fs::exists(r.root / "pipeline" / "ckpt_00000002"));
  EXPECT_FALSE(fs::exists(r.root / "pipeline" / "ckpt_00000004"));
  // A NaN in a weight the last stage reads: the loss is NaN, the steps are skipped, and the place
  // is found on the stage that holds it.
  CliRun last = r.train("pipeline_last", "--parallel.pp 2 --train.skip_nonfinite 1", "rank=1,step=3,kind=nan_weight");
  EXPECT_NE(last.code, 0);
  EXPECT_NE(last.err.find("step 4: the loss is nan"), std::string::npos) << last.err;
  EXPECT_NE(last.err.find("first non-finite: the weights of ln_f.weight"), std::string::npos) << last.err;
  // skip_nonfinite = 0: the first one stops the run.
  CliRun first = r.train("first", "--train.skip_nonfinite 0", "rank=0,step=3,kind=nan");
  EXPECT_NE(first.code, 0);
  EXPECT_NE(first.err.find("step 3: the loss is"), std::string::npos) << first.err;
  EXPECT_NE(first.err.find("1 step in a row not finite (train.skip_nonfinite = 0)"), std::string::npos) << first.err;
}

// Where the first non-finite value is names the rank that holds it: a weight of rank 1's full
// copy (ZeRO 0); a gradient in the copy of a replicated parameter (a LayerNorm weight) that the
// norm counts on another tensor-parallel rank, which must skip the step all the same (it used to
// be applied under tp x pp); and under offload the host's master weights are what is poisoned (the
// step would copy them back over a NaN in the working copy).
TEST(NonFiniteCli, TheRankHoldingTheValueIsNamed) {
  LOOM_REQUIRE_LOOM();
  NanRun r;
  CliRun dp = r.train("dp", "--parallel.dp 2 --train.skip_nonfinite 1", "rank=1,step=3,kind=nan_weight");
  EXPECT_NE(dp.code, 0);
  EXPECT_NE(dp.err.find("first non-finite: the weights of wte.weight, on rank 1"), std::string::npos) << dp.err;
  CliRun tpp = r.train("tp_pp", "--parallel.tp 2 --parallel.pp 2 --train.grad_accum 2", "rank=3,step=3,kind=nan");
  ASSERT_EQ(tpp.code, 0) << tpp.out << tpp.err;
  EXPECT_NE(tpp.out.find("step 3: the loss is"), std::string::npos) << tpp.out;
  EXPECT_NE(tpp.out.find("the gradient norm nan; first non-finite: the gradient of"), std::string::npos) << tpp.out;
  EXPECT_NE(tpp.out.find(", on rank 3: step skipped, no update"), std::string::npos) << tpp.out;
  EXPECT_TRUE(fs::exists(r.root / "tp_pp" / "ckpt_00000006"));
  CliRun off = r.train("offload",
                       "--parallel.dp 2 --parallel.pp 2 --train.grad_accum 2 --parallel.zero 1 --parallel.offload true",
                       "rank=0,step=3,kind=nan_weight");
  EXPECT_NE(off.code, 0) << off.out;
  EXPECT_NE(off.out.find("first non-finite: the weights of wte.weight, on rank 0"), std::string::npos) << off.out;
  EXPECT_NE(off.err.find("step 6: the run ends after 3 steps in a row not finite"), std::string::npos) << off.err;
  EXPECT_TRUE(fs::exists(r.root / "offload" / "ckpt_00000002"));
  EXPECT_FALSE(fs::exists(r.root / "offload" / "ckpt_00000004"));
  EXPECT_FALSE(fs::exists(r.root / "offload" / "ckpt_00000006"));
}

// A run whose last steps are skipped has diverged even within train.skip_nonfinite: it fails at its
// end naming the streak, writes no checkpoint inside the streak (its weights are what diverged),
// and `latest` stays the last checkpoint before it.
TEST(NonFiniteCli, ARunEndingInsideAStreakFailsAndKeepsTheCheckpointsBefore) {
  LOOM_REQUIRE_LOOM();
  NanRun r;
  CliRun run = r.train("streak", "", "rank=0,step=4,kind=nan_weight");
  EXPECT_NE(run.code, 0) << run.out;
  EXPECT_NE(run.out.find("step 4: checkpoint not written: the last step was not finite"), std::string::npos)
      << run.out;
  EXPECT_NE(run.err.find("step 6: the run ends after 3 steps in a row not finite (the last finite one at step 3)"),
            std::string::npos)
      << run.err;
  EXPECT_TRUE(fs::exists(r.root / "streak" / "ckpt_00000002"));
  EXPECT_FALSE(fs::exists(r.root / "streak" / "ckpt_00000004"));
  EXPECT_FALSE(fs::exists(r.root / "streak" / "ckpt_00000006"));
  std::ifstream latest(r.root / "streak" / "latest");
  std::string name;
  std::getline(latest, name);
  EXPECT_NE(name.find("ckpt_00000002"), std::string::npos) << name;
}

// An injected f16 overflow (kind=overflow) needs the loss scaling of train.precision fp16 on CUDA:
// the CPU engines refuse it by name at the step it fires, without touching gradients or weights,
// and the checkpoints before it stay.
TEST(NonFiniteCli, AnInjectedOverflowIsRefusedWithoutLossScaling) {
  LOOM_REQUIRE_LOOM();
  NanRun r;
  for (const std::string layout : {"", "--parallel.dp 2"}) {
    SCOPED_TRACE(layout);
    CliRun run = r.train("overflow", layout, "rank=0,step=3,kind=overflow");
    EXPECT_NE(run.code, 0) << run.out;
    EXPECT_NE(run.err.find("LOOM_FAULT_INJECT kind=overflow"), std::string::npos) << run.err;
    EXPECT_NE(run.err.find("no such aid"), std::string::npos) << run.err;
    EXPECT_TRUE(fs::exists(r.root / "overflow" / "ckpt_00000002"));
  }
}

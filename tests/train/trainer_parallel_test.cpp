// `loom train` under tensor, sequence, context and pipeline parallelism (with and without data
// parallelism, ZeRO 1-3 and offload over dp) equals the single-device run: every step's loss and every
// validation loss within 1e-5 relative, and the final checkpoints (full tensors gathered to rank
// 0) within ||p - p_ref|| / ||p_ref|| <= 1e-5, over all parameters and for each one (the key
// bias, whose gradient is exactly zero, only in the former). Unsupported combinations fail with
// an error naming the fields.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>

#include "train/mesh_train_util.h"

using namespace loom;
using namespace loom::test;

namespace {

class TrainParallel : public MeshTrainFixture {
 protected:
  // The final checkpoint holds the same tensor names as the single-device one, with parameters
  // within 1e-5 relative (each and all).
  void expect_same_checkpoint(const std::string& out, int steps = 10) {
    const auto want = state(ref_dir(steps)), got = state(out);
    ASSERT_EQ(got.size(), want.size());
    double d2 = 0, r2 = 0, worst = 0;
    for (const auto& [name, b] : want) {
      ASSERT_TRUE(got.count(name)) << out << " lacks " << name;
      if (name.rfind("param/", 0) != 0) continue;
      const auto& a = got.at(name);
      ASSERT_EQ(a.size(), b.size()) << name;
      // The key part of c_attn.bias adds q . b_k to every score of a query row, which softmax
      // cancels: its gradient is exactly zero, what the kernels compute is rounding noise that
      // AdamW normalises into full-size steps, different for any summation order. It counts in
      // the norm over all parameters but is not compared on its own.
      const bool key_bias = name.ends_with("attn.c_attn.bias");
      const size_t C = a.size() / 3;
      double pd = 0, pr = 0;
      for (size_t i = 0; i < a.size(); ++i) {
        const double d = (double(a[i]) - b[i]) * (double(a[i]) - b[i]), r = double(b[i]) * b[i];
        d2 += d;
        r2 += r;
        if (key_bias && i >= C && i < 2 * C) continue;
        pd += d;
        pr += r;
      }
      const double rel = std::sqrt(pd / pr);
      worst = std::max(worst, rel);
      EXPECT_LE(rel, kTol) << out << " " << name;
    }
    EXPECT_LE(std::sqrt(d2 / r2), kTol) << out;
    std::printf("%-44s checkpoint ||p - p_ref|| / ||p_ref|| = %.2e (worst parameter %.2e)\n", out.c_str(),
                std::sqrt(d2 / r2), worst);
  }

  // The final checkpoint's AdamW moments (adam_m/, adam_v/): ||m - m_ref|| / ||m_ref|| over all
  // parameters, for each moment, against another run's checkpoint.
  void expect_same_moments(const std::string& out, const std::string& ref, double tol) {
    const auto want = state(ref), got = state(out);
    for (const std::string prefix : {"adam_m/", "adam_v/"}) {
      double d2 = 0, r2 = 0;
      int n = 0;
      for (const auto& [name, b] : want) {
        if (name.rfind(prefix, 0) != 0) continue;
        ASSERT_TRUE(got.count(name)) << out << " lacks " << name;
        const auto& a = got.at(name);
        ASSERT_EQ(a.size(), b.size()) << name;
        for (size_t i = 0; i < a.size(); ++i) d2 += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), r2 += double(b[i]) * b[i];
        ++n;
      }
      ASSERT_GT(n, 0) << ref << " holds no " << prefix << " tensors";
      ASSERT_GT(r2, 0.0) << prefix;
      EXPECT_LE(std::sqrt(d2 / r2), tol) << out << " " << prefix << " vs " << ref;
      std::printf("%-44s %s ||m - m_ref|| / ||m_ref|| = %.2e vs %s\n", out.c_str(), prefix.c_str(), std::sqrt(d2 / r2),
                  ref.c_str());
    }
  }

};

}  // namespace

TEST_F(TrainParallel, TensorParallelMatchesSingleDevice) {
  LOOM_REQUIRE_LOOM();
  expect_same_losses("tp2", "--parallel.tp 2");
  expect_same_checkpoint("tp2");
}

TEST_F(TrainParallel, SequenceParallelMatchesSingleDevice) {
  LOOM_REQUIRE_LOOM();
  expect_same_losses("tp2_sp", "--parallel.tp 2 --parallel.sp true");
}

TEST_F(TrainParallel, ContextParallelMatchesSingleDevice) {
  LOOM_REQUIRE_LOOM();
  expect_same_losses("cp2", "--parallel.cp 2");
}

TEST_F(TrainParallel, TensorTimesDataParallelMatchesSingleDevice) {
  LOOM_REQUIRE_LOOM();
  expect_same_losses("tp2_dp2", "--parallel.tp 2 --parallel.dp 2");
  expect_same_checkpoint("tp2_dp2");
}

// ZeRO-1 over dp (moments sharded, gathered over dp for the checkpoint) composed with tensor,
// sequence and context parallelism, 20 steps.
TEST_F(TrainParallel, ZeroOneWithTensorParallelMatchesSingleDevice) {
  LOOM_REQUIRE_LOOM();
  expect_same_losses("tp2_dp2_zero1", "--parallel.tp 2 --parallel.dp 2 --parallel.zero 1", 20);
  expect_same_checkpoint("tp2_dp2_zero1", 20);
  expect_same_moments("tp2_dp2_zero1", ref_dir(20), kTol);
}

TEST_F(TrainParallel, ZeroOneWithSequenceParallelMatchesSingleDevice) {
  LOOM_REQUIRE_LOOM();
  expect_same_losses("tp2_sp_dp2_zero1", "--parallel.tp 2 --parallel.sp true --parallel.dp 2 --parallel.zero 1", 20);
  expect_same_checkpoint("tp2_sp_dp2_zero1", 20);
  expect_same_moments("tp2_sp_dp2_zero1", ref_dir(20), kTol);
}

TEST_F(TrainParallel, ZeroOneWithContextParallelMatchesSingleDevice) {
  LOOM_REQUIRE_LOOM();
  expect_same_losses("cp2_dp2_zero1", "--parallel.cp 2 --parallel.dp 2 --parallel.zero 1", 20);
  expect_same_checkpoint("cp2_dp2_zero1", 20);
  expect_same_moments("cp2_dp2_zero1", ref_dir(20), kTol);
}

// ZeRO-2 and -3 (gradients, then parameters sharded over dp x cp) and optimizer offload
// composed with tensor, sequence and context parallelism, 20 steps.
TEST_F(TrainParallel, ZeroTwoThreeAndOffloadWithTensorSequenceContextMatchSingleDevice) {
  LOOM_REQUIRE_LOOM();
  for (const auto& [name, layout] : std::vector<std::pair<std::string, std::string>>{
           {"tp2_dp2_zero2", "--parallel.tp 2 --parallel.dp 2 --parallel.zero 2"},
           {"tp2_sp_dp2_zero3", "--parallel.tp 2 --parallel.sp true --parallel.dp 2 --parallel.zero 3"},
           {"cp2_zero3", "--parallel.cp 2 --parallel.zero 3"},
           {"tp2_dp2_zero1_offload", "--parallel.tp 2 --parallel.dp 2 --parallel.zero 1 --parallel.offload true"},
           {"cp2_tp2_zero3_offload", "--parallel.cp 2 --parallel.tp 2 --parallel.zero 3 --parallel.offload true"}}) {
    expect_same_losses(name, layout, 20);
    expect_same_checkpoint(name, 20);
    expect_same_moments(name, ref_dir(20), kTol);
  }
}

// Activation recomputation composes with every layout of the one chain: ZeRO-3's gathers run
// again for the recomputed forward, tensor / sequence / context parallel blocks recompute their
// collectives.
TEST_F(TrainParallel, RecomputationWithEveryLayoutMatchesSingleDevice) {
  LOOM_REQUIRE_LOOM();
  expect_same_losses("recompute_full", "--memory.recompute full");
  expect_same_checkpoint("recompute_full");
  expect_same_losses("recompute_full_dp2_zero3", "--memory.recompute full --parallel.dp 2 --parallel.zero 3");
  expect_same_losses("recompute_sqrt_tp2_sp", "--memory.recompute sqrt --parallel.tp 2 --parallel.sp true");
  expect_same_losses("recompute_every_cp2", "--memory.recompute every-k --memory.recompute_every 2 --parallel.cp 2");
  expect_same_losses("recompute_selective_tp2_cp2", "--memory.recompute selective --parallel.tp 2 --parallel.cp 2");
  expect_same_checkpoint("recompute_every_cp2");
  // Pipeline stages recompute their own blocks, under every schedule (zero bubble's split
  // backward keeps the recomputed activations for the deferred weight gradients).
  expect_same_losses("recompute_full_pp2", "--memory.recompute full --parallel.pp 2 --parallel.schedule 1f1b");
  expect_same_checkpoint("recompute_full_pp2");
  expect_same_losses("recompute_every_pp2_zb", "--memory.recompute every-k --parallel.pp 2 --parallel.schedule zb-h1");
  expect_same_losses("recompute_selective_pp2_tp2",
                     "--memory.recompute selective --parallel.pp 2 --parallel.tp 2 --parallel.schedule interleaved");
  // Bit-identical to the same layout without recomputation: losses, parameters and moments.
  for (const auto& [name, layout] : std::vector<std::pair<std::string, std::string>>{
           {"dp2_zero3", "--parallel.dp 2 --parallel.zero 3"},
           {"tp2_sp", "--parallel.tp 2 --parallel.sp true"},
           {"pp2_zb", "--parallel.pp 2 --parallel.schedule zb-h1"}}) {
    ASSERT_EQ(train_steps("bits_none_" + name, layout, 20).status, 0) << layout;
    ASSERT_EQ(train_steps("bits_full_" + name, layout + " --memory.recompute full", 20).status, 0) << layout;
    expect_identical_metrics("bits_none_" + name, "bits_full_" + name, {"loss", "grad_norm", "val_loss"});
    expect_identical_checkpoints("bits_none_" + name, "bits_full_" + name);
  }
  // optimal under a pipeline: each stage plans for the micro-batches it keeps in flight. The
  // budget is a KiB under the fuller stage's peak without recomputation: that stage recomputes,
  // the run says so, every rank's saved activations stay within it, and the losses are the
  // single device's.
  const std::string pp = "--parallel.pp 2 --parallel.schedule 1f1b";
  ASSERT_EQ(train("optimal_pp2_none", pp).status, 0);
  auto peaks = [&](const std::string& out) {
    std::ifstream f(root_ / out / "memory.json");
    const nlohmann::json j = nlohmann::json::parse(f);
    std::vector<int64_t> v;
    for (const auto& r : j.at("ranks")) v.push_back(r.at("peak_bytes").at("activations").get<int64_t>());
    return v;
  };
  const std::vector<int64_t> none = peaks("optimal_pp2_none");
  const int64_t budget = *std::max_element(none.begin(), none.end()) - 1024;
  const std::string optimal = pp + fmt::format(" --memory.recompute optimal --memory.activation_budget {}", budget);
  CmdRun shown = train_steps("optimal_pp2_shown", optimal, 10, "", /*quiet=*/false);  // the header says the plan
  ASSERT_EQ(shown.status, 0) << shown.output;
  EXPECT_NE(shown.output.find("recompute optimal for memory.activation_budget"), std::string::npos) << shown.output;
  EXPECT_NE(shown.output.find("recomputes 1 of 1 blocks"), std::string::npos) << shown.output;
  for (int64_t a : peaks("optimal_pp2_shown")) EXPECT_LE(a, budget);
  expect_same_losses("optimal_pp2", optimal);
  // A budget no plan fits is refused naming the field.
  CmdRun small = train("optimal_pp2_small", pp + " --memory.recompute optimal --memory.activation_budget 1000");
  EXPECT_NE(small.status, 0);
  EXPECT_NE(small.output.find("memory.activation_budget"), std::string::npos) << small.output;
}

// Validation takes train.eval_batches batches of train.batch_size sequences whatever the
// micro-batch: grad_accum 1 and 4 give the reference's (grad_accum 2) losses and validation
// losses (validation took eval_batches micro-batches once, so its sequences changed with grad_accum).
TEST_F(TrainParallel, GradientAccumulationKeepsTheLossesAndTheValidationSet) {
  LOOM_REQUIRE_LOOM();
  expect_same_losses("accum1", "--train.grad_accum 1");
  expect_same_losses("accum4", "--train.grad_accum 4");
}

TEST_F(TrainParallel, PipelineMatchesSingleDevice) {
  LOOM_REQUIRE_LOOM();
  expect_same_losses("pp2", "--parallel.pp 2 --parallel.schedule 1f1b");
  expect_same_checkpoint("pp2");
}

// Stages cut by a layer list (parallel.stage_layers) instead of by cost, down to a first stage
// holding the embedding alone and a last one holding the head alone.
TEST_F(TrainParallel, PipelineStagesFromALayerListMatchSingleDevice) {
  LOOM_REQUIRE_LOOM();
  expect_same_losses("pp2_layers_0_2", "--parallel.pp 2 --parallel.stage_layers 0,2");
  expect_same_losses("pp2_layers_2_0", "--parallel.pp 2 --parallel.stage_layers [2,0] --parallel.schedule zb-h1");
  expect_same_checkpoint("pp2_layers_2_0");
  // The run's header names the blocks of each stage (not --quiet here).
  CmdRun run = sh(fmt::format("{} train --data.dir {} --train.out_dir {} --model.n_layer 2 --model.n_head 4 "
                              "--model.n_embd 32 --data.seq_len 16 --train.batch_size 4 --train.steps 1 "
                              "--train.eval_every 0 --train.sample_tokens 0 --parallel.pp 2 "
                              "--parallel.stage_layers 0,2",
                              kLoom, (root_ / "data").string(), (root_ / "pp2_layers_shown").string()));
  EXPECT_EQ(run.status, 0) << run.output;
  EXPECT_NE(run.output.find("blocks 0,2"), std::string::npos) << run.output;
  for (const auto& [layout, says] : std::vector<std::pair<std::string, std::string>>{
           {"--parallel.pp 2 --parallel.stage_layers 1,2", "add up to 3 blocks but the model has n_layer = 2"},
           {"--parallel.pp 2 --parallel.stage_layers 2", "has 1 entries for 2 pipeline stages"},
           {"--parallel.pp 2 --parallel.schedule interleaved --parallel.stage_layers 1,1",
            "has 2 entries for 4 pipeline stages"},
           {"--parallel.stage_layers 1,1", "needs pipeline stages"},
           {"--parallel.pp 2 --parallel.stage_layers 2,-1", "entry 1 is -1"},
           {"--parallel.pp 2 --parallel.stage_layers 3,-1", "entry 0 is 3, more than the model's n_layer = 2"},
           {"--parallel.pp 2 --parallel.stage_layers 1,x", "cannot parse"}}) {
    CmdRun bad = train("bad_layers", layout);
    EXPECT_NE(bad.status, 0) << layout;
    EXPECT_NE(bad.output.find("parallel.stage_layers"), std::string::npos) << layout << "\n" << bad.output;
    EXPECT_NE(bad.output.find(says), std::string::npos) << layout << "\n" << bad.output;
  }
  // The layer list is checked against the model after the preset is known.
  CmdRun preset = train("bad_layers", "--model.preset gpt9 --parallel.pp 2 --parallel.stage_layers 1,1");
  EXPECT_NE(preset.status, 0);
  EXPECT_NE(preset.output.find("model.preset: unknown model 'gpt9'"), std::string::npos) << preset.output;
}

TEST_F(TrainParallel, PipelineTimesDataParallelMatchesSingleDevice) {
  LOOM_REQUIRE_LOOM();
  expect_same_losses("pp2_dp2", "--parallel.pp 2 --parallel.dp 2");
}

// Pipelines with ZeRO-1 (each stage's moments sharded over its dp replicas), alone and in the 4D
// layout, 20 steps.
TEST_F(TrainParallel, ZeroOneWithPipelineMatchesSingleDevice) {
  LOOM_REQUIRE_LOOM();
  expect_same_losses("pp2_dp2_zero1", "--parallel.pp 2 --parallel.dp 2 --parallel.zero 1", 20);
  expect_same_checkpoint("pp2_dp2_zero1", 20);
  expect_same_moments("pp2_dp2_zero1", ref_dir(20), kTol);
  expect_same_losses("dp2_pp2_tp2_zero1", "--parallel.dp 2 --parallel.pp 2 --parallel.tp 2 --parallel.zero 1", 20);
  expect_same_checkpoint("dp2_pp2_tp2_zero1", 20);
  expect_same_moments("dp2_pp2_tp2_zero1", ref_dir(20), kTol);
  // Stages with context parallelism shard their moments over dp x cp.
  expect_same_losses("dp2_pp2_cp2_zero1", "--parallel.dp 2 --parallel.pp 2 --parallel.cp 2 --parallel.zero 1", 20);
  expect_same_moments("dp2_pp2_cp2_zero1", ref_dir(20), kTol);
}

// Pipelines with ZeRO 2 and 3 (each stage's gradients, then parameters, sharded over its dp x cp
// group) and offload, composed with tp + sp and cp, 20 steps; the checkpoints each rank writes
// of its shard are the single device's.
TEST_F(TrainParallel, ZeroTwoThreeAndOffloadWithPipelineMatchSingleDevice) {
  LOOM_REQUIRE_LOOM();
  for (const auto& [name, layout] : std::vector<std::pair<std::string, std::string>>{
           {"pp2_dp2_zero2", "--parallel.pp 2 --parallel.dp 2 --parallel.zero 2"},
           {"pp2_dp2_tp2_sp_zero3", "--parallel.pp 2 --parallel.dp 2 --parallel.tp 2 --parallel.sp true --parallel.zero 3"},
           {"pp2_cp2_zero3_offload", "--parallel.pp 2 --parallel.cp 2 --parallel.zero 3 --parallel.offload true "
                                     "--parallel.schedule interleaved"},
           {"pp2_dp2_zero1_offload_zb", "--parallel.pp 2 --parallel.dp 2 --parallel.zero 1 --parallel.offload true "
                                        "--parallel.schedule zb-h1"},
           {"pp2_dp2_zero3_zb", "--parallel.pp 2 --parallel.dp 2 --parallel.zero 3 --parallel.schedule zb-h1"}}) {
    expect_same_losses(name, layout, 20);
    expect_same_checkpoint(name, 20);
    expect_same_moments(name, ref_dir(20), kTol);
  }
}

// The 4D layout: dp 2 x pp 2 x tp 2 (8 ranks), and pipeline stages with sequence and context
// parallelism inside.
TEST_F(TrainParallel, DataPipelineTensorMatchesSingleDevice) {
  LOOM_REQUIRE_LOOM();
  expect_same_losses("dp2_pp2_tp2", "--parallel.dp 2 --parallel.pp 2 --parallel.tp 2");
  expect_same_checkpoint("dp2_pp2_tp2");
}

TEST_F(TrainParallel, PipelineWithSequenceAndContextParallelMatchesSingleDevice) {
  LOOM_REQUIRE_LOOM();
  expect_same_losses("pp2_tp2_sp", "--parallel.pp 2 --parallel.tp 2 --parallel.sp true --parallel.schedule zb-h1");
  expect_same_losses("pp2_cp2", "--parallel.pp 2 --parallel.cp 2 --parallel.schedule gpipe");
}

// GaLore (optim.name = galore, rank 8 of the tiny model's 32-wide matrices, a projector refresh
// every 3 steps: steps 1, 4, 7, 10) under the layouts that keep its matrices whole on a rank:
// data, pipeline (every schedule) and context parallelism, offload, against its own
// single-device run. Its optimizer state is the declared one: plain moments for vectors and
// embeddings, r max(m, n) moments and r min(m, n) projector elements per block matrix.
TEST_F(TrainParallel, GaLoreWithDataPipelineAndContextParallelMatchesSingleDevice) {
  LOOM_REQUIRE_LOOM();
  const std::string galore = " --optim.name galore --optim.galore_rank 8 --optim.galore_update_every 3";
  ASSERT_EQ(train("ref_galore", galore).status, 0);
  for (const std::string layout : {"--parallel.dp 2", "--parallel.pp 2 --parallel.schedule 1f1b",
                                   "--parallel.pp 2 --parallel.dp 2 --parallel.schedule zb-h1",
                                   "--parallel.pp 2 --parallel.schedule interleaved --parallel.virtual_stages 2",
                                   "--parallel.cp 2", "--parallel.dp 2 --parallel.offload true"}) {
    const std::string out = "galore_" + std::to_string(std::hash<std::string>{}(layout) % 100000);
    CmdRun r = train(out, layout + galore);
    ASSERT_EQ(r.status, 0) << layout << "\n" << r.output;
    expect_losses_near_reference(out, layout + galore, 10, "ref_galore");
  }
  // Not AdamW: the losses part after the first update.
  ensure_reference();
  EXPECT_NE(metric("ref_galore", "loss").at(3), metric("ref", "loss").at(3));
  // The state by tag: n_embd 32, 2 blocks, vocabulary 97, block_size 64 (wpe 64 x 32). Per block
  // c_attn [96, 32] and c_fc [128, 32] project on the right ([m, 8] moments, [8, 32] projector),
  // c_proj [32, 32] too, mlp.c_proj [32, 128] on the left ([8, 128] moments, [32, 8] projector).
  const int64_t C = 32, r = 8, V = 97, T = 64;
  const int64_t per_block = 2 * r * (3 * C) + r * C + 2 * r * C + r * C + 2 * r * (4 * C) + r * C + 2 * r * (4 * C) +
                            C * r + 2 * (2 * C + 3 * C + C + 2 * C + 4 * C + C);  // + norms and biases, plain
  const int64_t want = 4 * (2 * per_block + 2 * (V * C + T * C + 2 * C));
  std::ifstream f(root_ / "ref_galore" / "memory.json");
  const nlohmann::json j = nlohmann::json::parse(f);
  EXPECT_EQ(j.at("ranks").at(0).at("peak_bytes").at("optimizer").get<int64_t>(), want);
}

TEST_F(TrainParallel, UnsupportedCombinationsAreRefusedNamingTheFields) {
  LOOM_REQUIRE_LOOM();
  // GaLore projects whole matrices: tensor parallelism and ZeRO's flat shards cut them.
  for (const auto& [layout, field] : {std::pair<std::string, std::string>{"--parallel.tp 2", "parallel.tp"},
                                      {"--parallel.dp 2 --parallel.zero 1", "parallel.zero"}}) {
    CmdRun r = train("bad_galore", layout + " --optim.name galore");
    EXPECT_NE(r.status, 0) << layout;
    EXPECT_NE(r.output.find(field + ": optim.name = galore needs whole matrices"), std::string::npos) << r.output;
  }
  CmdRun heads = train("bad_heads", "--parallel.pp 2 --parallel.tp 3");
  EXPECT_NE(heads.status, 0);
  EXPECT_NE(heads.output.find("parallel.tp"), std::string::npos) << heads.output;
  CmdRun sched = train("bad_sched", "--parallel.pp 2 --parallel.schedule zigzag");
  EXPECT_NE(sched.status, 0);
  EXPECT_NE(sched.output.find("parallel.schedule"), std::string::npos) << sched.output;
}

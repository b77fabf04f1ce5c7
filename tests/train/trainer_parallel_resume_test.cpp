// `loom train --resume` of mesh runs (tensor, sequence, context and pipeline parallelism): a run
// interrupted after the checkpoint of step 5 (LOOM_FAULT_INJECT makes a rank throw at the start
// of step 6) and resumed to step 10 equals the uninterrupted run of the same layout bit for bit
// (every loss, validation loss and gradient norm, and every tensor of the final checkpoint).
// Checkpoints hold full tensors, so one written under a layout resumes under another; there the
// reduction order differs, so the losses are compared with the uninterrupted single-device run
// within 1e-5 relative (the tolerance of the layout tests, trainer_parallel_test.cpp). A
// checkpoint of another model is refused naming the manifest and the field.
#include <gtest/gtest.h>

#include <cstdio>

#include "train/mesh_train_util.h"

using namespace loom;
using namespace loom::test;

namespace {

const std::string kEvery5 = " --train.checkpoint_every 5 --train.keep_checkpoints 3";

class TrainParallelResume : public MeshTrainFixture {
 protected:
  // Runs `layout` into out until rank `rank` throws at the start of step 6 (after the checkpoint
  // of step 5), then checks what it left: any rank may fail, since no rank starts step 6 before
  // the step-5 checkpoint is on disk.
  static void run_interrupted(const std::string& out, const std::string& layout, int rank) {
    CmdRun cut = train(out, layout + kEvery5, fmt::format("LOOM_FAULT_INJECT=rank={},step=6,kind=throw", rank));
    ASSERT_NE(cut.status, 0) << layout << "\n" << cut.output;
    ASSERT_NE(cut.output.find(fmt::format("rank {} of", rank)), std::string::npos) << cut.output;
    ASSERT_NE(cut.output.find("fails on purpose at step 6"), std::string::npos) << cut.output;
    const std::string ckpt = train::latest_checkpoint((root_ / out).string());
    ASSERT_FALSE(ckpt.empty()) << cut.output;
    ASSERT_EQ(train::read_checkpoint_meta(ckpt).step, 5) << cut.output;
    ASSERT_EQ(metric(out, "loss").size(), 5u);
  }
  static void resume(const std::string& out, const std::string& layout) {
    CmdRun r = train(out, layout + kEvery5 + " --resume");
    ASSERT_EQ(r.status, 0) << layout << "\n" << r.output;
  }

  // 10 steps straight == 5 steps, interrupted, then --resume to 10, under one layout.
  static void expect_bit_identical_resume(const std::string& name, const std::string& layout, int rank) {
    CmdRun straight = train(name + "_straight", layout + kEvery5);
    ASSERT_EQ(straight.status, 0) << layout << "\n" << straight.output;
    run_interrupted(name + "_cut", layout, rank);
    resume(name + "_cut", layout);
    expect_identical_metrics(name + "_straight", name + "_cut", {"loss", "val_loss", "grad_norm", "lr"});
    ASSERT_EQ(metric(name + "_cut", "loss").size(), 10u);
    expect_identical_checkpoints(name + "_straight", name + "_cut");
  }
};

}  // namespace

TEST_F(TrainParallelResume, TensorSequenceParallelResumesBitIdentically) {
  LOOM_REQUIRE_LOOM();
  expect_bit_identical_resume("tp2_sp", "--parallel.tp 2 --parallel.sp true", 1);
}

TEST_F(TrainParallelResume, ContextParallelResumesBitIdentically) {
  LOOM_REQUIRE_LOOM();
  expect_bit_identical_resume("cp2", "--parallel.cp 2", 0);
}

TEST_F(TrainParallelResume, PipelineTimesDataParallelResumesBitIdentically) {
  LOOM_REQUIRE_LOOM();
  expect_bit_identical_resume("pp2_dp2", "--parallel.pp 2 --parallel.schedule 1f1b --parallel.dp 2", 1);
}

TEST_F(TrainParallelResume, ZeroOneWithTensorParallelResumesBitIdentically) {
  LOOM_REQUIRE_LOOM();
  expect_bit_identical_resume("tp2_dp2_zero1", "--parallel.tp 2 --parallel.dp 2 --parallel.zero 1", 1);
  // Moments sharded over dp x cp (4 ranks).
  expect_bit_identical_resume("cp2_dp2_zero1", "--parallel.cp 2 --parallel.dp 2 --parallel.zero 1", 2);
}

// The 4D layout dp 2 x pp 2 x tp 2 resumes bit-identically too.
TEST_F(TrainParallelResume, DataPipelineTensorResumesBitIdentically) {
  LOOM_REQUIRE_LOOM();
  expect_bit_identical_resume("dp2_pp2_tp2", "--parallel.dp 2 --parallel.pp 2 --parallel.tp 2", 3);
  expect_bit_identical_resume("dp2_pp2_zero1", "--parallel.dp 2 --parallel.pp 2 --parallel.zero 1", 2);
}

TEST_F(TrainParallelResume, TensorParallelCheckpointResumesUnderPipeline) {
  LOOM_REQUIRE_LOOM();
  run_interrupted("tp2_to_pp2", "--parallel.tp 2", 1);
  resume("tp2_to_pp2", "--parallel.pp 2 --parallel.schedule 1f1b");
  expect_losses_near_reference("tp2_to_pp2", "tp=2 steps 1-5, pp=2 steps 6-10");
}

TEST_F(TrainParallelResume, SingleDeviceCheckpointResumesUnderTensorParallel) {
  LOOM_REQUIRE_LOOM();
  run_interrupted("single_to_tp2", "", 0);
  resume("single_to_tp2", "--parallel.tp 2");
  expect_losses_near_reference("single_to_tp2", "single device steps 1-5, tp=2 steps 6-10");
}

TEST_F(TrainParallelResume, PipelineCheckpointResumesUnderDataParallel) {
  LOOM_REQUIRE_LOOM();
  run_interrupted("pp2_to_dp2", "--parallel.pp 2", 1);
  resume("pp2_to_dp2", "--parallel.dp 2");
  expect_losses_near_reference("pp2_to_dp2", "pp=2 steps 1-5, dp=2 steps 6-10");
}

TEST_F(TrainParallelResume, CheckpointOfAnotherModelIsRefusedNamingTheField) {
  LOOM_REQUIRE_LOOM();
  CmdRun first = train("other_model", "--parallel.tp 2 --train.steps 1");
  ASSERT_EQ(first.status, 0) << first.output;
  for (const std::string layout : {"--parallel.tp 2", "--parallel.pp 2", ""}) {
    CmdRun r = train("other_model", layout + " --model.n_embd 64 --resume");
    EXPECT_NE(r.status, 0) << layout << "\n" << r.output;
    EXPECT_NE(r.output.find("manifest.json"), std::string::npos) << layout << "\n" << r.output;
    EXPECT_NE(r.output.find("model.n_embd is 32 but this run's is 64"), std::string::npos) << layout << "\n"
                                                                                            << r.output;
  }
  CmdRun seed = train("other_model", "--parallel.tp 2 --train.seed 7 --resume");
  EXPECT_NE(seed.status, 0) << seed.output;
  EXPECT_NE(seed.output.find("train.seed"), std::string::npos) << seed.output;
}

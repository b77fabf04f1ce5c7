// The fp16 loss scaler (train/loss_scale.h): halving on overflow, doubling after a window of clean
// steps, the floor, an injected overflow for one step (used up by that step whatever it gives),
// and the checkpointed state.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "train/loss_scale.h"

using namespace loom;
using loom::train::LossScaler;

TEST(LossScaler, HalvesOnOverflowAndDoublesAfterAWindowOfCleanSteps) {
  LossScaler s(65536, 3, 1);
  EXPECT_EQ(s.scale(), 65536);
  EXPECT_EQ(s.update(false, "step 1"), 65536);
  EXPECT_EQ(s.update(false, "step 2"), 65536);
  EXPECT_EQ(s.clean_steps(), 2);
  EXPECT_EQ(s.update(false, "step 3"), 131072);  // the third clean step in a row doubles it
  EXPECT_EQ(s.clean_steps(), 0);
  EXPECT_EQ(s.update(false, "step 4"), 131072);
  EXPECT_EQ(s.update(true, "step 5"), 65536);  // an overflow halves it and restarts the count
  EXPECT_EQ(s.clean_steps(), 0);
  EXPECT_EQ(s.update(false, "step 6"), 65536);
  EXPECT_EQ(s.update(false, "step 7"), 65536);
  EXPECT_EQ(s.update(false, "step 8"), 131072);
}

TEST(LossScaler, AnOverflowBelowTheFloorStopsTheRunNamingTheStep) {
  LossScaler s(4, 1000, 2);
  EXPECT_EQ(s.update(true, "step 7"), 2);
  try {
    s.update(true, "step 8");
    ADD_FAILURE() << "the scale went below its floor";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("step 8"), std::string::npos) << m;
    EXPECT_NE(m.find("train.loss_scale_min = 2"), std::string::npos) << m;
  }
}

TEST(LossScaler, AnInjectedOverflowBoostsOneStepOnly) {
  LossScaler s(1024, 1000, 1);
  EXPECT_EQ(s.step_scale(), 1024);
  s.update(false, "step 1");
  s.inject_overflow();
  EXPECT_EQ(s.step_scale(), 1024.0 * 65536);  // the step the fault fires in
  EXPECT_EQ(s.scale(), 1024);                 // the state (a checkpoint's) has no boost
  EXPECT_EQ(s.update(true, "step 2"), 512);   // halved from the scale before the boost
  EXPECT_EQ(s.clean_steps(), 0);
  EXPECT_EQ(s.step_scale(), 512);
  s.inject_overflow();
  EXPECT_EQ(s.step_scale(), 512.0 * 65536);
  EXPECT_EQ(s.step_scale(), 512);  // used up even by a step that reported nothing (a non-finite loss)
  EXPECT_EQ(s.update(false, "step 4"), 512);
}

TEST(LossScaler, RestoresACheckpointedStateAndRefusesBadOnes) {
  LossScaler s(65536, 4, 1);
  s.restore(2048, 3);
  EXPECT_EQ(s.scale(), 2048);
  EXPECT_EQ(s.clean_steps(), 3);
  EXPECT_EQ(s.update(false, "step 1"), 4096);  // the checkpoint's fourth clean step
  EXPECT_THROW(s.restore(0, 0), Error);
  EXPECT_THROW(s.restore(8, -1), Error);
  EXPECT_THROW(LossScaler(0, 1, 1), Error);
  EXPECT_THROW(LossScaler(8, 0, 1), Error);
  EXPECT_THROW(LossScaler(8, 1, 16), Error);
}

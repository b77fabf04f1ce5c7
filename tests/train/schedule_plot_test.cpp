#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "train/plot.h"
#include "core/error.h"
#include "train/config.h"
#include "train/schedule.h"

namespace fs = std::filesystem;
using namespace loom::train;

TEST(LrSchedule, WarmupThenCosineToMin) {
  LrSchedule s{1e-3f, 1e-4f, 10, 110, "cosine"};
  EXPECT_FLOAT_EQ(s.at(0), 1e-4f);
  EXPECT_FLOAT_EQ(s.at(9), 1e-3f);
  EXPECT_FLOAT_EQ(s.at(10), 1e-3f);
  EXPECT_NEAR(s.at(60), 5.5e-4f, 1e-9);
  EXPECT_FLOAT_EQ(s.at(110), 1e-4f);
  EXPECT_FLOAT_EQ(s.at(500), 1e-4f);
  s.kind = "linear";
  EXPECT_NEAR(s.at(35), 1e-3f - 0.25f * 9e-4f, 1e-9);
  s.kind = "constant";
  EXPECT_FLOAT_EQ(s.at(100), 1e-3f);
}

// The config's schedule: optim.min_lr -1 is optim.lr / 10, optim.decay_steps 0 is train.steps,
// and a decay that ends before train.steps holds optim.min_lr after it.
TEST(LrSchedule, ConfigDefaultsAndAnEarlierDecayEnd) {
  TrainConfig c;
  c.lr = 2e-3f;
  c.steps = 50;
  EXPECT_FLOAT_EQ(c.final_lr(), 2e-4f);
  EXPECT_EQ(c.decay_end(), 50);
  c.min_lr = 0;
  c.decay_steps = 30;
  c.warmup_steps = 10;
  const LrSchedule s{c.lr, c.final_lr(), c.warmup_steps, c.decay_end(), c.lr_schedule};
  EXPECT_FLOAT_EQ(s.at(20), 1e-3f);
  EXPECT_FLOAT_EQ(s.at(30), 0.f);
  EXPECT_FLOAT_EQ(s.at(49), 0.f);
}

// What a resume would change is found from the checkpoint's config text: nothing for the same
// config, nor for a schedule that differs only where no update falls; the first update whose
// rate differs and the fields behind it; AdamW's settings and the batch's shape.
TEST(LrSchedule, ChangesOnResumeAreFound) {
  TrainConfig then;
  then.steps = 10;
  then.warmup_steps = 100;  // the whole run inside the warm-up
  const std::string text = config_to_toml(then);
  EXPECT_TRUE(changed_on_resume(then, text, "m.json", 4, 4).empty());
  TrainConfig now = then;
  now.steps = 20;  // the decay ends later, but every update of both runs is in the warm-up
  EXPECT_TRUE(changed_on_resume(now, text, "m.json", 4, 4).empty());
  then.warmup_steps = now.warmup_steps = 2;
  const std::string text2 = config_to_toml(then);
  std::vector<std::string> d = changed_on_resume(now, text2, "m.json", 4, 4);
  ASSERT_EQ(d.size(), 1u);
  EXPECT_NE(d[0].find("the learning-rate schedule: update 5 at"), std::string::npos) << d[0];
  EXPECT_NE(d[0].find("a decay ending at step 20 (optim.decay_steps, else train.steps; the checkpoint's 10)"),
            std::string::npos) << d[0];
  now.decay_steps = 10;  // training on past the checkpoint's decay at its final rate
  EXPECT_TRUE(changed_on_resume(now, text2, "m.json", 4, 4).empty());
  now.weight_decay = 0.f;
  now.batch_size = 16;
  d = changed_on_resume(now, text2, "m.json", 4, 4);
  ASSERT_EQ(d.size(), 2u);
  EXPECT_EQ(d[0], "optim.weight_decay 0 (the checkpoint's 0.1)");
  EXPECT_EQ(d[1], "train.batch_size 16 (the checkpoint's 8)");
  // An older checkpoint's explicit optim.min_lr = 6e-05 is the default -1's 6e-4 / 10.
  std::string old = text2;
  const size_t at = old.find("min_lr = -1");
  ASSERT_NE(at, std::string::npos) << old;
  old.replace(at, 11, "min_lr = 6e-05");
  TrainConfig same = then;
  EXPECT_TRUE(changed_on_resume(same, old, "m.json", 4, 4).empty());
  EXPECT_THROW(changed_on_resume(same, "[optim\n", "m.json", 4, 4), loom::Error);
}

TEST(Plot, WritesAPng) {
  std::string path = (fs::temp_directory_path() / fmt::format("loom_plot_{}.png", ::getpid())).string();
  Series a{"train", {}, 0.1, 0.3, 0.8}, b{"val", {{0, 6.0}, {50, 4.0}, {100, 3.5}}, 0.9, 0.3, 0.1};
  for (int i = 0; i <= 100; ++i) a.points.push_back({double(i), 6.0 * std::exp(-i / 40.0) + 2.5});
  std::string why;
  if (!plot_png(path, "loss", {a, b}, "loss", &why)) GTEST_SKIP() << why;
  std::ifstream f(path, std::ios::binary);
  char sig[8] = {};
  f.read(sig, 8);
  EXPECT_EQ(std::string(sig + 1, 3), "PNG");
  EXPECT_GT(fs::file_size(path), 5000u);
  fs::remove(path);
}

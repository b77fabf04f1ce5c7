#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "train/plot.h"
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

// `loom train --train.device cuda`: the executable picks the trainer by train.device. A build
// without CUDA refuses "cuda" naming the field and how to build with CUDA; a CUDA build runs the
// GPU trainer, which on a machine without a GPU says so (with one, the run stops at the missing
// data directory). What the GPU trainer lacks is refused naming the field in either build. Skips
// when the loom executable has not been built next to the tests.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <string>

#include "cli_util.h"

namespace fs = std::filesystem;

TEST(TrainCli, DeviceCudaIsDispatchedOrRefused) {
  using loom::test::kLoom;
  LOOM_REQUIRE_LOOM();
  const fs::path dir = fs::temp_directory_path() / ("loom_train_device_cli_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string data = (dir / "no_data").string();
  const std::string args = "train --quiet --train.device cuda --data.dir '" + data + "' --train.out_dir '" +
                           (dir / "out").string() + "'";

  loom::test::CliRun r = loom::test::loom_cli(args + " --parallel.dp 2", dir);
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(r.err.find("parallel.dp"), std::string::npos) << r.err;

  r = loom::test::loom_cli(args, dir);
  EXPECT_EQ(r.code, 1) << r.out << r.err;
#ifdef LOOM_HAVE_CUDA
  EXPECT_TRUE(r.err.find("no CUDA device") != std::string::npos || r.err.find(data) != std::string::npos) << r.err;
#else
  EXPECT_NE(r.err.find("train.device"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("-DLOOM_CUDA=ON"), std::string::npos) << r.err;
#endif
  fs::remove_all(dir);
}

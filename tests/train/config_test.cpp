#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "train/config.h"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::train;

namespace {
struct TmpFile {
  std::string path;
  explicit TmpFile(const std::string& text) {
    path = (fs::temp_directory_path() / fmt::format("loom_cfg_{}_{}.toml", ::getpid(), std::rand())).string();
    std::ofstream(path) << text;
  }
  ~TmpFile() { fs::remove(path); }
};

std::string error_of(const std::string& text, std::vector<std::string> overrides = {}) {
  TmpFile f(text);
  try {
    load_config(f.path, overrides);
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(overrides.empty() ? f.path : "command line"), std::string::npos) << msg;
    return msg;
  }
  ADD_FAILURE() << "no error for:\n" << text;
  return "";
}
}  // namespace

TEST(TrainConfig, ParsesFileThenOverrides) {
  TmpFile f("[model]\npreset = \"gpt2-124m\"\n[optim]\nlr = 1e-3\nwarmup_steps = 5\n[train]\nsteps = 7\n");
  TrainConfig c = load_config(f.path, collect_overrides({"--optim.lr", "2e-4", "--train.out_dir=runs/x"}));
  EXPECT_EQ(c.model_preset, "gpt2-124m");
  EXPECT_FLOAT_EQ(c.lr, 2e-4f);
  EXPECT_EQ(c.warmup_steps, 5);
  EXPECT_EQ(c.steps, 7);
  EXPECT_EQ(c.out_dir, "runs/x");
  EXPECT_EQ(c.model(50257).n_embd, 768);
}

TEST(TrainConfig, IntegerAcceptedForFloat) {
  TmpFile f("[optim]\nlr = 1\n");
  EXPECT_FLOAT_EQ(load_config(f.path, {}).lr, 1.0f);
}

TEST(TrainConfig, ErrorsNameFileAndField) {
  EXPECT_NE(error_of("[optim\nlr = 1").find("malformed TOML"), std::string::npos);
  std::string m = error_of("[optim]\nlearning_rate = 1e-3\n");
  EXPECT_NE(m.find("unknown key 'optim.learning_rate'"), std::string::npos) << m;
  m = error_of("[train]\nsteps = \"many\"\n");
  EXPECT_NE(m.find("train.steps: expected int, got a string"), std::string::npos) << m;
  m = error_of("[train]\nbatch_size = 6\ngrad_accum = 4\n");
  EXPECT_NE(m.find("train.grad_accum"), std::string::npos) << m;
  m = error_of("[parallel]\nzero = 4\n");
  EXPECT_NE(m.find("parallel.zero"), std::string::npos) << m;
  m = error_of("[model]\npreset = \"gpt5\"\n");
  EXPECT_NE(m.find("gpt5"), std::string::npos) << m;
  m = error_of("", {"optim.lr=fast"});
  EXPECT_NE(m.find("--optim.lr"), std::string::npos) << m;
  m = error_of("", {"optim.nope=1"});
  EXPECT_NE(m.find("unknown key '--optim.nope'"), std::string::npos) << m;
  EXPECT_THROW(collect_overrides({"--train.steps"}), Error);
  EXPECT_THROW(collect_overrides({"stray"}), Error);
}

TEST(TrainConfig, TomlRoundTrip) {
  TrainConfig c;
  c.lr = 1.5e-3f;
  c.out_dir = "runs/with \"quotes\" and \\";
  c.sp = true;
  c.seed = 99;
  TmpFile f(config_to_toml(c));
  TrainConfig d = load_config(f.path, {});
  EXPECT_EQ(config_to_toml(c), config_to_toml(d));
  EXPECT_EQ(d.out_dir, c.out_dir);
  EXPECT_EQ(config_fields().size(), 46u);
}

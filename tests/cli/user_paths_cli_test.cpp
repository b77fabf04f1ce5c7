// What a new user meets first, through the loom executable: the planner takes the models `loom
// train` builds (its presets and its configs) and says an impossible layout is one; a process of an
// MPI launch on the threads backend is refused before it touches the run directory; a directory
// holding only the empty metrics of a run stopped before its first step is not a run; `--resume`
// into a directory without a checkpoint says so on stderr; errors about input carry no source
// location and blame the flag that set the value; the schedule, bench and convert commands' own
// defaults work together.
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

constexpr const char* kTiny =
    "--model.n_layer 1 --model.n_head 2 --model.n_embd 32 --data.seq_len 16 --train.batch_size 4 "
    "--train.eval_every 0 --train.sample_tokens 0 --train.threads 1 --quiet";

}  // namespace

TEST(UserPathsCli, ThePlannerTakesTrainsModelsAndNamesAnImpossibleLayout) {
  LOOM_REQUIRE_LOOM();
  TrainScratch s("loom_user_plan");
  for (const char* m : {"gpt2-tiny", "smollm-135m", "gpt2-1558m"}) {
    const CliRun r = loom_cli(fmt::format("plan --model {} --cluster cpu --gpus 2 --global-batch 8", m), s.root / "logs");
    ASSERT_EQ(r.code, 0) << m << ": " << r.err;
    EXPECT_EQ(r.out.rfind(m, 0), 0u) << r.out;
  }
  // A train config: its model at its sequence length, the vocabulary of its data's shards.
  const fs::path cfg = s.root / "run.toml";
  std::ofstream(cfg) << fmt::format("[model]\npreset = \"gpt2-tiny\"\nn_layer = 3\n[data]\ndir = \"{}\"\nseq_len = 32\n",
                                    (s.root / "data").string());
  const CliRun c = loom_cli(fmt::format("plan --model '{}' --cluster cpu --gpus 2 --global-batch 8", cfg.string()),
                            s.root / "logs");
  ASSERT_EQ(c.code, 0) << c.err;
  EXPECT_NE(c.out.find("(3 layers, hidden 64, 4 heads, ffn 256, vocabulary 97, sequence 32;"), std::string::npos)
      << c.out;
  // 25 heads do not split over tp 2: an invalid layout, not one that does not fit.
  const CliRun bad = loom_cli("plan --model gpt2-1.5b --gpus 16 --global-batch 512 --layout tp=2,pp=2,mbs=4",
                              s.root / "logs");
  EXPECT_NE(bad.out.find("(invalid: 25 heads are not divisible by tp = 2)"), std::string::npos) << bad.out;
  const CliRun sim = loom_cli(fmt::format("simulate --model gpt2-1.5b --gpus 16 --global-batch 512 --layout "
                                          "tp=2,pp=4,mbs=4 --png '{}'",
                                          (s.root / "step.png").string()),
                              s.root / "logs");
  EXPECT_NE(sim.code, 0);
  EXPECT_NE(sim.err.find("25 heads are not divisible by tp = 2"), std::string::npos) << sim.err;
  EXPECT_EQ(sim.err.find(".cpp:"), std::string::npos) << "a source location in a user's error: " << sim.err;
}

TEST(UserPathsCli, RunDirectoriesAndResume) {
  LOOM_REQUIRE_LOOM();
  TrainScratch s("loom_user_runs");
  // An MPI launch's process on the threads backend: refused before anything is written.
  const CliRun mpi = s.train("mpi", std::string(kTiny) + " --train.steps 1", "OMPI_COMM_WORLD_SIZE=2");
  EXPECT_NE(mpi.code, 0);
  EXPECT_NE(mpi.err.find("pass --parallel.comm mpi"), std::string::npos) << mpi.err;
  EXPECT_FALSE(fs::exists(s.root / "mpi"));
  // The empty metrics of a run stopped before its first step do not make the directory a run.
  fs::create_directories(s.root / "empty");
  std::ofstream(s.root / "empty" / "metrics.jsonl");
  const CliRun fresh = s.train("empty", std::string(kTiny) + " --train.steps 1");
  EXPECT_EQ(fresh.code, 0) << fresh.err;
  // --resume where there is no checkpoint (a mistyped train.out_dir): said on stderr, under --quiet.
  const CliRun typo = s.train("typo", std::string(kTiny) + " --train.steps 1 --resume");
  EXPECT_EQ(typo.code, 0) << typo.err;
  EXPECT_NE(typo.err.find("loom: warning: resume: no checkpoint in"), std::string::npos) << typo.err;
  // A value from the command line over a config file: the error names the flag; no source location.
  const fs::path cfg = s.root / "c.toml";
  std::ofstream(cfg) << "[model]\npreset = \"gpt2-tiny\"\n";
  const CliRun layers =
      loom_cli(fmt::format("train '{}' --parallel.pp 2 --parallel.stage_layers 1,2", cfg.string()), s.root / "logs");
  EXPECT_NE(layers.code, 0);
  EXPECT_NE(layers.err.find(cfg.string() + " with --parallel.stage_layers: parallel.stage_layers: the entries add up "
                                           "to 3 blocks but the model has n_layer = 2"),
            std::string::npos)
      << layers.err;
  EXPECT_EQ(layers.err.find(".cpp:"), std::string::npos) << layers.err;
  // GPT-2 exports are one file: --max-shard-mb is refused rather than ignored.
  const CliRun one = s.train("one", std::string(kTiny) + " --train.steps 1");
  ASSERT_EQ(one.code, 0) << one.err;
  const CliRun shard = loom_cli(
      fmt::format("convert --from loom --to hf '{}' '{}' --max-shard-mb 1", (s.root / "one").string(),
                  (s.root / "hf").string()),
      s.root / "logs");
  EXPECT_NE(shard.code, 0);
  EXPECT_NE(shard.err.find("--max-shard-mb"), std::string::npos) << shard.err;
  EXPECT_FALSE(fs::exists(s.root / "hf" / "model.safetensors"));
}

TEST(UserPathsCli, CommandsWorkWithTheirOwnDefaults) {
  LOOM_REQUIRE_LOOM();
  TrainScratch s("loom_user_defaults");
  // interleaved takes parallel.virtual_stages' default of 2 chunks.
  const CliRun sch = loom_cli("schedule --kind interleaved -p 4 -m 8", s.root / "logs");
  EXPECT_EQ(sch.code, 0) << sch.err;
  EXPECT_NE(sch.out.find("checker: valid"), std::string::npos) << sch.out;
  // bench train's default --seq 256 on a preset of 64 positions: they grow, as loom train's do.
  const CliRun bench = loom_cli("bench train --model gpt2-tiny --steps 1 --warmup 0 --threads 1", s.root / "logs");
  EXPECT_EQ(bench.code, 0) << bench.err;
  EXPECT_NE(bench.out.find("batch 4 x seq 256"), std::string::npos) << bench.out;
}

// A model's tokenizer travels with it: convert --to hf writes the checkpoint's (GPT-2's files
// under the names transformers reads, vocab.json + merges.txt) beside config.json, and convert
// --from hf copies the model's into the run directory, where generate finds it.
TEST(UserPathsCli, ConvertCarriesTheTokenizer) {
  LOOM_REQUIRE_LOOM();
  TrainScratch s("loom_user_tokenizer");
  {
    std::ofstream f(s.root / "text.txt");
    for (int i = 0; i < 4000; ++i) f << (i % 3 ? "the river " : "a stone ") << (i % 7 ? "runs. " : "sleeps.\n");
  }
  const CliRun prep = loom_cli(fmt::format("prepare '{}' --out '{}' --vocab-size 300", (s.root / "text.txt").string(),
                                           (s.root / "words").string()),
                               s.root / "logs");
  ASSERT_EQ(prep.code, 0) << prep.err;
  const CliRun run = loom_cli(fmt::format("train --data.dir '{}' --train.out_dir '{}' {} --train.steps 1",
                                          (s.root / "words").string(), (s.root / "run").string(), kTiny),
                              s.root / "logs");
  ASSERT_EQ(run.code, 0) << run.err;
  const CliRun out = loom_cli(fmt::format("convert --from loom --to hf '{}' '{}'", (s.root / "run").string(),
                                          (s.root / "hf").string()),
                              s.root / "logs");
  ASSERT_EQ(out.code, 0) << out.err;
  EXPECT_TRUE(fs::exists(s.root / "hf" / "vocab.json") && fs::exists(s.root / "hf" / "merges.txt")) << out.out;
  const CliRun in = loom_cli(fmt::format("convert --from hf --to loom '{}' '{}'", (s.root / "hf").string(),
                                         (s.root / "back").string()),
                             s.root / "logs");
  ASSERT_EQ(in.code, 0) << in.err;
  EXPECT_TRUE(fs::exists(s.root / "back" / "vocab.json")) << in.out;
  const CliRun gen = loom_cli(fmt::format("generate '{}' --prompt 'the river' --tokens 3 --quiet",
                                          (s.root / "back").string()),
                              s.root / "logs");
  EXPECT_EQ(gen.code, 0) << gen.err;
  EXPECT_EQ(gen.out.rfind("the river", 0), 0u) << gen.out;
}

// An OpenMP runtime that would give a region fewer threads than asked (OMP_THREAD_LIMIT under
// train.threads, OMP_DYNAMIC): loom asks for what it gets, and trains as with one thread. oneDNN
// had split its GEMMs over the threads promised and skipped the parts of those never started (a
// gradient norm of 121885 for 1.39, silently).
TEST(UserPathsCli, ThreadLimitsOfTheOpenMpRuntimeGiveTheSameRun) {
  LOOM_REQUIRE_LOOM();
  TrainScratch s("loom_user_omp");
  const std::string args = "--model.n_layer 2 --model.n_head 2 --model.n_embd 32 --data.seq_len 16 --train.batch_size 8 "
                           "--train.grad_accum 2 --train.steps 2 --train.eval_every 0 --train.sample_tokens 0 --quiet";
  ASSERT_EQ(s.train("one", args + " --train.threads 1").code, 0);
  for (const char* env : {"OMP_THREAD_LIMIT=1", "OMP_DYNAMIC=true"}) {
    const std::string out = std::string("limited_") + (env[4] == 'T' ? "t" : "d");
    const CliRun r = s.train(out, args + " --train.threads 2", env);
    ASSERT_EQ(r.code, 0) << env << ": " << r.err;
    for (const char* key : {"loss", "grad_norm"})
      EXPECT_EQ(read_metrics(s.root / out / "metrics.jsonl", key), read_metrics(s.root / "one" / "metrics.jsonl", key))
          << env << " " << key;
  }
}

// `loom train --resume` when the run's checkpoints are not what the command expects: the newest
// checkpoint corrupt (resumed from the one before, said, and the run ends as the uninterrupted one
// does), and a train.steps below the checkpoint's step (refused naming the field; nothing changed).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "data/shard.h"
#include "train/run_util.h"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::test;

namespace {

std::string slurp(const fs::path& p) {
  std::ifstream f(p);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

struct RunFixture {
  fs::path root;
  std::string flags;
  RunFixture() : root(fs::temp_directory_path() / fmt::format("loom_resume_cli_{}", ::getpid())) {
    fs::remove_all(root);
    fs::create_directories(root / "logs");
    write_pattern_corpus(root / "data");
    flags = fmt::format(
        "--data.dir '{}' --model.n_layer 1 --model.n_head 2 --model.n_embd 32 --data.seq_len 16 "
        "--train.batch_size 4 --train.eval_every 0 --train.sample_tokens 0 --train.threads 1 --quiet "
        "--train.checkpoint_every 2 --train.keep_checkpoints 2 --optim.warmup_steps 2 --optim.decay_steps 6",
        (root / "data").string());
  }
  ~RunFixture() { fs::remove_all(root); }
  CliRun train(const fs::path& out, int steps, bool resume) {
    return loom_cli(fmt::format("train {} --train.out_dir '{}' --train.steps {}{}", flags, out.string(), steps,
                                resume ? " --resume" : ""),
                    root / "logs");
  }
};

}  // namespace

TEST(ResumeCli, CorruptNewestCheckpointResumesFromThePreviousOne) {
  LOOM_REQUIRE_LOOM();
  RunFixture r;
  CliRun whole = r.train(r.root / "whole", 6, false);
  ASSERT_EQ(whole.code, 0) << whole.err;
  const fs::path run = r.root / "run";
  CliRun first = r.train(run, 4, false);
  ASSERT_EQ(first.code, 0) << first.err;
  ASSERT_TRUE(fs::exists(run / "ckpt_00000002") && fs::exists(run / "ckpt_00000004"));
  // One byte of the step-4 checkpoint's tensor data.
  const fs::path st = run / "ckpt_00000004" / "rank_00000.safetensors";
  {
    std::fstream f(st, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(std::streamoff(fs::file_size(st) - 100));
    char c = 0;
    f.read(&c, 1);
    c = char(c ^ 0x40);
    f.seekp(std::streamoff(fs::file_size(st) - 100));
    f.write(&c, 1);
  }
  CliRun resumed = loom_cli(fmt::format("train {} --train.out_dir '{}' --train.steps 6 --resume", r.flags, run.string()),
                            r.root / "logs");
  ASSERT_EQ(resumed.code, 0) << resumed.err;
  // The checkpoint passed over is a warning on stderr, under --quiet too.
  EXPECT_NE(resumed.err.find("loom: warning: resume: passed over:"), std::string::npos) << resumed.err;
  EXPECT_NE(resumed.err.find("ckpt_00000004"), std::string::npos) << resumed.err;
  EXPECT_EQ(resumed.out.find("passed over"), std::string::npos) << resumed.out;
  // (--quiet keeps the progress lines out; the run's losses say where it resumed.)
  const auto want = read_metrics(r.root / "whole" / "metrics.jsonl", "loss");
  const auto got = read_metrics(run / "metrics.jsonl", "loss");
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [step, loss] : want) EXPECT_EQ(got.at(step), loss) << "step " << step;
}

TEST(ResumeCli, FewerStepsThanTheCheckpointIsRefused) {
  LOOM_REQUIRE_LOOM();
  RunFixture r;
  const fs::path run = r.root / "run";
  CliRun first = r.train(run, 4, false);
  ASSERT_EQ(first.code, 0) << first.err;
  const std::string metrics = slurp(run / "metrics.jsonl");
  CliRun fewer = r.train(run, 2, true);
  EXPECT_NE(fewer.code, 0);
  EXPECT_NE(fewer.err.find("train.steps is 2 but the checkpoint"), std::string::npos) << fewer.err;
  EXPECT_NE(fewer.err.find("is at step 4"), std::string::npos) << fewer.err;
  EXPECT_EQ(slurp(run / "metrics.jsonl"), metrics);
  EXPECT_TRUE(fs::exists(run / "ckpt_00000004"));
}

// A checkpoint whose manifest gives a parameter another shape of as many elements (a consistent
// writer that is not loom: its checksum rewritten to match) is refused on resume, naming the
// manifest, the tensor and both shapes, as eval, generate and convert refuse it; nothing changes.
TEST(ResumeCli, AParameterOfAnotherShapeInTheManifestIsRefused) {
  LOOM_REQUIRE_LOOM();
  RunFixture r;
  const fs::path run = r.root / "run";
  CliRun first = r.train(run, 2, false);
  ASSERT_EQ(first.code, 0) << first.err;
  const fs::path mp = run / "ckpt_00000002" / "manifest.json";
  nlohmann::json m = nlohmann::json::parse(std::ifstream(mp));
  bool swapped = false;
  for (auto& t : m["tensors"])
    if (t["name"] == "param/h.0.attn.c_attn.weight") std::swap(t["shape"][0], t["shape"][1]), swapped = true;
  ASSERT_TRUE(swapped) << m.dump();
  const std::string text = m.dump(2) + "\n";
  std::ofstream(mp, std::ios::trunc) << text;
  std::ofstream(run / "ckpt_00000002" / "manifest.crc32", std::ios::trunc) << data::crc32(text.data(), text.size())
                                                                           << "\n";
  const std::string metrics = slurp(run / "metrics.jsonl");
  CliRun resumed = r.train(run, 4, true);
  EXPECT_NE(resumed.code, 0);
  EXPECT_NE(resumed.err.find(mp.string() + ": the checkpoint's parameter 'h.0.attn.c_attn.weight' is [32, 96], but "
                                           "this run's model has it [96, 32]"),
            std::string::npos)
      << resumed.err;
  EXPECT_EQ(slurp(run / "metrics.jsonl"), metrics);
  EXPECT_FALSE(fs::exists(run / "ckpt_00000004"));
}

// A run started without --resume in a directory that holds a run is refused, naming both ways on
// (nothing changes); --overwrite starts over there. A directory another run is writing is refused
// whatever the flags.
TEST(ResumeCli, ADirectoryWithARunIsNotReplacedUnlessAsked) {
  LOOM_REQUIRE_LOOM();
  RunFixture r;
  const fs::path run = r.root / "run";
  CliRun first = r.train(run, 2, false);
  ASSERT_EQ(first.code, 0) << first.err;
  const std::string metrics = slurp(run / "metrics.jsonl");
  CliRun again = r.train(run, 2, false);
  EXPECT_NE(again.code, 0);
  EXPECT_NE(again.err.find("holds a run"), std::string::npos) << again.err;
  EXPECT_NE(again.err.find("--resume"), std::string::npos) << again.err;
  EXPECT_NE(again.err.find("--overwrite"), std::string::npos) << again.err;
  EXPECT_EQ(slurp(run / "metrics.jsonl"), metrics);
  // The old run's checkpoints go with --overwrite: a 4-step run replaced by a 2-step one leaves no
  // ckpt_00000004 for the retention or a later --resume to take as the newest.
  CliRun longer = loom_cli(fmt::format("train {} --train.out_dir '{}' --train.steps 4 --overwrite", r.flags, run.string()),
                           r.root / "logs");
  ASSERT_EQ(longer.code, 0) << longer.err;
  ASSERT_TRUE(fs::exists(run / "ckpt_00000004"));
  CliRun over = loom_cli(fmt::format("train {} --train.out_dir '{}' --train.steps 2 --overwrite", r.flags, run.string()),
                         r.root / "logs");
  EXPECT_EQ(over.code, 0) << over.err;
  EXPECT_FALSE(fs::exists(run / "ckpt_00000004"));
  EXPECT_EQ(slurp(run / "latest"), "ckpt_00000002\n");
  {
    train::RunDirLock held(run.string());  // another run writing there
    CliRun busy = r.train(run, 4, true);
    EXPECT_NE(busy.code, 0);
    EXPECT_NE(busy.err.find("is in use by another run"), std::string::npos) << busy.err;
  }
  CliRun free = r.train(run, 4, true);
  EXPECT_EQ(free.code, 0) << free.err;
}

// A checkpoint that cannot be written (here a file-size limit, `ulimit -f`, standing in for a full
// disk): the run stops with an error naming the file and the reason, the partial checkpoint is
// removed, and `latest` still names the earlier checkpoint, from which the run then resumes.
TEST(ResumeCli, AFailedCheckpointWriteKeepsTheEarlierOnes) {
  LOOM_REQUIRE_LOOM();
  RunFixture r;
  const fs::path run = r.root / "run";
  CliRun first = r.train(run, 2, false);
  ASSERT_EQ(first.code, 0) << first.err;
  ASSERT_TRUE(fs::exists(run / "ckpt_00000002"));
  const uintmax_t ckpt_bytes = fs::file_size(run / "ckpt_00000002" / "rank_00000.safetensors");
  // A limit (in 1024-byte blocks) above every other file the run writes, below a checkpoint.
  const uintmax_t blocks = ckpt_bytes / 1024 / 2;
  ASSERT_GT(blocks, 16u) << "the checkpoint must be much larger than the metrics";
  CmdRun limited = sh(fmt::format("ulimit -f {} && '{}' train {} --train.out_dir '{}' --train.steps 4 --resume", blocks,
                                  kLoom, r.flags, run.string()));
  EXPECT_NE(limited.status, 0) << limited.output;
  EXPECT_NE(limited.output.find("rank_00000.safetensors"), std::string::npos) << limited.output;
  EXPECT_NE(limited.output.find("File too large"), std::string::npos) << limited.output;
  EXPECT_NE(limited.output.find("the earlier checkpoints are kept"), std::string::npos) << limited.output;
  for (const auto& e : fs::directory_iterator(run))
    EXPECT_EQ(e.path().filename().string().rfind(".tmp", 0), std::string::npos) << "left behind: " << e.path();
  EXPECT_EQ(slurp(run / "latest"), "ckpt_00000002\n");
  CliRun resumed = r.train(run, 4, true);
  EXPECT_EQ(resumed.code, 0) << resumed.err;
  EXPECT_EQ(slurp(run / "latest"), "ckpt_00000004\n");
}

// A metrics line that cannot be written stops the run at once, naming metrics.jsonl and the reason
// (the writes failed silently until the final checkpoint did).
TEST(ResumeCli, AFailedMetricsWriteStopsTheRun) {
  LOOM_REQUIRE_LOOM();
  RunFixture r;
  const fs::path run = r.root / "run";
  CmdRun limited = sh(fmt::format("ulimit -f 2 && '{}' train {} --train.out_dir '{}' --train.steps 60 "
                                  "--train.log_every 1 --train.checkpoint_every 0",
                                  kLoom, r.flags, run.string()));
  EXPECT_NE(limited.status, 0) << limited.output;
  EXPECT_NE(limited.output.find("metrics.jsonl: cannot write the metrics: File too large"), std::string::npos)
      << limited.output;
}

// The checkpoint records the training samples drawn (Megatron-LM's consumed samples): a resume
// with another train.batch_size draws the samples after them. (Indexed by step x batch, halving
// the batch at step 4 had replayed the samples of steps 2 and 3.)
TEST(ResumeCli, AChangedBatchDrawsTheSamplesAfterTheRunsOwn) {
  LOOM_REQUIRE_LOOM();
  RunFixture r;
  const fs::path run = r.root / "run";
  ASSERT_EQ(r.train(run, 4, false).code, 0);
  auto consumed = [&](int step) {
    const auto m = nlohmann::json::parse(slurp(run / fmt::format("ckpt_{:08d}", step) / "manifest.json"));
    return m.value("consumed_samples", int64_t(-1));
  };
  auto resume = [&](int steps, const std::string& extra) {
    return loom_cli(fmt::format("train {} --train.out_dir '{}' --train.steps {} --resume --new-hparams {}", r.flags,
                                run.string(), steps, extra),
                    r.root / "logs");
  };
  EXPECT_EQ(consumed(4), 16);  // 4 steps of 4
  CliRun half = resume(6, "--train.batch_size 2");
  ASSERT_EQ(half.code, 0) << half.err;
  EXPECT_EQ(consumed(6), 20);  // and 2 of 2
  // Growing the batch, with no validation split (the sample prompt is then the run's first
  // training sample, whatever the batch; it had been read through the resumed steps' indexing,
  // which a larger batch puts before sample 0, and the end-of-run sample threw).
  fs::remove(r.root / "data" / "val_000.bin");
  CliRun twice = resume(8, "--train.batch_size 8 --train.sample_tokens 4");
  ASSERT_EQ(twice.code, 0) << twice.err;
  EXPECT_EQ(consumed(8), 36);  // and 2 of 8
}

// --resume continues the run as it was: another learning-rate schedule (here train.steps without
// optim.decay_steps, which stretches the decay), AdamW setting or batch shape is refused naming
// each difference, nothing changed; --new-hparams takes them, saying each; and the decay ending
// at the first run's step (optim.decay_steps) trains on at its final rate.
TEST(ResumeCli, ATrainingChangeIsRefusedUnlessAsked) {
  LOOM_REQUIRE_LOOM();
  RunFixture r;
  const fs::path run = r.root / "run";
  std::string flags = r.flags;
  flags.replace(flags.find(" --optim.decay_steps 6"), 22, "");  // the decay ends at train.steps
  auto train = [&](const std::string& extra) {
    return loom_cli(fmt::format("train {} --train.out_dir '{}' {}", flags, run.string(), extra), r.root / "logs");
  };
  ASSERT_EQ(train("--train.steps 4").code, 0);
  const std::string metrics = slurp(run / "metrics.jsonl");
  CliRun longer = train("--train.steps 8 --resume");
  EXPECT_NE(longer.code, 0);
  EXPECT_NE(longer.err.find("ckpt_00000004/manifest.json: this run would train otherwise than the run it resumes: the "
                            "learning-rate schedule: update 5 at"),
            std::string::npos) << longer.err;
  EXPECT_NE(longer.err.find("a decay ending at step 8 (optim.decay_steps, else train.steps; the checkpoint's 4)"),
            std::string::npos) << longer.err;
  EXPECT_NE(longer.err.find("--new-hparams"), std::string::npos) << longer.err;
  CliRun adam = train("--train.steps 4 --resume --optim.beta2 0.99 --train.batch_size 8");
  EXPECT_NE(adam.code, 0);
  EXPECT_NE(adam.err.find("optim.beta2 0.99 (the checkpoint's 0.95); train.batch_size 8 (the checkpoint's 4)"),
            std::string::npos) << adam.err;
  EXPECT_EQ(slurp(run / "latest"), "ckpt_00000004\n");
  EXPECT_EQ(slurp(run / "metrics.jsonl"), metrics);
  CliRun flag_alone = train("--train.steps 4 --new-hparams");
  EXPECT_NE(flag_alone.code, 0);
  EXPECT_NE(flag_alone.err.find("--new-hparams applies to --resume only"), std::string::npos) << flag_alone.err;
  // Training on past the decay at its final rate: the schedule is the checkpoint's.
  CliRun on = train("--train.steps 6 --optim.decay_steps 4 --resume");
  ASSERT_EQ(on.code, 0) << on.err;
  const auto lr = read_metrics(run / "metrics.jsonl", "lr");
  ASSERT_EQ(lr.size(), 6u);
  EXPECT_EQ(lr.at(5), lr.at(6));
  EXPECT_FLOAT_EQ(float(lr.at(6)), 6e-5f);  // optim.lr / 10
  CliRun changed = train("--train.steps 8 --optim.decay_steps 4 --optim.lr 1e-3 --resume --new-hparams");
  ASSERT_EQ(changed.code, 0) << changed.err;
  EXPECT_NE(changed.err.find("loom: warning: resume: --new-hparams: from step 6, the learning-rate schedule: update 7 "
                             "at 0.0001 (the checkpoint's schedule: 6e-05), from optim.lr 0.001 (the checkpoint's "
                             "0.0006)"),
            std::string::npos) << changed.err;
}

// What a run checks before it trains, and what resuming keeps: token shards of another
// vocabulary (val against train, a tokenizer against the shards, a missing data.tokenizer), a lost
// `latest` pointer, metrics lines it cannot read, and config strings that are not UTF-8. Each bad
// input is an error naming the file and the field before anything is written; resuming loses no
// record.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "data/bpe_train.h"
#include "data/loader.h"
#include "data/shard.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/run_util.h"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::train;

namespace {

struct TmpDir {
  fs::path p;
  explicit TmpDir(const char* what) {
    p = fs::temp_directory_path() / fmt::format("loom_run_data_{}_{}", what, ::getpid());
    fs::remove_all(p);
    fs::create_directories(p);
  }
  ~TmpDir() { fs::remove_all(p); }
};

std::vector<uint32_t> pattern(size_t n, uint32_t vocab) {
  std::vector<uint32_t> t(n);
  for (size_t i = 0; i < n; ++i) t[i] = uint32_t((i * 7 + i / 13) % vocab);
  return t;
}

TrainConfig config_for(const fs::path& data) {
  TrainConfig c;
  c.data_dir = data.string();
  c.seq_len = 16;
  c.n_layer = 1;
  c.n_head = 2;
  c.n_embd = 32;
  return c;
}

std::string error_of(const TrainConfig& c) {
  try {
    open_run_data(c, "run.toml");
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "open_run_data accepted " << c.data_dir;
  return "";
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

TEST(RunData, ShardsOfAnotherVocabularyAreRefused) {
  TmpDir d("vocab");
  data::write_shard((d.p / "train_000.bin").string(), pattern(4000, 97), 97);
  data::write_shard((d.p / "val_000.bin").string(), pattern(500, 120), 120);
  std::string msg = error_of(config_for(d.p));
  EXPECT_NE(msg.find((d.p / "val_000.bin").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("train_000.bin"), std::string::npos) << msg;
  // Two train shards that disagree.
  fs::remove(d.p / "val_000.bin");
  data::write_shard((d.p / "train_001.bin").string(), pattern(4000, 120), 120);
  msg = error_of(config_for(d.p));
  EXPECT_NE(msg.find((d.p / "train_001.bin").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("vocabulary size 120"), std::string::npos) << msg;
}

TEST(RunData, TheTokenizerMustBeTheShards) {
  TmpDir d("tok");
  data::TrainOptions o;
  o.vocab_size = 300;
  data::BpeTrainer bt(o);
  std::string text;
  for (int i = 0; i < 200; ++i) text += fmt::format("the quick brown fox {} jumps over the lazy dog {}. ", i, i * 7);
  bt.add_text(text);
  const data::Tokenizer tok = bt.train();
  const uint32_t v = uint32_t(tok.vocab_size());
  fs::create_directories(d.p / "tok");
  tok.save((d.p / "tok").string());

  // The tokenizer in data.dir, as `loom prepare` leaves it: matching shards load it.
  fs::copy(d.p / "tok", d.p / "same");
  data::write_shard((d.p / "same" / "train_000.bin").string(), pattern(4000, v), v);
  RunData ok = open_run_data(config_for(d.p / "same"), "run.toml");
  ASSERT_NE(ok.tokenizer, nullptr);
  EXPECT_EQ(ok.tokenizer->vocab_size(), int32_t(v));

  // Shards of one vocabulary more than the tokenizer has: refused, naming the tokenizer's file.
  fs::create_directories(d.p / "other");
  data::write_shard((d.p / "other" / "train_000.bin").string(), pattern(4000, v + 1), v + 1);
  TrainConfig c = config_for(d.p / "other");
  c.tokenizer_dir = (d.p / "tok").string();
  std::string msg = error_of(c);
  EXPECT_NE(msg.find((d.p / "tok" / "encoder.json").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find(fmt::format("vocabulary of {}", v + 1)), std::string::npos) << msg;

  // data.tokenizer naming a directory without a tokenizer is an error, not "no samples as text".
  c.tokenizer_dir = (d.p / "other").string();
  msg = error_of(c);
  EXPECT_NE(msg.find("data.tokenizer"), std::string::npos) << msg;
  // No tokenizer anywhere and none asked for: samples as token ids.
  c.tokenizer_dir.clear();
  EXPECT_EQ(open_run_data(c, "run.toml").tokenizer, nullptr);
  // data.dir naming a shard file rather than its directory: said so.
  TrainConfig file = config_for(d.p / "same" / "train_000.bin");
  msg = error_of(file);
  EXPECT_NE(msg.find("train_000.bin: a file, not a directory (data.dir names the directory"), std::string::npos) << msg;
  // ... but a sample prompt (text) needs one to be encoded: refused naming the field, not dropped.
  c.sample_prompt = "the quick";
  msg = error_of(c);
  EXPECT_NE(msg.find("train.sample_prompt: encoding \"the quick\" needs a tokenizer"), std::string::npos) << msg;
  c.sample_tokens = 0;  // (no sample drawn: nothing to encode)
  EXPECT_EQ(open_run_data(c, "run.toml").tokenizer, nullptr);
  c.sample_tokens = 64;
  c.sample_prompt.clear();
  // Half of a tokenizer's pair is a broken tokenizer, named, not none.
  fs::copy_file(d.p / "tok" / "vocab.bpe", d.p / "other" / "vocab.bpe");
  msg = error_of(c);
  EXPECT_NE(msg.find((d.p / "other").string() + ": vocab.bpe without encoder.json"), std::string::npos) << msg;
}

// A model far beyond the host's memory is refused before any of it is allocated (a billion
// layers ran into the kernel's out-of-memory killer 45 s into building the model).
TEST(RunData, AModelBeyondTheHostsMemoryIsRefused) {
  TmpDir d("host");
  data::write_shard((d.p / "train_000.bin").string(), pattern(4000, 97), 97);
  TrainConfig c = config_for(d.p);
  c.n_layer = 1000000000;
  const std::string msg = error_of(c);
  EXPECT_NE(msg.find("run.toml: model.n_layer 1000000000"), std::string::npos) << msg;
  EXPECT_NE(msg.find("of memory"), std::string::npos) << msg;
  c.n_layer = 1;
  c.dp = 1 << 30;  // a replica per data-parallel rank
  EXPECT_NE(error_of(c).find("parallel.dp 1073741824"), std::string::npos);
}

TEST(Checkpoint, WithoutLatestTheNewestCompleteCheckpointIsResumed) {
  TmpDir d("latest");
  EXPECT_EQ(latest_checkpoint(d.p.string()), "");
  for (const char* n : {"ckpt_00000003", "ckpt_00000006", "ckpt_00000009"}) {
    fs::create_directories(d.p / n);
    std::ofstream(d.p / n / "manifest.json") << "{}";
  }
  std::ofstream(d.p / "ckpt_00000003" / "state.safetensors") << "x";      // version 2: one file
  std::ofstream(d.p / "ckpt_00000006" / "rank_00000.safetensors") << "x";  // version 3: rank files
  // ckpt_00000009 has no state: incomplete, never the one to resume.
  EXPECT_EQ(latest_checkpoint(d.p.string()), (d.p / "ckpt_00000006").string());
  std::ofstream(d.p / "latest") << "ckpt_00000003\n";
  EXPECT_EQ(latest_checkpoint(d.p.string()), (d.p / "ckpt_00000003").string());
}

TEST(Metrics, ResumingDropsLaterStepsOfAnyNumberAndKeepsWhatItCannotRead) {
  TmpDir d("metrics");
  const fs::path m = d.p / "metrics.jsonl";
  std::ofstream(m) << "{\"step\": 1, \"loss\": 5.0}\n"
                      "{\"step\": \"2\", \"loss\": 4.0}\n"  // edited by hand: its step is unknown
                      "not json\n"
                      "{\"step\": 3, \"loss\": 3.0}\n"
                      "{\"step\": 4, \"loss\": 2.0}\n"
                      "{\"step\": 5.0, \"loss\": 1.5}\n"                   // a step of the resumed run's
                      "{\"step\": 18446744073709551615, \"loss\": 1.0}\n"  // (int64 -1 if read as one)
                      "{\"step\": 2.5, \"loss\": 1.0}\n"
                      "{\"step\": 5, \"lo";                 // torn by a kill
  truncate_metrics(m.string(), 3);
  EXPECT_EQ(read_file(m),
            "{\"step\": 1, \"loss\": 5.0}\n"
            "{\"step\": \"2\", \"loss\": 4.0}\n"
            "not json\n"
            "{\"step\": 3, \"loss\": 3.0}\n"
            "{\"step\": 2.5, \"loss\": 1.0}\n");
  std::vector<std::pair<double, double>> train, val;
  read_loss_points(m.string(), train, val);  // the plot skips what it cannot read
  EXPECT_EQ(train.size(), 3u);
}

TEST(TrainConfig, StringsMustBeUtf8) {
  TrainConfig c;
  c.sample_prompt = "caf\xc3\xa9";  // "café": fine
  EXPECT_NO_THROW(c.validate("run.toml"));
  c.sample_prompt = "\xff";
  try {
    c.validate("run.toml");
    ADD_FAILURE() << "accepted a prompt that is not UTF-8";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("run.toml: train.sample_prompt: is not valid UTF-8"), std::string::npos)
        << e.what();
  }
  c.sample_prompt.clear();
  c.out_dir = "runs/\xc3";  // a truncated sequence
  EXPECT_THROW(c.validate("run.toml"), Error);
}

// The unigram baseline reads each split whole up to its limit; past it, chunks spread over the
// split (rank 0 computes it while the other ranks wait at their first collective, which a pass over
// billions of tokens outlasted). A split whose halves differ is still represented by both.
TEST(RunData, TheUnigramBaselineSpreadsItsSampleOverALargeSplit) {
  TmpDir d("unigram");
  std::vector<uint32_t> train(300000, 1), val(1000);
  std::fill(train.begin() + 150000, train.end(), 2u);
  for (size_t i = 0; i < val.size(); ++i) val[i] = 1 + uint32_t(i % 2);
  data::write_shard((d.p / "train_000.bin").string(), train, 4);
  data::write_shard((d.p / "val_000.bin").string(), val, 4);
  const data::Loader tl(d.p.string(), "train", 8, 0), vl(d.p.string(), "val", 8, 0);
  // Whole: add-one counts 150001, 150001, 1, 1.
  const UnigramBaseline whole = unigram_loss(tl, &vl, 4);
  EXPECT_EQ(whole.counted, 300000u);
  EXPECT_EQ(whole.scored, 1000u);
  EXPECT_NEAR(whole.loss, -std::log(150001.0 / 300004.0), 1e-12);
  // Two chunks of 64K, the split's first and last (the first 2^17 tokens alone would hold no 2, and
  // score the half of val that is 2 at log(65538 x 2)): add-one counts 65537, 65537, 1 and 1.
  const UnigramBaseline part = unigram_loss(tl, &vl, 4, uint64_t(1) << 17);
  EXPECT_EQ(part.counted, uint64_t(1) << 17);
  EXPECT_EQ(part.scored, 1000u);
  EXPECT_NEAR(part.loss, -std::log(65537.0 / 131076.0), 1e-12);
  // Many shards smaller than a chunk: still at most the limit in all (a chunk a shard read 5x it).
  TmpDir many("unigram_many");
  for (int i = 0; i < 10; ++i)
    data::write_shard((many.p / fmt::format("train_{:03d}.bin", i)).string(), std::vector<uint32_t>(70000, 1u + uint32_t(i % 2)), 4);
  const data::Loader ml(many.p.string(), "train", 8, 0);
  const UnigramBaseline spread = unigram_loss(ml, nullptr, 4, uint64_t(1) << 17);
  EXPECT_EQ(spread.counted, uint64_t(1) << 17);
  EXPECT_EQ(spread.scored, uint64_t(1) << 17);
}

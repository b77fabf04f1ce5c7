// A checkpoint knows its vocabulary: resuming on another corpus whose tokenizer has the same size,
// or `loom generate` with such a tokenizer, is refused naming the manifest and the tokenizer (the
// ids would mean other text), and nothing already written is touched. Through the loom executable
// on two small corpora prepared by `loom prepare`.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "data/shard.h"
#include "data/tokenizer.h"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::test;

namespace {

// Text whose BPE vocabulary of 270 differs from another seed's (other words, other merges).
void write_text(const fs::path& path, int seed) {
  std::ofstream f(path);
  const char* words[2][6] = {{"river", "stone", "lantern", "harbour", "meadow", "thistle"},
                             {"copper", "violin", "glacier", "orchard", "falcon", "saffron"}};
  for (int i = 0; i < 3000; ++i)
    f << words[seed][i % 6] << ' ' << words[seed][(i * 7 + 3) % 6] << (i % 11 == 0 ? ".\n" : " ");
}

}  // namespace

TEST(VocabularyCli, CheckpointsRefuseAnotherVocabularyOfTheSameSize) {
  LOOM_REQUIRE_LOOM();
  const fs::path root = fs::temp_directory_path() / fmt::format("loom_vocab_cli_{}", ::getpid());
  fs::remove_all(root);
  fs::create_directories(root / "logs");
  for (int s : {0, 1}) {
    const fs::path text = root / fmt::format("text{}.txt", s), data = root / fmt::format("data{}", s);
    write_text(text, s);
    CliRun p = loom_cli(fmt::format("prepare '{}' --out '{}' --vocab-size 270", text.string(), data.string()),
                        root / "logs");
    ASSERT_EQ(p.code, 0) << p.err;
  }
  const auto tok0 = data::Tokenizer::from_dir((root / "data0").string());
  const auto tok1 = data::Tokenizer::from_dir((root / "data1").string());
  ASSERT_EQ(tok0.vocab_size(), tok1.vocab_size()) << "the test needs two vocabularies of one size";
  ASSERT_NE(tok0.fingerprint(), tok1.fingerprint());

  const std::string run = (root / "run").string();
  const std::string flags =
      "--model.n_layer 1 --model.n_head 2 --model.n_embd 32 --data.seq_len 16 --train.batch_size 4 "
      "--train.eval_every 0 --train.sample_tokens 0 --train.threads 1 --quiet";
  CliRun a = loom_cli(fmt::format("train --data.dir '{}' --train.out_dir '{}' --train.steps 3 {}",
                                  (root / "data0").string(), run, flags),
                      root / "logs");
  ASSERT_EQ(a.code, 0) << a.err;
  const std::string metrics_before = [&] {
    std::ifstream f(fs::path(run) / "metrics.jsonl");
    return std::string(std::istreambuf_iterator<char>(f), {});
  }();

  // Resuming on the other corpus: refused, naming the manifest; the run's files stay as they were.
  CliRun r = loom_cli(fmt::format("train --data.dir '{}' --train.out_dir '{}' --train.steps 6 --resume {}",
                                  (root / "data1").string(), run, flags),
                      root / "logs");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("manifest.json: the checkpoint was trained with vocabulary " + tok0.fingerprint()),
            std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find(tok1.fingerprint()), std::string::npos) << r.err;
  std::ifstream f(fs::path(run) / "metrics.jsonl");
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(f), {}), metrics_before);
  // On its own corpus it resumes.
  CliRun ok = loom_cli(fmt::format("train --data.dir '{}' --train.out_dir '{}' --train.steps 6 --resume {}",
                                   (root / "data0").string(), run, flags),
                       root / "logs");
  EXPECT_EQ(ok.code, 0) << ok.err;

  // generate: the other tokenizer is refused, the checkpoint's own (found beside its data) works.
  CliRun g = loom_cli(fmt::format("generate '{}' --prompt 'river' --tokens 4 --tokenizer '{}'", run,
                                  (root / "data1").string()),
                      root / "logs");
  EXPECT_NE(g.code, 0);
  EXPECT_NE(g.err.find("the checkpoint was trained with vocabulary"), std::string::npos) << g.err;
  CliRun g0 = loom_cli(fmt::format("generate '{}' --prompt 'river' --tokens 4", run), root / "logs");
  EXPECT_EQ(g0.code, 0) << g0.err;
  // eval --tokens: a shard of the other vocabulary (its tokenizer beside it) is refused, naming
  // both; the run's own shard is evaluated.
  CliRun e1 = loom_cli(fmt::format("eval '{}' --tokens '{}' --seq 16", run, (root / "data1" / "train_000.bin").string()),
                       root / "logs");
  EXPECT_NE(e1.code, 0);
  EXPECT_NE(e1.err.find("train_000.bin: encoded with vocabulary " + tok1.fingerprint()), std::string::npos) << e1.err;
  EXPECT_NE(e1.err.find("trained with vocabulary " + tok0.fingerprint()), std::string::npos) << e1.err;
  CliRun e0 = loom_cli(fmt::format("eval '{}' --tokens '{}' --seq 16", run, (root / "data0" / "train_000.bin").string()),
                       root / "logs");
  EXPECT_EQ(e0.code, 0) << e0.err;
  // A shard alone (no tokenizer beside it) of another vocabulary size than the model's, and one
  // whose header disagrees with the tokenizer beside it: refused, naming the shard and both sizes.
  fs::create_directories(root / "lone");
  data::write_shard((root / "lone" / "val_000.bin").string(), std::vector<uint32_t>(100, 7), 200);
  CliRun lone = loom_cli(fmt::format("eval '{}' --tokens '{}' --seq 16", run, (root / "lone" / "val_000.bin").string()),
                         root / "logs");
  EXPECT_NE(lone.code, 0);
  EXPECT_NE(lone.err.find(fmt::format("val_000.bin: its vocabulary has 200 tokens and {}/ckpt_", run)), std::string::npos)
      << lone.err;
  EXPECT_NE(lone.err.find("no tokenizer beside the shard"), std::string::npos) << lone.err;
  // ... but a model given a larger vocabulary than its data's (model.vocab_size) scores a lone
  // shard of that data. (Its samples are drawn from the ids its tokenizer decodes: its final
  // sample failed, after the checkpoint, on an id beyond them.)
  const std::string wide = (root / "wide").string();
  CliRun w = loom_cli(fmt::format("train --data.dir '{}' --train.out_dir '{}' --train.steps 1 --model.vocab_size 512 {} "
                                  "--train.sample_tokens 64",
                                  (root / "data0").string(), wide, flags),
                      root / "logs");
  ASSERT_EQ(w.code, 0) << w.err;
  fs::create_directories(root / "lone0");
  fs::copy_file(root / "data0" / "train_000.bin", root / "lone0" / "train_000.bin");
  CliRun wl = loom_cli(fmt::format("eval '{}' --tokens '{}' --seq 16", wide, (root / "lone0" / "train_000.bin").string()),
                       root / "logs");
  EXPECT_EQ(wl.code, 0) << wl.err;
  // A validation split shorter than one batch: the run trains and says there is no validation
  // (its loss was NaN, which now stops a run as diverged).
  fs::create_directories(root / "shortval");
  for (const char* f : {"train_000.bin", "encoder.json", "vocab.bpe"})
    fs::copy_file(root / "data0" / f, root / "shortval" / f);
  data::write_shard((root / "shortval" / "val_000.bin").string(), std::vector<uint32_t>(20, 7),
                    uint32_t(tok0.vocab_size()));
  CliRun sv = loom_cli(fmt::format("train --data.dir '{}' --train.out_dir '{}' --train.steps 2 {} --train.eval_every 1",
                                   (root / "shortval").string(), (root / "shortrun").string(), flags),
                       root / "logs");
  EXPECT_EQ(sv.code, 0) << sv.err;
  fs::copy_file(root / "lone" / "val_000.bin", root / "data0" / "odd_000.bin");
  CliRun odd = loom_cli(fmt::format("eval '{}' --tokens '{}' --seq 16", run, (root / "data0" / "odd_000.bin").string()),
                        root / "logs");
  EXPECT_NE(odd.code, 0);
  EXPECT_NE(odd.err.find(fmt::format("odd_000.bin: its header's vocabulary has 200 tokens, but the tokenizer beside it "
                                     "has {}",
                                     tok0.vocab_size())),
            std::string::npos)
      << odd.err;
  fs::remove_all(root);
}

// `loom prepare --tokenizer B` into a directory an earlier prepare wrote with vocabulary A is refused
// without --overwrite, and with it leaves B's files there beside B's shards (A's would decode B's
// ids into other text); a prepare that fails leaves the earlier dataset byte for byte and no
// staging folder.
TEST(VocabularyCli, PrepareLeavesTheTokenizerOfItsShardsAndKeepsTheDatasetWhenItFails) {
  LOOM_REQUIRE_LOOM();
  const fs::path root = fs::temp_directory_path() / fmt::format("loom_prepare_cli_{}", ::getpid());
  fs::remove_all(root);
  fs::create_directories(root / "logs");
  for (int s : {0, 1}) write_text(root / fmt::format("text{}.txt", s), s);
  const fs::path data = root / "data", tok_b = root / "tok_b";
  auto prepare = [&](const std::string& args) { return loom_cli("prepare " + args, root / "logs"); };
  CliRun b = prepare(fmt::format("'{}' --out '{}' --vocab-size 270", (root / "text1.txt").string(), tok_b.string()));
  ASSERT_EQ(b.code, 0) << b.err;
  CliRun a = prepare(fmt::format("'{}' --out '{}' --vocab-size 270", (root / "text0.txt").string(), data.string()));
  ASSERT_EQ(a.code, 0) << a.err;
  ASSERT_NE(data::Tokenizer::from_dir(data.string()).fingerprint(),
            data::Tokenizer::from_dir(tok_b.string()).fingerprint());
  // Another dataset in --out only with --overwrite (runs trained on it read its tokenizer).
  const std::string a_print = data::Tokenizer::from_dir(data.string()).fingerprint();
  CliRun held = prepare(fmt::format("'{}' --out '{}' --tokenizer '{}'", (root / "text0.txt").string(), data.string(),
                                    tok_b.string()));
  EXPECT_NE(held.code, 0);
  EXPECT_NE(held.err.find("--out " + data.string() + " holds a dataset (train_000.bin and 1 more shards)"), std::string::npos)
      << held.err;
  EXPECT_EQ(data::Tokenizer::from_dir(data.string()).fingerprint(), a_print);
  CliRun again = prepare(fmt::format("'{}' --out '{}' --tokenizer '{}' --overwrite", (root / "text0.txt").string(),
                                     data.string(), tok_b.string()));
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_EQ(data::Tokenizer::from_dir(data.string()).fingerprint(),
            data::Tokenizer::from_dir(tok_b.string()).fingerprint());
  auto bytes = [](const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  std::map<std::string, std::string> before;
  for (const auto& e : fs::directory_iterator(data)) before[e.path().filename().string()] = bytes(e.path());
  // A tokenizer folder that holds no tokenizer: refused, the dataset kept.
  fs::create_directories(root / "empty");
  CliRun bad = prepare(fmt::format("'{}' --out '{}' --tokenizer '{}' --overwrite", (root / "text1.txt").string(),
                                   data.string(), (root / "empty").string()));
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.err.find("nothing in --out " + data.string() + " was changed"), std::string::npos) << bad.err;
  std::map<std::string, std::string> after;
  for (const auto& e : fs::directory_iterator(data)) after[e.path().filename().string()] = bytes(e.path());
  EXPECT_EQ(after, before);
  EXPECT_FALSE(fs::exists(data / ".prepare_tmp"));
  // A tokenizer folder used as its own --out keeps every file it had (vocab.json + merges.txt
  // beside encoder.json + vocab.bpe, as a model folder holds them).
  const fs::path model = root / "model";
  fs::create_directories(model);
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"encoder.json", "encoder.json"}, {"vocab.bpe", "vocab.bpe"}, {"encoder.json", "vocab.json"},
           {"vocab.bpe", "merges.txt"}})
    fs::copy_file(tok_b / from, model / to);
  CliRun own = prepare(fmt::format("'{}' --out '{}' --tokenizer '{}'", (root / "text0.txt").string(), model.string(),
                                   model.string()));
  ASSERT_EQ(own.code, 0) << own.err;
  for (const char* f : {"encoder.json", "vocab.bpe", "vocab.json", "merges.txt", "train_000.bin"})
    EXPECT_TRUE(fs::exists(model / f)) << f;
  // A dataset without validation shards trains, and says validation is off.
  CliRun noval = prepare(fmt::format("'{}' --out '{}' --tokenizer '{}' --val-fraction 0", (root / "text0.txt").string(),
                                     (root / "noval").string(), tok_b.string()));
  ASSERT_EQ(noval.code, 0) << noval.err;
  EXPECT_FALSE(fs::exists(root / "noval/val_000.bin"));
  // A fraction that is not a number from 0 to 0.5 (nan compares false with both bounds) and shards
  // of fewer than 2^16 tokens are refused before anything is read or written.
  for (const std::string bad : {"--val-fraction nan", "--val-fraction 0.6", "--shard-tokens 1"}) {
    CliRun r = prepare(fmt::format("'{}' --out '{}' --tokenizer '{}' {}", (root / "text0.txt").string(),
                                   (root / "badflag").string(), tok_b.string(), bad));
    EXPECT_NE(r.code, 0) << bad << ": " << r.err;
    EXPECT_NE(r.err.find(bad.substr(0, bad.find(' '))), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(root / "badflag")) << bad;
  }
  CliRun t = loom_cli(fmt::format("train --data.dir '{}' --train.out_dir '{}' --train.steps 1 --train.eval_every 1 "
                                  "--model.n_layer 1 --model.n_head 2 --model.n_embd 32 --data.seq_len 16 "
                                  "--train.batch_size 2 --train.sample_tokens 0 --train.threads 1",
                                  (root / "noval").string(), (root / "run").string()),
                      root / "logs");
  ASSERT_EQ(t.code, 0) << t.err;
  EXPECT_NE(t.out.find("(no val_*.bin: no validation, train.eval_every = 1 unused)"), std::string::npos) << t.out;
  fs::remove_all(root);
}

// `loom prepare` lays out each input file as a document the way the tokenizer's models saw them:
// tokenizer.json's post-processor's tokens around it (Llama 3's <|begin_of_text|> before), then
// its end of text (here <|end_of_text|>, Llama 3's name; a vocabulary with no end of text and no
// template joins its files, said on stderr); `loom tokenizer encode --template` and
// `loom eval --text` add the same template.
TEST(VocabularyCli, PrepareMarksEachDocumentAsTheTokenizerDoes) {
  LOOM_REQUIRE_LOOM();
  const fs::path root = fs::temp_directory_path() / fmt::format("loom_prepare_docs_{}", ::getpid());
  fs::remove_all(root);
  fs::create_directories(root / "logs");
  // A byte-level vocabulary of the 256 bytes and two special tokens, with Llama 3's template.
  auto write_tokenizer = [&](const fs::path& dir, bool with_template, const char* eot) {
    nlohmann::json vocab = nlohmann::json::object();
    for (int b = 0; b < 256; ++b) {
      const uint32_t cp = data::gpt2_byte_to_char(uint8_t(b));
      std::string key;
      if (cp < 0x80) key += char(cp);
      else key += char(0xC0 | (cp >> 6)), key += char(0x80 | (cp & 0x3F));
      vocab[key] = b;
    }
    nlohmann::json j = {
        {"added_tokens",
         {{{"id", 256}, {"content", "<|begin_of_text|>"}, {"special", true}}, {{"id", 257}, {"content", eot}, {"special", true}}}},
        {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
        {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
    if (with_template)
      j["post_processor"] = nlohmann::json::parse(R"({"type": "TemplateProcessing",
          "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
          "pair": [], "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [256],
          "tokens": ["<|begin_of_text|>"]}}})");
    fs::create_directories(dir);
    std::ofstream(dir / "tokenizer.json") << j.dump();
  };
  std::ofstream(root / "a.txt") << "one";
  std::ofstream(root / "b.txt") << "two!";
  write_tokenizer(root / "llama3", true, "<|end_of_text|>");
  CliRun p = loom_cli(fmt::format("prepare '{}' '{}' --out '{}' --tokenizer '{}' --val-fraction 0 --shard-tokens 65536",
                                  (root / "a.txt").string(), (root / "b.txt").string(), (root / "data").string(),
                                  (root / "llama3").string()),
                      root / "logs");
  ASSERT_EQ(p.code, 0) << p.out << p.err;
  EXPECT_NE(p.out.find("documents (input files): <|begin_of_text|> text <|end_of_text|>"), std::string::npos) << p.out;
  const data::Shard s((root / "data" / "train_000.bin").string());
  std::vector<int32_t> got(s.size());
  s.read(0, s.size(), got.data());
  EXPECT_EQ(got, (std::vector<int32_t>{256, 'o', 'n', 'e', 257, 256, 't', 'w', 'o', '!', 257}));
  CliRun enc = loom_cli(fmt::format("tokenizer encode --vocab '{}' --text one --template", (root / "llama3").string()),
                        root / "logs");
  ASSERT_EQ(enc.code, 0) << enc.err;
  EXPECT_EQ(enc.out, "256 111 110 101\n");
  // No end of text among the special tokens and no template: joined, with a warning.
  write_tokenizer(root / "plain", false, "<eot>");
  CliRun q = loom_cli(fmt::format("prepare '{}' '{}' --out '{}' --tokenizer '{}' --val-fraction 0",
                                  (root / "a.txt").string(), (root / "b.txt").string(), (root / "data2").string(),
                                  (root / "plain").string()),
                      root / "logs");
  ASSERT_EQ(q.code, 0) << q.out << q.err;
  EXPECT_NE(q.err.find("loom: warning: the tokenizer has no end of text"), std::string::npos) << q.err;
  // The end of text written in a file (TinyStories' separator) is plain text, said with its count;
  // --allow-special reads it as the token.
  std::ofstream(root / "c.txt") << "a<|end_of_text|>b<|end_of_text|>";
  auto prepare_c = [&](const std::string& out, const std::string& extra) {
    return loom_cli(fmt::format("prepare '{}' --out '{}' --tokenizer '{}' --val-fraction 0 {}",
                                (root / "c.txt").string(), (root / out).string(), (root / "llama3").string(), extra),
                    root / "logs");
  };
  auto shard_of = [&](const std::string& out) {
    const data::Shard sh((root / out / "train_000.bin").string());
    std::vector<int32_t> ids(sh.size());
    sh.read(0, sh.size(), ids.data());
    return ids;
  };
  CliRun literal = prepare_c("data3", "");
  ASSERT_EQ(literal.code, 0) << literal.err;
  EXPECT_NE(literal.err.find("c.txt holds the end of text '<|end_of_text|>' 2 times, encoded as plain text; "
                             "--allow-special reads it"),
            std::string::npos)
      << literal.err;
  EXPECT_EQ(shard_of("data3").size(), 1 + 2 * (1 + 15) + 1u);  // (each byte of the mark a token)
  CliRun special = prepare_c("data4", "--allow-special");
  ASSERT_EQ(special.code, 0) << special.err;
  EXPECT_EQ(special.err.find("holds the end of text"), std::string::npos) << special.err;
  // (The file's own last end of text ends its document: none is added after it.)
  EXPECT_EQ(shard_of("data4"), (std::vector<int32_t>{256, 'a', 257, 'b', 257}));
  fs::remove_all(root);
}

// loom tokenizer {train, encode, decode}: byte-level BPE vocabularies in GPT-2's file format.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>

#include "cli/command.h"
#include "core/error.h"
#include "core/file.h"
#include "data/bpe_train.h"
#include "data/tokenizer.h"

namespace loom::cli {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Output to a file (--out: written whole or not at all, at finish()) or stdout.
class Output {
 public:
  explicit Output(const std::string& path) {
    if (path.empty()) return;
    try {
      file_ = std::make_unique<AtomicFile>(path);
    } catch (const Error& e) {
      throw Error(fmt::format("--out: {} (without --out the output goes to standard output)", e.what()));
    }
  }
  void write(std::string_view s) {
    if (file_) file_->write(s);
    else std::fwrite(s.data(), 1, s.size(), stdout);
  }
  void finish() {
    if (file_) file_->commit();
  }

 private:
  std::unique_ptr<AtomicFile> file_;
};

struct TrainArgs {
  int32_t vocab_size = 0;
  std::string out;
  std::vector<std::string> special = {"<|endoftext|>"};
  bool no_special = false;
  int64_t min_frequency = 2;
  std::vector<std::string> files;
};

int run_train(const TrainArgs& a) {
  data::TrainOptions opt;
  opt.vocab_size = a.vocab_size;
  opt.special_tokens = a.no_special ? std::vector<std::string>{} : a.special;
  opt.min_frequency = a.min_frequency;
  const auto t0 = Clock::now();
  data::BpeTrainer trainer(opt);
  for (const std::string& f : a.files) trainer.add_file(f);
  const double t_count = seconds_since(t0);
  const data::Tokenizer tok = trainer.train();
  tok.save(a.out);
  const auto& s = trainer.stats();
  std::fprintf(stderr,
               "tokenizer train: %zu bytes, %zu words (%zu distinct) in %.2f s; %zu merges in %.2f "
               "s; vocabulary %d -> %s/encoder.json, vocab.bpe\n",
               s.bytes, s.words, s.unique_words, t_count, s.merges, seconds_since(t0) - t_count,
               tok.vocab_size(), a.out.c_str());
  if (s.stopped_early) {
    std::fprintf(stderr,
                 "tokenizer train: stopped before --vocab-size %d: no pair occurs %lld times or "
                 "more\n", a.vocab_size, static_cast<long long>(a.min_frequency));
  }
  return 0;
}

struct EncodeArgs {
  std::string vocab;
  std::vector<std::string> files;
  std::string text;
  std::string out;
  bool allow_special = false;
  bool with_template = false;
  int threads = 1;
  bool stats = false;
};

int run_encode(const EncodeArgs& a) {
  auto t0 = Clock::now();
  const data::Tokenizer tok = data::Tokenizer::from_dir(a.vocab);
  const double t_load = seconds_since(t0);
  data::EncodeOptions opt;
  opt.allow_special = a.allow_special;
  opt.threads = a.threads;
  std::vector<std::pair<std::string, std::string>> inputs;  // (name, text)
  if (!a.text.empty()) inputs.emplace_back("--text", a.text);
  for (const std::string& f : a.files) inputs.emplace_back(f, read_input(f));
  if (a.text.empty() && a.files.empty()) inputs.emplace_back("-", read_input("-"));
  Output out(a.out);
  size_t bytes = 0, tokens = 0;
  double t_encode = 0;
  std::string line;
  for (const auto& [name, text] : inputs) {
    t0 = Clock::now();
    std::vector<int32_t> ids = tok.encode(text, opt);
    t_encode += seconds_since(t0);
    if (a.with_template) {
      ids.insert(ids.begin(), tok.template_prefix().begin(), tok.template_prefix().end());
      ids.insert(ids.end(), tok.template_suffix().begin(), tok.template_suffix().end());
    }
    bytes += text.size();
    tokens += ids.size();
    line.clear();
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) line.push_back(' ');
      fmt::format_to(std::back_inserter(line), "{}", ids[i]);
    }
    line.push_back('\n');
    out.write(line);
  }
  out.finish();
  if (a.stats) {
    std::fprintf(stderr,
                 "loom: %zu bytes -> %zu tokens in %.3f s: %.2f MB/s (%d thread%s; vocabulary "
                 "loaded in %.3f s)\n",
                 bytes, tokens, t_encode, t_encode > 0 ? double(bytes) / 1e6 / t_encode : 0.0,
                 a.threads, a.threads == 1 ? "" : "s", t_load);
  }
  return 0;
}

struct DecodeArgs {
  std::string vocab;
  std::vector<std::string> files;
  std::string out;
};

int run_decode(const DecodeArgs& a) {
  const data::Tokenizer tok = data::Tokenizer::from_dir(a.vocab);
  std::vector<std::string> files = a.files;
  if (files.empty()) files.push_back("-");
  Output out(a.out);
  for (const std::string& f : files) {
    const std::string text = read_input(f);
    std::vector<int32_t> ids;
    const char* p = text.data();
    const char* end = p + text.size();
    auto space = [](char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r' || c == ','; };
    while (p < end) {
      if (space(*p)) {
        ++p;
        continue;
      }
      const char* q = p;
      while (q < end && !space(*q)) ++q;
      int64_t v = 0;
      bool ok = q - p <= 10;
      for (const char* c = p; ok && c < q; ++c) {
        ok = *c >= '0' && *c <= '9';
        v = v * 10 + (*c - '0');
      }
      if (!ok || v >= tok.vocab_size()) {
        throw Error(fmt::format("{}: token {} \"{}\" is not an id of the vocabulary (0..{})", f,
                                ids.size() + 1, std::string_view(p, size_t(std::min<ptrdiff_t>(q - p, 20))),
                                tok.vocab_size() - 1));
      }
      ids.push_back(int32_t(v));
      p = q;
    }
    out.write(tok.decode(ids));
  }
  out.finish();
  return 0;
}

Command make_command() {
  return Command{
      "tokenizer", "byte-level BPE: train a vocabulary, encode text to ids, decode ids to text",
      [](CLI::App& app) -> std::function<int()> {
        app.require_subcommand(1);
        auto train = std::make_shared<TrainArgs>();
        auto enc = std::make_shared<EncodeArgs>();
        auto dec = std::make_shared<DecodeArgs>();

        CLI::App* t = app.add_subcommand(
            "train", "learn merges from text files; writes OUT/encoder.json and OUT/vocab.bpe");
        t->add_option("--vocab-size", train->vocab_size,
                      "final vocabulary size: 256 bytes + merges + special tokens")
            ->required()
            ->check(CLI::Range(256, 1 << 24));
        t->add_option("--out", train->out, "output folder")->required();
        CLI::Option* special = t->add_option("--special", train->special,
                                             "special tokens appended to the vocabulary (default <|endoftext|>)");
        t->add_flag("--no-special", train->no_special, "add no special tokens")->excludes(special);
        t->add_option("--min-frequency", train->min_frequency,
                      "stop when the most frequent pair occurs fewer times (default 2)");
        t->add_option("files", train->files, "training text")->required()->check(CLI::ExistingFile);

        CLI::App* e = app.add_subcommand(
            "encode", "print the token ids of each input (files, --text or stdin), one line each");
        e->add_option("--vocab", enc->vocab,
                      "folder with encoder.json + vocab.bpe, tokenizer.json, or vocab.json + merges.txt")
            ->required();
        e->add_option("--text", enc->text, "encode this text");
        e->add_option("--out", enc->out, "write the ids here instead of stdout");
        e->add_flag("--allow-special", enc->allow_special,
                    "recognise special tokens such as <|endoftext|> in the text");
        e->add_flag("--template", enc->with_template,
                    "put the special tokens of tokenizer.json's post-processor around each input, as Hugging "
                    "Face's tokenizer(text) does (Llama 3's <|begin_of_text|> before)");
        e->add_option("--threads", enc->threads, "encoding threads (default 1)")
            ->check(CLI::Range(1, 256));
        e->add_flag("--stats", enc->stats, "report bytes, tokens and MB/s on stderr");
        e->add_option("files", enc->files, "input files ('-' for stdin)");

        CLI::App* d = app.add_subcommand(
            "decode", "write the bytes of token ids (separated by whitespace or commas, files or stdin)");
        d->add_option("--vocab", dec->vocab, "folder with the vocabulary")->required();
        d->add_option("--out", dec->out, "write the bytes here instead of stdout");
        d->add_option("files", dec->files, "files of ids ('-' for stdin)");

        return [t, e, d, train, enc, dec]() -> int {
          if (t->parsed()) return run_train(*train);
          if (e->parsed()) return run_encode(*enc);
          if (d->parsed()) return run_decode(*dec);
          return 1;
        };
      }};
}

const Registrar registrar(make_command());

}  // namespace
}  // namespace loom::cli

// loom prepare: text files -> a tokenizer (GPT-2's, or one trained on the text) and token shards
// train_*.bin / val_*.bin for `loom train`. Everything is written into OUT/.prepare_tmp first and
// moves into OUT only once all of it is written: a failure (a full disk, bad input) leaves OUT's
// earlier dataset as it was. OUT then holds the shards and the tokenizer files they were encoded
// with (a trained vocabulary, or a copy of --tokenizer's), never another prepare's.
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "cli/command.h"
#include "core/error.h"
#include "core/file.h"
#include "data/bpe_train.h"
#include "data/shard.h"
#include "data/tokenizer.h"

namespace fs = std::filesystem;

namespace loom::cli {
namespace {

struct PrepareArgs {
  std::vector<std::string> inputs;
  std::string out;
  std::string tokenizer;
  int64_t vocab_size = 4096;
  double val_fraction = 0.05;
  int64_t shard_tokens = 100'000'000;
  bool overwrite = false;
  bool allow_special = false;
};

// Writes the shards of one split into dir from tokens [begin, end) of the token file `tokens` (u32,
// in order); their names. One shard's tokens are in memory at a time.
std::vector<std::string> write_split(const std::string& dir, const std::string& split, const std::string& tokens,
                                     uint64_t begin, uint64_t end, int64_t per_shard, uint32_t vocab) {
  std::vector<std::string> names;
  std::FILE* f = std::fopen(tokens.c_str(), "rb");
  if (!f) throw Error(fmt::format("{}: cannot read back the tokens: {}", tokens, std::strerror(errno)));
  std::vector<uint32_t> buf;
  try {
    for (uint64_t s = begin; s < end || (s == begin && begin == end); s += uint64_t(per_shard)) {
      const uint64_t e = std::min(end, s + uint64_t(per_shard));
      buf.resize(size_t(e - s));
      if (std::fseek(f, long(s * sizeof(uint32_t)), SEEK_SET) != 0 ||
          std::fread(buf.data(), sizeof(uint32_t), buf.size(), f) != buf.size())
        throw Error(fmt::format("{}: cannot read back tokens [{}, {})", tokens, s, e));
      names.push_back(fmt::format("{}_{:03d}.bin", split, names.size()));
      data::write_shard((fs::path(dir) / names.back()).string(), buf, vocab);
      if (begin == end) break;
    }
  } catch (...) {
    std::fclose(f);
    throw;
  }
  std::fclose(f);
  return names;
}

// Moves every file of `staged` into `out` (each rename replacing a file of the same name), removes
// out's other shards (an earlier prepare's) and any tokenizer files that Tokenizer::from_dir would
// read in preference to the staged ones (another prepare's vocabulary), then `staged`. Tokenizer
// files it would not read (a model folder's vocab.json + merges.txt beside its encoder.json) stay.
void commit(const fs::path& staged, const fs::path& out) {
  auto names = [](const std::vector<std::string>& paths) {
    std::vector<std::string> v;
    for (const std::string& p : paths) v.push_back(fs::path(p).filename().string());
    return v;
  };
  std::vector<std::string> moved;
  for (const auto& e : fs::directory_iterator(staged)) moved.push_back(e.path().filename().string());
  for (const char* split : {"train", "val"})
    for (const std::string& n : names(data::list_shards(out.string(), split)))
      if (std::find(moved.begin(), moved.end(), n) == moved.end()) fs::remove(out / n);
  const std::vector<std::string> want = names(data::Tokenizer::files_in_dir(staged.string()));
  for (const std::string& n : moved) fs::rename(staged / n, out / n);
  // Until from_dir picks the staged files: each removal takes away a set it prefers.
  for (std::vector<std::string> chosen; (chosen = names(data::Tokenizer::files_in_dir(out.string()))) != want;)
    for (const std::string& n : chosen) fs::remove(out / n);
  fs::remove(staged);
}

Registrar reg{Command{
    "prepare", "tokenise text files into train/val token shards (training a BPE vocabulary unless --tokenizer)",
    [](CLI::App& sub) -> std::function<int()> {
      auto a = std::make_shared<PrepareArgs>();
      sub.add_option("inputs", a->inputs, "text files ('-' reads standard input)")->required();
      sub.add_option("--out", a->out, "output directory for shards (and the trained vocabulary)")->required();
      sub.add_option("--tokenizer", a->tokenizer, "directory with encoder.json + vocab.bpe or tokenizer.json to use as is (e.g. GPT-2's, Llama 3's)");
      sub.add_option("--vocab-size", a->vocab_size, "size of the vocabulary to train when no --tokenizer is given")
          ->check(CLI::Range(257, 1 << 24))
          ->capture_default_str();
      sub.add_option("--val-fraction", a->val_fraction, "fraction of the tokens (the end of the text) kept for validation")
          ->check(number_in(0.0, 0.5))
          ->capture_default_str();
      // (At least 2^16: a shard is a file fsynced on its own; smaller ones only make many files.)
      sub.add_option("--shard-tokens", a->shard_tokens, "tokens per shard file (at least 65536)")
          ->check(CLI::Range(int64_t(1) << 16, int64_t(1) << 40))
          ->capture_default_str();
      sub.add_flag("--overwrite", a->overwrite, "replace the dataset --out holds (its shards and tokenizer)");
      sub.add_flag("--allow-special", a->allow_special,
                   "read the tokenizer's special tokens written in the text (<|endoftext|> between documents) as "
                   "those tokens, as loom eval --text does (default: plain text, nanoGPT's encode_ordinary)");
      return [a]() -> int {
        // Another dataset in --out: the runs trained on it decode with its tokenizer, which a new
        // vocabulary would replace; only when asked (as loom train replaces a run).
        if (!a->overwrite && !a->out.empty() && fs::is_directory(a->out)) {
          std::vector<std::string> held = data::list_shards(a->out, "train");
          for (const std::string& v : data::list_shards(a->out, "val")) held.push_back(v);
          if (!held.empty())
            throw Error(fmt::format("--out {} holds a dataset ({}{}): the runs trained on it read its tokenizer; "
                                    "--overwrite to replace it, or another --out (nothing was changed)",
                                    a->out, fs::path(held.front()).filename().string(),
                                    held.size() > 1 ? fmt::format(" and {} more shards", held.size() - 1) : ""));
        }
        // The inputs are read one at a time, once per pass (standard input once, kept): memory holds
        // one input's text and its tokens, not the corpus's.
        std::string stdin_text;
        bool stdin_read = false;
        auto text_of = [&](const std::string& in) -> std::string {
          if (in != "-") return read_input(in);
          if (!stdin_read) stdin_text = read_input(in), stdin_read = true;
          return stdin_text;
        };
        size_t bytes = 0;
        for (const auto& in : a->inputs) bytes += text_of(in).size();
        LOOM_CHECK(bytes > 0, "{}: the input holds no text", a->inputs.front());
        const fs::path out(a->out), staged = out / ".prepare_tmp";
        bool made_out = false;  // (a failed prepare removes a directory it made)
        {
          std::error_code ec;
          if (a->out.empty()) throw Error("--out: an empty path");
          made_out = !fs::exists(out, ec);
          fs::create_directories(out, ec);
          if (ec || !fs::is_directory(out))
            throw Error(fmt::format("--out {}: {}", a->out, ec ? "cannot create: " + ec.message() : "is not a directory"));
        }
        bool committing = false;
        try {
          fs::remove_all(staged);  // an interrupted prepare's
          fs::create_directories(staged);
          std::unique_ptr<data::Tokenizer> tok;
          if (!a->tokenizer.empty()) {
            tok = std::make_unique<data::Tokenizer>(data::Tokenizer::from_dir(a->tokenizer));
            for (const std::string& f : data::Tokenizer::files_in_dir(a->tokenizer))
              fs::copy_file(f, staged / fs::path(f).filename());
            std::printf("tokenizer: %s (%d tokens)\n", a->tokenizer.c_str(), tok->vocab_size());
          } else {
            data::TrainOptions to;
            to.vocab_size = int32_t(a->vocab_size);
            data::BpeTrainer trainer(to);
            for (const auto& in : a->inputs) trainer.add_text(text_of(in));
            tok = std::make_unique<data::Tokenizer>(trainer.train());
            tok->save(staged.string());
            std::printf("trained a byte-level BPE vocabulary of %d tokens on %zu bytes%s\n", tok->vocab_size(), bytes,
                        tok->vocab_size() < a->vocab_size
                            ? fmt::format(" (fewer than --vocab-size {}: no pair of tokens is left that occurs at "
                                          "least {} times)",
                                          a->vocab_size, to.min_frequency)
                                  .c_str()
                            : "");
          }
          // A document is an input file: the special tokens the tokenizer's post-processor puts
          // around a text (Llama 3's <|begin_of_text|> before), then its end of text
          // (<|endoftext|>, <|end_of_text|> or </s>) where it has one and the template did not
          // end with it, as torchtitan and Megatron-LM lay out their documents.
          const int32_t eot = tok->end_of_text();
          std::vector<int32_t> before = tok->template_prefix(), after = tok->template_suffix();
          if (eot >= 0 && (after.empty() || after.back() != eot)) after.push_back(eot);
          auto names = [&](const std::vector<int32_t>& ids) {
            std::string s;
            for (int32_t id : ids) s += std::string(tok->token(id)) + " ";
            return s;
          };
          if (!before.empty() || !after.empty())
            std::printf("documents (input files): %stext%s\n", names(before).c_str(),
                        after.empty() ? "" : (" " + names(after).substr(0, names(after).size() - 1)).c_str());
          else if (a->inputs.size() > 1)
            std::fprintf(stderr,
                         "loom: warning: the tokenizer has no end of text (<|endoftext|>, <|end_of_text|> or </s> "
                         "among its special tokens) and its post-processor adds none: the %zu input files are joined "
                         "without a separator\n",
                         a->inputs.size());
          // Each document's tokens go to a file in the staging directory as it is encoded; the
          // splits are cut from it once the count is known (validation: the last tokens).
          const std::string token_file = (staged / ".tokens").string();
          std::FILE* tf = std::fopen(token_file.c_str(), "wb");
          if (!tf) throw Error(fmt::format("{}: cannot write: {}", token_file, std::strerror(errno)));
          uint64_t n_tokens = 0;
          auto put = [&](const std::vector<uint32_t>& v) {
            if (std::fwrite(v.data(), sizeof(uint32_t), v.size(), tf) != v.size()) {
              const int e = errno;
              std::fclose(tf);
              throw Error(fmt::format("{}: cannot write: {}", token_file, std::strerror(e)));
            }
            n_tokens += v.size();
          };
          for (size_t i = 0; i < a->inputs.size(); ++i) {
            const std::string text = text_of(a->inputs[i]);
            // The end of text written out in the text (TinyStories' files separate their stories
            // with "<|endoftext|>") is text unless --allow-special: said, with its count.
            if (eot >= 0 && !a->allow_special) {
              const std::string_view mark = tok->token(eot);
              size_t count = 0;
              for (size_t at = text.find(mark); at != std::string::npos; at = text.find(mark, at + mark.size()))
                ++count;
              if (count)
                std::fprintf(stderr,
                             "loom: warning: %s holds the end of text '%.*s' %zu time%s, encoded as plain text; "
                             "--allow-special reads it (and the other special tokens) as the token, as loom eval "
                             "--text and Hugging Face's tokenizer(text) do\n",
                             a->inputs[i].c_str(), int(mark.size()), mark.data(), count, count == 1 ? "" : "s");
            }
            data::EncodeOptions eo;
            eo.threads = 2;
            eo.allow_special = a->allow_special;
            const std::vector<int32_t> ids = tok->encode(text, eo);
            std::vector<uint32_t> doc;
            doc.reserve(before.size() + ids.size() + after.size());
            for (int32_t t : before) doc.push_back(uint32_t(t));
            for (int32_t t : ids) doc.push_back(uint32_t(t));
            // (A document whose text ends with its end of text, read as the token, has its end.)
            const bool ended = !ids.empty() && after.size() == 1 && ids.back() == after.front();
            if (!ended)
              for (int32_t t : after) doc.push_back(uint32_t(t));
            put(doc);
          }
          if (std::fclose(tf) != 0) throw Error(fmt::format("{}: cannot write: {}", token_file, std::strerror(errno)));
          const uint64_t n_val = uint64_t(double(n_tokens) * a->val_fraction);
          const uint64_t n_train = n_tokens - n_val;
          std::printf("%zu bytes -> %llu tokens (%.2f bytes/token); train %llu, val %llu\n", bytes,
                      static_cast<unsigned long long>(n_tokens), double(bytes) / double(n_tokens),
                      static_cast<unsigned long long>(n_train), static_cast<unsigned long long>(n_val));
          uint32_t vocab = uint32_t(tok->vocab_size());
          std::vector<std::string> written =
              write_split(staged.string(), "train", token_file, 0, n_train, a->shard_tokens, vocab);
          if (n_val)
            for (const std::string& n :
                 write_split(staged.string(), "val", token_file, n_train, n_tokens, a->shard_tokens, vocab))
              written.push_back(n);
          fs::remove(token_file);
          committing = true;
          commit(staged, out);
          for (const std::string& n : written) std::printf("  wrote %s\n", (out / n).string().c_str());
          std::printf("  tokenizer: %s/{", a->out.c_str());
          const std::vector<std::string> files = data::Tokenizer::files_in_dir(a->out);
          for (size_t i = 0; i < files.size(); ++i) std::printf("%s%s", i ? "," : "", fs::path(files[i]).filename().c_str());
          std::printf("}\n");
        } catch (const std::exception& e) {
          std::error_code ec;
          fs::remove_all(staged, ec);
          if (made_out && !committing) fs::remove(out, ec);  // (empty again: it held only the staging)
          throw Error(committing ? fmt::format("{} (while moving the new dataset into --out {}: run prepare again)",
                                               e.what(), a->out)
                                 : fmt::format("{} (nothing in --out {} was changed)", e.what(), a->out));
        }
        return 0;
      };
    }}};

}  // namespace
}  // namespace loom::cli

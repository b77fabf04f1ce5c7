#include "cli/checkpoint_tokenizer.h"

#include <filesystem>
#include <toml++/toml.h>

#include "core/error.h"
#include "train/checkpoint.h"

namespace fs = std::filesystem;

namespace loom::cli {


std::string checkpoint_tokenizer_dir(const std::string& ckpt, const std::string& explicit_dir) {
  if (!explicit_dir.empty()) {
    if (!data::Tokenizer::dir_has_tokenizer(explicit_dir))
      throw Error(fmt::format("{}: no encoder.json + vocab.bpe, tokenizer.json, or vocab.json + merges.txt in "
                              "--tokenizer",
                              explicit_dir));
    return explicit_dir;
  }
  const train::CheckpointMeta meta = train::read_checkpoint_meta(ckpt);
  if (!meta.config_toml.empty()) {
    try {
      toml::table t = toml::parse(meta.config_toml);
      for (const char* key : {"tokenizer", "dir"})
        if (auto v = t["data"][key].value<std::string>(); v && !v->empty() && data::Tokenizer::dir_has_tokenizer(*v))
          return *v;
    } catch (const toml::parse_error& e) {
      throw Error(fmt::format("{}: field 'config_toml' is not valid TOML: {}",
                              (fs::path(ckpt) / "manifest.json").string(), e.description()));
    }
  }
  // A converted model's: `loom convert --from hf` copies its tokenizer into the run directory.
  const fs::path run = fs::path(ckpt).parent_path();
  if (!run.empty() && data::Tokenizer::dir_has_tokenizer(run.string())) return run.string();
  throw Error(fmt::format("{}: no tokenizer found beside the training data; pass --tokenizer DIR (generate also takes "
                          "--ids to give and print token ids, eval --tokens for a file of them)",
                          ckpt));
}

data::Tokenizer checkpoint_tokenizer(const std::string& ckpt, const std::string& explicit_dir) {
  const std::string dir = checkpoint_tokenizer_dir(ckpt, explicit_dir);
  data::Tokenizer tok = data::Tokenizer::from_dir(dir);
  // The same size is not the same vocabulary: ids would mean other text.
  const fs::path manifest = fs::path(ckpt) / "manifest.json";
  if (fs::exists(manifest)) {
    const std::string want = train::read_checkpoint_meta(ckpt).vocabulary;
    if (!want.empty() && want != tok.fingerprint())
      throw Error(fmt::format("{}: the checkpoint was trained with vocabulary {}, but the tokenizer in {} is {} "
                              "(pass --tokenizer with the training data's directory)",
                              manifest.string(), want, dir, tok.fingerprint()));
  }
  return tok;
}

}  // namespace loom::cli

// The tokenizer of a checkpoint, for the commands that read or write text with it (generate, eval):
// --tokenizer DIR, else the data.tokenizer / data.dir of the training config in the manifest, else
// the run directory holding the checkpoint (where `loom convert --from hf` copies a model's),
// checked against the vocabulary fingerprint the checkpoint was trained with.
#pragma once
#include <string>

#include "data/tokenizer.h"

namespace loom::cli {

// The directory holding the tokenizer files (encoder.json + vocab.bpe, tokenizer.json, or
// vocab.json + merges.txt); throws naming the checkpoint, or the --tokenizer directory, when there is none.
std::string checkpoint_tokenizer_dir(const std::string& ckpt, const std::string& explicit_dir);
// That tokenizer, refused when its vocabulary is not the one the checkpoint was trained with.
data::Tokenizer checkpoint_tokenizer(const std::string& ckpt, const std::string& explicit_dir);

}  // namespace loom::cli

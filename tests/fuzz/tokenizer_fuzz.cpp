// libFuzzer target for the byte-level BPE tokenizer (not part of the CMake build). It checks, on
// arbitrary bytes: the pre-tokeniser's pieces cover the input exactly; decode(encode(x)) == x with
// and without special tokens and on several threads; the linear and heap merge loops agree.
//
// Build and run (clang, from the repository root):
//   clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -Isrc \
//     tests/fuzz/tokenizer_fuzz.cpp src/data/{unicode,bpe_merge,bpe_train,tokenizer}.cpp \
//     src/core/error.cpp -lfmt -o tokenizer_fuzz
//   ./tokenizer_fuzz -max_len=4096 -max_total_time=60
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "data/bpe_merge.h"
#include "data/bpe_pretokenize.h"
#include "data/bpe_train.h"
#include "data/tokenizer.h"

namespace {

using loom::data::Tokenizer;

// A small vocabulary trained at start-up, so the target needs no files.
const Tokenizer& tokenizer() {
  static const Tokenizer t = [] {
    loom::data::TrainOptions opt;
    opt.vocab_size = 256 + 300 + 2;
    opt.special_tokens = {"<|endoftext|>", "<|pad|>"};
    opt.min_frequency = 1;
    loom::data::BpeTrainer trainer(opt);
    trainer.add_text(
        "The quick brown fox jumps over the lazy dog. It's 42 o'clock; they'll say we'd've won.\n"
        "Ünïcödé wörds, 中文字符, числа ٣٤٥ and ½ — plus    spaces\t\ttabs\r\n and aaaaaaaaaaaa.\n");
    return trainer.train();
  }();
  return t;
}

void check(bool ok) {
  if (!ok) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);

  // Pieces are non-empty, consecutive, and cover the text.
  loom::data::PreTokenizer pre(text);
  std::string_view piece;
  size_t covered = 0;
  while (pre.next(&piece)) {
    check(!piece.empty() && piece.data() == text.data() + covered);
    covered += piece.size();
  }
  check(covered == size);

  const Tokenizer& t = tokenizer();
  const auto ids = t.encode(text);
  check(t.decode(ids) == text);
  loom::data::EncodeOptions opt;
  opt.allow_special = true;
  check(t.decode(t.encode(text, opt)) == text);
  opt.threads = 3;
  check(t.encode(text, opt) == t.encode(text, loom::data::EncodeOptions{true, 1}));

  // Both merge loops on the whole input as one word.
  std::vector<int32_t> a, b;
  for (uint8_t c : text) a.push_back(t.byte_token(c));
  b = a;
  loom::data::BpeScratch scratch;
  a.resize(loom::data::bpe_merge_linear(t.merge_table(), a.data(), a.size(), scratch));
  b.resize(loom::data::bpe_merge_heap(t.merge_table(), b.data(), b.size(), scratch));
  check(a == b);
  return 0;
}

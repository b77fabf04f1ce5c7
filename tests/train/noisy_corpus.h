// A corpus with structure for the training tests that kill and resume runs: a noisy repeating
// pattern over a vocabulary of 97 (DIR/train_000.bin, 20000 tokens; DIR/val_000.bin, the first 2000).
#pragma once
#include <cstdint>
#include <filesystem>
#include <random>
#include <vector>

#include "data/shard.h"

namespace loom::test {

inline void write_noisy_pattern_corpus(const std::filesystem::path& dir) {
  std::filesystem::create_directories(dir);
  std::mt19937 g(5);
  std::vector<uint32_t> toks(20000);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = (g() % 4 == 0) ? g() % 97 : uint32_t((i * 7) % 97);
  data::write_shard((dir / "train_000.bin").string(), toks, 97);
  data::write_shard((dir / "val_000.bin").string(), std::vector<uint32_t>(toks.begin(), toks.begin() + 2000), 97);
}

}  // namespace loom::test

// `loom tokenizer encode` and `decode` given a folder where a file belongs: refused naming it (a
// folder opens as a stream that reads nothing, and was encoded as empty text with exit 0).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <fmt/format.h>

#include "cli_util.h"

namespace fs = std::filesystem;
using namespace loom::test;

TEST(TokenizerCli, AFolderAsAnInputFileIsRefused) {
  LOOM_REQUIRE_LOOM();
  const fs::path root = fs::temp_directory_path() / fmt::format("loom_tok_cli_{}", ::getpid());
  fs::remove_all(root);
  fs::create_directories(root / "logs");
  fs::create_directories(root / "folder");
  {
    std::ofstream f(root / "text.txt");
    for (int i = 0; i < 200; ++i) f << "the quick brown fox jumps over the lazy dog " << i << "\n";
  }
  CliRun t = loom_cli(fmt::format("tokenizer train --vocab-size 270 --out '{}' '{}'", (root / "vocab").string(),
                                  (root / "text.txt").string()),
                      root / "logs");
  ASSERT_EQ(t.code, 0) << t.err;
  for (const char* cmd : {"encode", "decode"}) {
    CliRun r = loom_cli(fmt::format("tokenizer {} --vocab '{}' '{}'", cmd, (root / "vocab").string(),
                                    (root / "folder").string()),
                        root / "logs");
    EXPECT_NE(r.code, 0) << cmd << ": " << r.out;
    EXPECT_NE(r.err.find((root / "folder").string() + ": is a directory, not a file"), std::string::npos)
        << cmd << ": " << r.err;
  }
  CliRun ok = loom_cli(fmt::format("tokenizer encode --vocab '{}' '{}'", (root / "vocab").string(),
                                   (root / "text.txt").string()),
                       root / "logs");
  EXPECT_EQ(ok.code, 0) << ok.err;
  EXPECT_FALSE(ok.out.empty());
  // Special tokens given and none asked for: refused, not one of them dropped.
  CliRun both = loom_cli(fmt::format("tokenizer train --vocab-size 270 --out '{}' '{}' --special '<x>' --no-special",
                                     (root / "vocab2").string(), (root / "text.txt").string()),
                         root / "logs");
  EXPECT_NE(both.code, 0);
  EXPECT_NE(both.err.find("--special excludes --no-special"), std::string::npos) << both.err;
  EXPECT_FALSE(fs::exists(root / "vocab2"));
  fs::remove_all(root);
}

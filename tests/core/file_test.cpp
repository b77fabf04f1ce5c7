// read_file: a folder, a missing file and an unreadable one each give an error naming the path.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "core/file.h"

namespace fs = std::filesystem;

namespace {

std::string error_of(const std::string& path) {
  try {
    loom::read_file(path);
  } catch (const loom::Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ReadFile, ReadsBytesAndNamesThePathOfWhatItCannotRead) {
  const fs::path d = fs::temp_directory_path() / ("loom_read_file_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d / "folder");
  const std::string bytes("a\0b\xff\n", 5);
  std::ofstream(d / "f.bin", std::ios::binary) << bytes;
  EXPECT_EQ(loom::read_file((d / "f.bin").string()), bytes);
  EXPECT_EQ(loom::read_input((d / "f.bin").string()), bytes);
  EXPECT_NE(error_of((d / "folder").string()).find((d / "folder").string() + ": is a directory, not a file"),
            std::string::npos);
  EXPECT_NE(error_of((d / "missing").string()).find((d / "missing").string() + ": cannot open: No such file"),
            std::string::npos)
      << error_of((d / "missing").string());
  // A read that fails part-way is an error, not a short text (Linux: /proc/self/mem at offset 0).
  EXPECT_NE(error_of("/proc/self/mem").find("/proc/self/mem: read error"), std::string::npos)
      << error_of("/proc/self/mem");
  fs::remove_all(d);
}

// read_file: a folder, a missing file and an unreadable one each give an error naming the path.
// AtomicFile: an output is written whole or not at all, never replaces a folder or a device (a
// stream is written in place), and leaves no temporary file behind whatever fails.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

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
  // A device that never ends is refused; /dev/null reads empty (stdin under nohup or cron).
  EXPECT_NE(error_of("/dev/zero").find("/dev/zero: is a device, not a file"), std::string::npos);
  EXPECT_EQ(loom::read_file("/dev/null"), "");
  fs::remove_all(d);
}

namespace {

std::string write_error(const std::string& path, const std::string& bytes) {
  try {
    loom::write_file_atomically(path, bytes);
  } catch (const loom::Error& e) {
    return e.what();
  }
  return "";
}

std::vector<std::string> names_in(const fs::path& d) {
  std::vector<std::string> n;
  for (const auto& e : fs::directory_iterator(d)) n.push_back(e.path().filename().string());
  std::sort(n.begin(), n.end());
  return n;
}

}  // namespace

TEST(AtomicFile, WritesWholeOrNothingAndNeverOverWhatIsNotAFile) {
  const fs::path d = fs::temp_directory_path() / ("loom_atomic_file_" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d / "folder");
  const std::string out = (d / "out.txt").string();
  loom::write_file_atomically(out, "first\n");
  EXPECT_EQ(loom::read_file(out), "first\n");
  loom::write_file_atomically(out, "second\n", {.durable = true});
  EXPECT_EQ(loom::read_file(out), "second\n");
  {
    loom::AtomicFile f(out, {.per_process = true});
    f.write("third\n");
    EXPECT_TRUE(fs::exists(out + "." + std::to_string(::getpid()) + ".tmp"));
    f.commit();
  }
  EXPECT_EQ(loom::read_file(out), "third\n");
  // Destroyed before commit (an exception while it was filled): the old file stays.
  try {
    loom::AtomicFile f(out);
    f.write("half of a fourth");
    throw std::runtime_error("filling failed");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(loom::read_file(out), "third\n");
  EXPECT_EQ(names_in(d), (std::vector<std::string>{"folder", "out.txt"}));

  // A folder is refused before anything is created. A stream (a device, a FIFO, /dev/stdout) is
  // written in place, as a shell's `>` would: /dev/null stays the device (a temporary file was
  // renamed over it).
  EXPECT_NE(write_error((d / "folder").string(), "x").find((d / "folder").string() + ": is a directory, not a file to write"),
            std::string::npos);
  EXPECT_EQ(write_error("/dev/null", "x"), "");
  struct stat st{};
  ASSERT_EQ(::stat("/dev/null", &st), 0);
  EXPECT_TRUE(S_ISCHR(st.st_mode));
  EXPECT_FALSE(fs::exists("/dev/null.tmp"));
  EXPECT_TRUE(fs::is_directory(d / "folder"));
  EXPECT_EQ(names_in(d), (std::vector<std::string>{"folder", "out.txt"}));

  // A symbolic link is written through: its target is replaced (beside which the temporary file
  // goes) and the link stays. The file replaced keeps its permissions.
  fs::create_directories(d / "real");
  loom::write_file_atomically((d / "real" / "t.txt").string(), "old\n");
  ::chmod((d / "real" / "t.txt").c_str(), 0600);
  fs::create_symlink(d / "real" / "t.txt", d / "link.txt");
  loom::write_file_atomically((d / "link.txt").string(), "new\n");
  EXPECT_TRUE(fs::is_symlink(d / "link.txt"));
  EXPECT_EQ(loom::read_file((d / "real" / "t.txt").string()), "new\n");
  EXPECT_EQ(fs::status(d / "real" / "t.txt").permissions() & fs::perms::all, fs::perms::owner_read | fs::perms::owner_write);
  EXPECT_EQ(names_in(d / "real"), (std::vector<std::string>{"t.txt"}));
  fs::remove(d / "link.txt");
  fs::remove_all(d / "real");
  // A folder that does not exist, and a folder where the temporary file goes.
  EXPECT_NE(write_error((d / "no" / "x").string(), "x").find("cannot create its temporary file"), std::string::npos);
  // A temporary file a killed writer left, read-only, is replaced.
  std::ofstream(d / "out.txt.tmp") << "left";
  ::chmod((d / "out.txt.tmp").c_str(), 0444);
  loom::write_file_atomically(out, "third\n");
  EXPECT_FALSE(fs::exists(d / "out.txt.tmp"));
  fs::create_directories(d / "held.tmp");
  EXPECT_NE(write_error((d / "held").string(), "x").find("its temporary file " + (d / "held.tmp").string() + " is a directory"),
            std::string::npos);

  // A write that fails part-way (past the file-size limit: EFBIG): the error names the file and
  // the reason, the old file is unchanged and the temporary file is gone.
  std::signal(SIGXFSZ, SIG_IGN);
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string e = write_error(out, std::string(10000, 'x'));
  ::setrlimit(RLIMIT_FSIZE, &old);
  EXPECT_NE(e.find(out + ": cannot write " + out + ".tmp: File too large (" + out + " is unchanged)"), std::string::npos)
      << e;
  EXPECT_EQ(loom::read_file(out), "third\n");
  EXPECT_EQ(names_in(d), (std::vector<std::string>{"folder", "held.tmp", "out.txt"}));
  fs::remove_all(d);
}

#include "core/file.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <vector>

#include "core/error.h"

namespace loom {

namespace {

// All of `in`, named `what` in errors. read() marks a failed read (EIO, a file that cannot be read)
// bad; `<< rdbuf()` would only end the copy there and return what came before it.
std::string read_all(std::istream& in, const std::string& what) {
  std::string text;
  std::vector<char> buf(size_t(1) << 16);
  for (;;) {
    errno = 0;
    in.read(buf.data(), std::streamsize(buf.size()));
    if (in.bad()) throw Error(fmt::format("{}: read error: {}", what, errno ? std::strerror(errno) : "unknown reason"));
    text.append(buf.data(), size_t(in.gcount()));
    if (!in) return text;  // end of file
  }
}

}  // namespace

std::string read_file(const std::string& path) {
  std::error_code ec;
  // A folder opens as a stream on Linux and fails on the first read (or reads nothing).
  if (std::filesystem::is_directory(path, ec)) throw Error(fmt::format("{}: is a directory, not a file", path));
  errno = 0;
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(fmt::format("{}: cannot open: {}", path, errno ? std::strerror(errno) : "unknown reason"));
  return read_all(f, path);
}

std::string read_input(const std::string& path) { return path == "-" ? read_all(std::cin, "standard input") : read_file(path); }

}  // namespace loom

#include "core/file.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <vector>

#include "core/error.h"

namespace loom {

std::string read_file(const std::string& path) {
  std::error_code ec;
  // A folder opens as a stream on Linux and fails on the first read (or reads nothing).
  if (std::filesystem::is_directory(path, ec)) throw Error(fmt::format("{}: is a directory, not a file", path));
  errno = 0;
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(fmt::format("{}: cannot open: {}", path, errno ? std::strerror(errno) : "unknown reason"));
  // read() marks a failed read (EIO, a file that cannot be read) bad; `<< rdbuf()` would only end
  // the copy there and return what came before it.
  std::string text;
  std::vector<char> buf(size_t(1) << 16);
  for (;;) {
    errno = 0;
    f.read(buf.data(), std::streamsize(buf.size()));
    if (f.bad()) throw Error(fmt::format("{}: read error: {}", path, errno ? std::strerror(errno) : "unknown reason"));
    text.append(buf.data(), size_t(f.gcount()));
    if (!f) return text;  // end of file
  }
}

std::string read_input(const std::string& path) {
  if (path != "-") return read_file(path);
  std::ostringstream ss;
  ss << std::cin.rdbuf();
  if (std::cin.bad()) throw Error("standard input: read error");
  return std::move(ss).str();
}

}  // namespace loom

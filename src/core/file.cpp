#include "core/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

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

namespace {

// What a path that exists is when it is not a regular file ("" for a regular file or none).
std::string not_a_file(const std::string& path) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0 || S_ISREG(st.st_mode)) return "";
  if (S_ISDIR(st.st_mode)) return "a directory";
  if (S_ISFIFO(st.st_mode)) return "a FIFO";
  if (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)) return "a device";
  if (S_ISSOCK(st.st_mode)) return "a socket";
  return "not a regular file";
}

std::string parent_of(const std::string& path) {
  const std::filesystem::path p = std::filesystem::path(path).parent_path();
  return p.empty() ? std::string(".") : p.string();
}

}  // namespace

void check_output_path(const std::string& path, const std::string& field) {
  const std::string who = field.empty() ? path : fmt::format("{} = {}", field, path);
  if (path.empty()) throw Error(fmt::format("{}: an output file needs a name", field.empty() ? "output" : field));
  if (const std::string what = not_a_file(path); !what.empty())
    throw Error(fmt::format("{}: is {}, not a file to write", who, what));
  const std::string dir = parent_of(path);
  struct stat st{};
  if (::stat(dir.c_str(), &st) != 0)
    throw Error(fmt::format("{}: cannot write into {}: {}", who, dir, std::strerror(errno)));
  if (!S_ISDIR(st.st_mode)) throw Error(fmt::format("{}: cannot write into {}: not a directory", who, dir));
}

AtomicFile::AtomicFile(std::string path, Options opts) : path_(std::move(path)), opts_(opts) {
  if (path_.empty()) throw Error("output file: an empty path");
  if (const std::string what = not_a_file(path_); !what.empty())
    throw Error(fmt::format("{}: is {}, not a file to write (nothing was written)", path_, what));
  tmp_ = opts_.per_process ? fmt::format("{}.{}.tmp", path_, ::getpid()) : path_ + ".tmp";
  // A temporary name taken by a folder (or a FIFO) is not removed: it is not ours.
  if (const std::string what = not_a_file(tmp_); !what.empty())
    throw Error(fmt::format("{}: its temporary file {} is {} (nothing was written)", path_, tmp_, what));
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd_ < 0) {
    const int err = errno;
    throw Error(fmt::format("{}: cannot create its temporary file {}: {}", path_, tmp_, std::strerror(err)));
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !tmp_.empty()) ::unlink(tmp_.c_str());
}

void AtomicFile::fail(const std::string& what, int err) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ::unlink(tmp_.c_str());
  committed_ = true;  // nothing left to remove
  throw Error(fmt::format("{}: {}{} ({} is unchanged)", path_, what, err ? fmt::format(": {}", std::strerror(err)) : "",
                          path_));
}

void AtomicFile::write(const void* data, size_t bytes) {
  LOOM_CHECK(fd_ >= 0 && !committed_, "{}: written after commit()", path_);
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, std::min<size_t>(bytes, size_t(1) << 30));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(fmt::format("cannot write {}", tmp_), n < 0 ? errno : ENOSPC);
    p += n;
    bytes -= size_t(n);
  }
}

void AtomicFile::commit() {
  LOOM_CHECK(fd_ >= 0 && !committed_, "{}: committed twice", path_);
  if (opts_.durable && ::fsync(fd_) != 0) fail(fmt::format("cannot sync {}", tmp_), errno);
  const int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) fail(fmt::format("cannot write {}", tmp_), errno);
  // Checked again: the path may have become a folder or a device while the file was written.
  if (const std::string what = not_a_file(path_); !what.empty()) fail(fmt::format("it is now {}", what), 0);
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) fail(fmt::format("cannot rename {} over it", tmp_), errno);
  committed_ = true;
  if (opts_.durable) {
    const int dir = ::open(parent_of(path_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    const int err = dir < 0 || ::fsync(dir) != 0 ? errno : 0;
    if (dir >= 0) ::close(dir);
    if (err) throw Error(fmt::format("{}: written, but its folder cannot be synced: {}", path_, std::strerror(err)));
  }
}

void write_file_atomically(const std::string& path, std::string_view bytes, AtomicFile::Options opts) {
  AtomicFile f(path, opts);
  f.write(bytes);
  f.commit();
}

}  // namespace loom

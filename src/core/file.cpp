#include "core/file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
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
// A stream that never ends (a pipe from `yes`) stops at this host's memory, named, rather than
// when the kernel kills the process.
std::string read_all(std::istream& in, const std::string& what) {
  const double memory = double(::sysconf(_SC_PHYS_PAGES)) * double(::sysconf(_SC_PAGESIZE));
  std::string text;
  std::vector<char> buf(size_t(1) << 16);
  for (;;) {
    errno = 0;
    in.read(buf.data(), std::streamsize(buf.size()));
    if (in.bad()) throw Error(fmt::format("{}: read error: {}", what, errno ? std::strerror(errno) : "unknown reason"));
    if (memory > 0 && double(text.size() + size_t(in.gcount())) > memory / 2)
      throw Error(fmt::format("{}: more than half of this host's memory ({:.1f} GiB) and not at its end: not an input "
                              "to read whole",
                              what, memory / 2 / double(1 << 30)));
    try {
      text.append(buf.data(), size_t(in.gcount()));
    } catch (const std::bad_alloc&) {
      throw Error(fmt::format("{}: too large to hold in memory ({} bytes read)", what, text.size()));
    }
    if (!in) return text;  // end of file
  }
}

}  // namespace

std::string read_file(const std::string& path) {
  std::error_code ec;
  // A folder opens as a stream on Linux and fails on the first read (or reads nothing).
  if (std::filesystem::is_directory(path, ec)) throw Error(fmt::format("{}: is a directory, not a file", path));
  // A device other than a terminal or /dev/null (/dev/zero, /dev/urandom) never ends. /dev/stdin
  // on a terminal, a pipe, a file or /dev/null (nohup, cron) is read as a file.
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0 && (S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode)) &&
      !(S_ISCHR(st.st_mode) && major(st.st_rdev) == 1 && minor(st.st_rdev) == 3)) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    const bool tty = fd >= 0 && ::isatty(fd);
    if (fd >= 0) ::close(fd);
    if (!tty) throw Error(fmt::format("{}: is a device, not a file", path));
  }
  errno = 0;
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(fmt::format("{}: cannot open: {}", path, errno ? std::strerror(errno) : "unknown reason"));
  return read_all(f, path);
}

std::string read_input(const std::string& path) { return path == "-" ? read_all(std::cin, "standard input") : read_file(path); }

namespace {

namespace fs = std::filesystem;

// What `path` is as an output: absent or a regular file (written through a temporary file), a
// stream written in place (a FIFO, a character device such as /dev/null or a terminal, or anything
// under /dev/ or /proc/: /dev/stdout, /dev/fd/N), or something no output replaces ("a directory",
// "a block device", "a socket"): then *refused says so.
enum class Kind { file, stream, refused };
Kind kind_of(const std::string& path, std::string* refused) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) return Kind::file;
  const bool special_dir = path.rfind("/dev/", 0) == 0 || path.rfind("/proc/", 0) == 0;
  if (S_ISREG(st.st_mode)) return special_dir ? Kind::stream : Kind::file;
  if (S_ISFIFO(st.st_mode) || S_ISCHR(st.st_mode)) return Kind::stream;
  *refused = S_ISDIR(st.st_mode) ? "a directory" : S_ISBLK(st.st_mode) ? "a block device" : S_ISSOCK(st.st_mode) ? "a socket" : "not a regular file";
  return Kind::refused;
}

// The file a path names: a symbolic link's target (its temporary file goes beside the target, and
// the rename replaces the target, not the link).
std::string resolved(const std::string& path) {
  struct stat st{};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return path;
  std::error_code ec;
  const fs::path real = fs::weakly_canonical(path, ec);
  return ec ? path : real.string();
}

std::string parent_of(const std::string& path) {
  const fs::path p = fs::path(path).parent_path();
  return p.empty() ? std::string(".") : p.string();
}

// Whether a file may be created in `dir`, or why not: by creating and removing one there.
std::string cannot_create_in(const std::string& dir) {
  const std::string probe = (fs::path(dir) / fmt::format(".loom_probe.{}", ::getpid())).string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return std::strerror(errno);
  ::close(fd);
  ::unlink(probe.c_str());
  return "";
}

}  // namespace

void check_output_path(const std::string& path, const std::string& field) {
  const std::string who = field.empty() ? path : fmt::format("{} = {}", field, path);
  if (path.empty()) throw Error(fmt::format("{}: an output file needs a name", field.empty() ? "output" : field));
  std::string refused;
  const Kind kind = kind_of(path, &refused);
  if (kind == Kind::refused) throw Error(fmt::format("{}: is {}, not a file to write", who, refused));
  if (kind == Kind::stream) return;
  const std::string real = resolved(path);
  // The nearest folder that exists: the file's own, or the one its missing folders will be made in.
  std::error_code ec;
  fs::path dir = fs::absolute(parent_of(real), ec);
  while (!fs::exists(dir, ec) && dir.has_parent_path() && dir.parent_path() != dir) dir = dir.parent_path();
  if (!fs::is_directory(dir, ec)) throw Error(fmt::format("{}: cannot write into {}: not a directory", who, dir.string()));
  if (const std::string why = cannot_create_in(dir.string()); !why.empty()) {
    // A file that exists and may be written is then written in place (see AtomicFile).
    if (!(fs::exists(real, ec) && ::access(real.c_str(), W_OK) == 0))
      throw Error(fmt::format("{}: cannot write into {}: {}", who, dir.string(), why));
  }
}

AtomicFile::AtomicFile(std::string path, Options opts) : path_(std::move(path)), opts_(opts) {
  if (path_.empty()) throw Error("output file: an empty path");
  std::string refused;
  const Kind kind = kind_of(path_, &refused);
  if (kind == Kind::refused)
    throw Error(fmt::format("{}: is {}, not a file to write (nothing was written)", path_, refused));
  if (kind == Kind::stream) {
    open_in_place();
    return;
  }
  real_ = resolved(path_);
  if (opts_.make_parent) {
    std::error_code ec;
    fs::create_directories(parent_of(real_), ec);
    if (ec) throw Error(fmt::format("{}: cannot create its folder: {}", path_, ec.message()));
  }
  tmp_ = opts_.per_process ? fmt::format("{}.{}.tmp", real_, ::getpid()) : real_ + ".tmp";
  // A file or a link under the temporary name is ours (a killed writer's, read-only, say, from the
  // file it was to replace) and is removed; a folder, a FIFO or a device is not.
  struct stat st{};
  if (::lstat(tmp_.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISLNK(st.st_mode))
    throw Error(fmt::format("{}: its temporary file {} is {} (nothing was written)", path_, tmp_,
                            S_ISDIR(st.st_mode) ? "a directory" : "not a regular file"));
  ::unlink(tmp_.c_str());
  fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd_ < 0) {
    const int err = errno;
    // No file can be made in a folder this process may not write: a file there that it may write
    // is written in place (not all or nothing then).
    if ((err == EACCES || err == EPERM) && ::access(real_.c_str(), W_OK) == 0) {
      tmp_.clear();
      open_in_place();
      return;
    }
    const std::string tried = tmp_;
    tmp_.clear();
    throw Error(fmt::format("{}: cannot create its temporary file {}: {}", path_, tried, std::strerror(err)));
  }
  // The file it replaces keeps its permissions (and, for root, its owner).
  if (::stat(real_.c_str(), &st) == 0) {
    (void)::fchmod(fd_, st.st_mode & 07777);
    if (::geteuid() == 0) (void)::fchown(fd_, st.st_uid, st.st_gid);
  }
}

void AtomicFile::open_in_place() {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
  if (fd_ < 0) throw Error(fmt::format("{}: cannot open for writing: {}", path_, std::strerror(errno)));
  in_place_ = true;
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !tmp_.empty()) ::unlink(tmp_.c_str());
}

void AtomicFile::fail(const std::string& what, int err) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
  committed_ = true;  // nothing left to remove
  throw Error(fmt::format("{}: {}{} ({})", path_, what, err ? fmt::format(": {}", std::strerror(err)) : "",
                          in_place_ ? "written in place: it may hold part of the output" : path_ + " is unchanged"));
}

void AtomicFile::write(const void* data, size_t bytes) {
  LOOM_CHECK(fd_ >= 0 && !committed_, "{}: written after commit()", path_);
  const std::string& into = in_place_ ? path_ : tmp_;
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd_, p, std::min<size_t>(bytes, size_t(1) << 30));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(fmt::format("cannot write {}", into), n < 0 ? errno : ENOSPC);
    p += n;
    bytes -= size_t(n);
  }
}

void AtomicFile::commit() {
  LOOM_CHECK(fd_ >= 0 && !committed_, "{}: committed twice", path_);
  const std::string& into = in_place_ ? path_ : tmp_;
  // fsync of a pipe or a terminal fails with EINVAL: there is nothing to make durable.
  if (opts_.durable && ::fsync(fd_) != 0 && !(in_place_ && errno == EINVAL)) fail(fmt::format("cannot sync {}", into), errno);
  const int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) fail(fmt::format("cannot write {}", into), errno);
  if (in_place_) {
    committed_ = true;
    return;
  }
  // Checked again: the path may have become a folder or a device while the file was written.
  std::string refused;
  if (kind_of(real_, &refused) == Kind::refused) fail(fmt::format("it is now {}", refused), 0);
  if (::rename(tmp_.c_str(), real_.c_str()) != 0) fail(fmt::format("cannot rename {} over it", tmp_), errno);
  committed_ = true;
  if (opts_.durable) {
    const int dir = ::open(parent_of(real_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
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

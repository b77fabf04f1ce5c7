// Reading a whole input file and writing a whole output file, with the errors a user can act on:
// each names the path (a folder, a missing or unreadable file, a failed read or write), as a
// loom::Error.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace loom {

// The bytes of the regular file `path`. Throws Error "PATH: is a directory, not a file", "PATH:
// cannot open: REASON" or "PATH: read error: REASON".
std::string read_file(const std::string& path);
// read_file, or with path "-" standard input.
std::string read_input(const std::string& path);

// An output file written whole or not at all. The bytes go to a temporary file beside `path`
// (PATH.tmp, or PATH.<pid>.tmp when several processes may write it at once), which replaces `path`
// by a rename at commit(); with `durable`, the file and then its folder are synced first (a power
// loss keeps the old file or the new one). A `path` that exists and is not a regular file (a
// folder, a device, a FIFO) is refused before anything is written. Every failure throws Error
// naming `path` and the reason, and leaves `path` as it was and no temporary file; so does an
// AtomicFile destroyed without commit() (an exception while filling it).
//
//   AtomicFile f(path);
//   f.write(header.data(), header.size());
//   f.write(payload.data(), payload.size());
//   f.commit();
class AtomicFile {
 public:
  struct Options {
    bool durable = false;
    bool per_process = false;  // PATH.<pid>.tmp
  };
  explicit AtomicFile(std::string path) : AtomicFile(std::move(path), Options{}) {}
  AtomicFile(std::string path, Options opts);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t bytes);
  void write(std::string_view text) { write(text.data(), text.size()); }
  void commit();
  const std::string& path() const { return path_; }

 private:
  [[noreturn]] void fail(const std::string& what, int err);
  std::string path_, tmp_;
  Options opts_;
  int fd_ = -1;
  bool committed_ = false;
};

// AtomicFile(path, opts) holding `bytes`.
void write_file_atomically(const std::string& path, std::string_view bytes, AtomicFile::Options opts = {});

// Refuses (Error naming `path` and `field` when given) a path that exists and is not a regular
// file, or whose folder does not exist or is not a folder: for an output checked before a long run
// writes it.
void check_output_path(const std::string& path, const std::string& field = "");

}  // namespace loom

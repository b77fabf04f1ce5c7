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
// by a rename at commit(), keeping the permissions of the file it replaces; with `durable`, the
// file and then its folder are synced first (a power loss keeps the old file or the new one). A
// symbolic link is written through (its target is replaced, beside which the temporary file goes).
// Every failure throws Error naming `path` and the reason, and leaves `path` as it was and no
// temporary file; so does an AtomicFile destroyed without commit() (an exception while filling
// it).
//
// Streams are written in place, as a shell's `>` would: a FIFO, a character device (/dev/null, a
// terminal), and anything under /dev/ or /proc/ (/dev/stdout, /dev/fd/N, even when they name a
// regular file); so is a file this process may write in a folder where it may create nothing (no
// temporary file can go there). A folder, a block device or a socket is refused before anything is
// written.
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
    bool make_parent = false;  // create the folders `path` is in
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
  void open_in_place();
  [[noreturn]] void fail(const std::string& what, int err);
  std::string path_, real_, tmp_;  // as given; a link's target; "" when written in place
  Options opts_;
  int fd_ = -1;
  bool in_place_ = false;
  bool committed_ = false;
};

// AtomicFile(path, opts) holding `bytes`.
void write_file_atomically(const std::string& path, std::string_view bytes, AtomicFile::Options opts = {});

// For an output checked before a long run writes it: refuses (Error naming `path` and `field` when
// given) what AtomicFile would refuse, and a path in whose folder (or, when the folder is still to
// be made, in whose nearest existing folder) no file can be created, unless it is a file this
// process may write in place. Creates and removes a probe file to know.
void check_output_path(const std::string& path, const std::string& field = "");

}  // namespace loom

// Reading a whole input file, with the errors a user can act on: each names the path (a folder, a
// missing or unreadable file, a failed read), as a loom::Error.
#pragma once
#include <string>

namespace loom {

// The bytes of the regular file `path`. Throws Error "PATH: is a directory, not a file", "PATH:
// cannot open: REASON" or "PATH: read error: REASON".
std::string read_file(const std::string& path);
// read_file, or with path "-" standard input.
std::string read_input(const std::string& path);

}  // namespace loom

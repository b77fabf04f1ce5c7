// Errors: one exception type for bad input and broken invariants, with file:line from the
// check macros and, at API boundaries, the file and field the problem is in.
#pragma once
#include <fmt/format.h>
#include <stdexcept>
#include <string>

namespace loom {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// An error every rank of a job throws alike about what one rank found (a checkpoint part it could
// not write, say): the job's failure is reported as that rank's, whichever rank reports it first.
class RankError : public Error {
 public:
  RankError(int rank, const std::string& what) : Error(what), rank_(rank) {}
  int rank() const { return rank_; }

 private:
  int rank_;
};

[[noreturn]] void fail_at(const char* file, int line, const std::string& msg);

}  // namespace loom

// LOOM_CHECK(cond, "fmt {}", args...): throws loom::Error("file:line: message") when cond is false.
#define LOOM_CHECK(cond, ...)                                                        \
  do {                                                                               \
    if (!(cond)) [[unlikely]] ::loom::fail_at(__FILE__, __LINE__, fmt::format(__VA_ARGS__)); \
  } while (0)

#define LOOM_FAIL(...) ::loom::fail_at(__FILE__, __LINE__, fmt::format(__VA_ARGS__))

// LOOM_REQUIRE(cond, "fmt {}", args...): throws loom::Error("message") when cond is false, for
// bad input whose message names the file and field itself (no source location for a user).
#define LOOM_REQUIRE(cond, ...)                                                      \
  do {                                                                               \
    if (!(cond)) [[unlikely]] throw ::loom::Error(fmt::format(__VA_ARGS__));         \
  } while (0)

#include "core/error.h"

#include <cstring>

namespace loom {

void fail_at(const char* file, int line, const std::string& msg) {
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  throw Error(fmt::format("{} ({}:{})", msg, base, line));
}

}  // namespace loom

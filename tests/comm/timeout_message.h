// Reading the communicators' timeout messages in tests.
#pragma once
#include <regex>
#include <sstream>
#include <string>

#include <fmt/format.h>

namespace loom::testing_util {

// Whether a communicator timeout message in `out` names `rank` as the one that has not arrived,
// is stalled or did not take its data (comm/mpi_comm.cpp's wording): exactly, when the waiting
// rank is its neighbour, or among "one of ranks A, B, ... (the data's way round the ring)" when
// a ring phase waits at a later step and can only know the ranks its data passes through.
inline bool names_suspect(const std::string& out, int rank) {
  if (out.find(fmt::format("rank {} has not arrived or is stalled", rank)) != std::string::npos) return true;
  if (out.find(fmt::format("rank {} did not take the data", rank)) != std::string::npos) return true;
  const std::regex chain(R"(one of ranks ([0-9, ]+) \(the data's way round the ring\))");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), chain); it != std::sregex_iterator(); ++it) {
    std::istringstream ranks((*it)[1].str());
    std::string r;
    while (std::getline(ranks, r, ','))
      if (std::stoi(r) == rank) return true;
  }
  return false;
}

}  // namespace loom::testing_util

#include "mpi_util.h"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include <fmt/format.h>

namespace loom::comm::testing {

namespace {

std::string find_in_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  if (!path) return "";
  std::string p = path;
  size_t start = 0;
  while (start <= p.size()) {
    size_t end = p.find(':', start);
    if (end == std::string::npos) end = p.size();
    std::filesystem::path cand = std::filesystem::path(p.substr(start, end - start)) / name;
    if (!cand.empty() && ::access(cand.c_str(), X_OK) == 0) return cand.string();
    start = end + 1;
  }
  return "";
}

}  // namespace

DriverRun run_driver(int n, const std::string& args, int limit_s) {
  DriverRun r;
#ifndef LOOM_HAVE_MPI
  r.skipped = true;
  r.output = "loom was built without MPI";
  return r;
#else
  std::string mpirun = find_in_path("mpirun");
  if (mpirun.empty()) {
    r.skipped = true;
    r.output = "mpirun not found in PATH; install OpenMPI to run the mpi backend tests";
    return r;
  }
  std::error_code ec;
  auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  auto driver = self.parent_path() / "test_comm_mpi_driver";
  if (ec || !std::filesystem::exists(driver)) {
    r.skipped = true;
    r.output = "the MPI driver test_comm_mpi_driver was not built next to the test";
    return r;
  }
  std::string root = ::geteuid() == 0 ? "--allow-run-as-root " : "";
  std::string cmd = fmt::format("timeout -k 5 {} {} {}--oversubscribe -n {} {} {} 2>&1", limit_s, mpirun, root, n,
                                driver.string(), args);
  auto t0 = std::chrono::steady_clock::now();
  FILE* f = ::popen(cmd.c_str(), "r");
  if (!f) {
    r.output = "popen failed for: " + cmd;
    return r;
  }
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) r.output.append(buf, got);
  int st = ::pclose(f);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (WIFEXITED(st)) {
    r.status = WEXITSTATUS(st);
  } else if (WIFSIGNALED(st)) {
    r.status = 128 + WTERMSIG(st);
  }
  if (r.status == 124) r.output += fmt::format("\n[mpirun did not finish within {} s]", limit_s);
  r.output = "$ " + cmd + "\n" + r.output;
  return r;
#endif
}

}  // namespace loom::comm::testing

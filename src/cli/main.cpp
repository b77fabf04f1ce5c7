// loom: train transformer language models on one CPU, one GPU, or many of either.
#include <omp.h>

#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <map>

#include "cli/command.h"
#include "core/error.h"
#include "core/threads.h"
#include "train/config.h"
#include "train/stop.h"

namespace loom::cli {
std::vector<Command>& commands() {
  static std::vector<Command> c;
  return c;
}
}  // namespace loom::cli

int main(int argc, char** argv) {
  // Before any other thread exists: SIGINT, SIGTERM and SIGUSR1 are received by a thread of their
  // own, never by one that computes (train/stop.h says why), and stop a training run cleanly.
  try {
    loom::train::start_signal_thread();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom: error: %s\n", e.what());
    return 1;
  }
  // A write past the file-size limit (ulimit -f) then fails with EFBIG, which loom reports with the
  // file, instead of the signal ending the process mid-write.
  std::signal(SIGXFSZ, SIG_IGN);
  // Parallel regions of exactly the threads asked for (core/threads.h: oneDNN relies on it).
  loom::settle_omp_threads();
  CLI::App app{"loom: train transformer language models on CPUs and GPUs"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "loom 0.1.0");
  std::map<std::string, std::function<int()>> actions;
  auto& cmds = loom::cli::commands();
  std::sort(cmds.begin(), cmds.end(), [](auto& a, auto& b) { return a.name < b.name; });
  for (auto& c : cmds) {
    CLI::App* sub = app.add_subcommand(c.name, c.help);
    actions[c.name] = c.setup(*sub);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (omp_get_max_threads() > loom::train::max_threads()) {
    std::fprintf(stderr, "loom: error: OMP_NUM_THREADS = %s: %d threads is more than 8 per core of this host (%d cores)\n",
                 std::getenv("OMP_NUM_THREADS") ? std::getenv("OMP_NUM_THREADS") : "?", omp_get_max_threads(),
                 loom::train::max_threads() / 8);
    return 1;
  }
  try {
    for (auto* sub : app.get_subcommands()) return actions.at(sub->get_name())();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "loom: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

// Subcommands of the loom executable. Each src/cli/cmd_<name>.cpp defines one and registers it
// with a static Registrar, so adding a subcommand touches no other file.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace loom::cli {

struct Command {
  std::string name;
  std::string help;
  // Adds options to `sub`; returns the action to run when the subcommand is chosen (exit code).
  std::function<std::function<int()>(CLI::App& sub)> setup;
};

std::vector<Command>& commands();

struct Registrar {
  explicit Registrar(Command c) { commands().push_back(std::move(c)); }
};

}  // namespace loom::cli

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

// A --seed: a whole number from 0 to 2^64 - 1, in decimal (an unsigned option would take -1 as
// 2^64 - 1, and 010 as octal 8). Use with ->transform(): it strips leading zeros.
inline CLI::Validator seed_validator() {
  return CLI::Validator(
      [](std::string& v) -> std::string {
        const std::string given = v;
        const bool digits = !v.empty() && v.find_first_not_of("0123456789") == std::string::npos;
        if (digits) v.erase(0, std::min(v.find_first_not_of('0'), v.size() - 1));
        if (digits && (v.size() < 20 || (v.size() == 20 && v <= "18446744073709551615"))) return "";
        return "must be a whole number from 0 to 18446744073709551615, got " + given;
      },
      "SEED");
}

// A number from lo to hi: CLI::Range for floating-point options that also refuses nan (which
// compares false with both bounds, so CLI::Range lets it through).
inline CLI::Validator number_in(double lo, double hi) {
  return CLI::Validator(
      [lo, hi](std::string& v) -> std::string {
        double x = 0;
        if (!CLI::detail::lexical_cast(v, x) || !(x >= lo && x <= hi))
          return "must be a number from " + CLI::detail::to_string(lo) + " to " + CLI::detail::to_string(hi) + ", got " + v;
        return "";
      },
      "NUMBER in [" + CLI::detail::to_string(lo) + " - " + CLI::detail::to_string(hi) + "]");
}

}  // namespace loom::cli

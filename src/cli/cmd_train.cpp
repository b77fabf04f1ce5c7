// loom train CONFIG.toml [--section.field value ...] [--resume [--new-hparams] | --overwrite] [--plan auto]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "cli/command.h"
#include "core/error.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/plan_auto.h"
#include "train/run_util.h"
#include "train/stop.h"
#include "train/trainer.h"
#ifdef LOOM_HAVE_CUDA
#endif

namespace loom::cli {
namespace {

struct TrainArgs {
  std::string config;
  bool resume = false;
  bool overwrite = false;
  bool new_hparams = false;
  bool help_config = false;
  bool quiet = false;
  std::string trace;
  std::string plan;
};

Registrar reg{Command{
    "train", "train a GPT from token shards (every config field can be overridden: --optim.lr 3e-4)",
    [](CLI::App& sub) -> std::function<int()> {
      auto a = std::make_shared<TrainArgs>();
      sub.footer("Arguments: [CONFIG.toml] [--section.field VALUE | --section.field=VALUE]...\n"
                 "The TOML file is optional: defaults and overrides alone work.");
      sub.add_flag("--resume", a->resume, "continue from OUT_DIR/latest, bit-identically");
      sub.add_flag("--overwrite", a->overwrite, "start over in an OUT_DIR that holds another run (its checkpoints, "
                   "metrics and loss plot are deleted first)");
      sub.add_flag("--new-hparams", a->new_hparams, "with --resume: train on with this run's learning-rate schedule, "
                   "AdamW settings and batch shape where they differ from the checkpoint's (each one is said); "
                   "without it such a difference is refused");
      sub.add_flag("--help-config", a->help_config, "list every config field with its type and default");
      sub.add_flag("--quiet", a->quiet, "no progress lines");
      sub.add_option("--trace", a->trace, "write a Chrome trace of every rank (compute, collectives, waits) to FILE");
      sub.add_option("--plan", a->plan, "auto: the planner's first choice of layout for the config's number of ranks "
                     "(pp x dp x cp x tp), model, batch and sequence length")
          ->check(CLI::IsMember({"auto"}));
      sub.allow_extras();
      return [a, &sub]() -> int {
        const auto started = std::chrono::steady_clock::now();  // (train.time_limit_min counts from here)
        if (a->help_config) {
          const std::vector<train::FieldInfo> fields = train::config_fields();
          int width = 0;
          for (const auto& f : fields) width = std::max(width, int(f.key.size()));
          for (const auto& f : fields)
            std::printf("--%-*s %-6s %-14s %s\n", width, f.key.c_str(), f.type.c_str(), f.default_value.c_str(),
                        f.help.c_str());
          return 0;
        }
        // The config path is the one argument that is neither "--key", "--key=value" nor the
        // value following a "--key".
        std::vector<std::string> args = sub.remaining(), overrides;
        for (size_t i = 0; i < args.size(); ++i) {
          if (args[i].rfind("--", 0) == 0) {
            overrides.push_back(args[i]);
            if (args[i].find('=') == std::string::npos && i + 1 < args.size()) overrides.push_back(args[++i]);
          } else if (a->config.empty()) {
            a->config = args[i];
          } else {
            throw Error(fmt::format("command line: unexpected argument '{}' (the config is '{}')", args[i], a->config));
          }
        }
        train::TrainConfig cfg = train::load_config(a->config, train::collect_overrides(overrides));
        // Processes of an MPI launch on the threads backend would each run the whole job (and
        // find one another's run directory in use).
        for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"}) {
          const char* v = std::getenv(var);
          if (v && std::atoi(v) > 1 && cfg.comm == "threads")
            throw Error(fmt::format("{}: parallel.comm = threads, but this process is one of {} that an MPI launcher "
                                    "started ({}={}): each would run the whole job; pass --parallel.comm mpi (or "
                                    "nccl for GPUs)",
                                    a->config.empty() ? "command line" : a->config, v, var, v));
        }
        if (a->resume && a->overwrite) throw Error("command line: --resume and --overwrite exclude each other");
        if (a->new_hparams && !a->resume) throw Error("command line: --new-hparams applies to --resume only");
        // A run that starts from step 0 in a directory of another run would replace its
        // checkpoints and metrics: only when asked to.
        if (!a->resume && !a->overwrite) {
          const std::string held = train::run_marker(cfg.out_dir);
          if (!held.empty())
            throw Error(fmt::format("train.out_dir {} holds a run ({}): --resume to continue it, --overwrite to "
                                    "replace it, or another train.out_dir (nothing was changed)",
                                    cfg.out_dir, held));
        }
        // --overwrite removes the old run once the new one is accepted (run_training).
        train::TrainOptions opt;
        opt.overwrite = a->overwrite;
        opt.started = started;
        if (a->plan == "auto") opt.plan_note = train::apply_auto_plan(cfg, a->config.empty() ? "command line" : a->config);
        opt.resume = a->resume;
        opt.new_hparams = a->new_hparams;
        opt.quiet = a->quiet;
        opt.trace_path = a->trace;
        opt.config_path = a->config.empty() ? "command line" : a->config;
        // One trainer for every device (a build without CUDA refuses train.device = "cuda":
        // load_config already did, naming the field and how to build with CUDA).
        // A run stopped early by a signal exits as the signal would have ended it (128 + its
        // number), with its checkpoint written; at train.time_limit_min, 0 (train/stop.h).
        return train::stop_exit_status(train::run_training(cfg, opt).stopped);
      };
    }}};

}  // namespace
}  // namespace loom::cli

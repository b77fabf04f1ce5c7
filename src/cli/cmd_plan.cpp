// loom plan: which layout to run a model with on a cluster, and what it will cost.
//   loom plan --model M --cluster C --gpus N --global-batch B [--seq T] [--top K] [--explain] [--json]
//   loom plan ... --layout dp=8,tp=8,pp=4,v=2,mbs=1,schedule=interleaved,recompute=selective,sp=1,zero=1 [--json]
// The first form searches every layout (src/plan/planner.h) and prints the fastest that fit with
// their memory per device and step time split into compute, bubble, communication and
// recomputation; the second predicts one layout.
#include <cstdio>
#include <memory>

#include <fmt/format.h>

#include "cli/command.h"
#include "core/error.h"
#include "plan/planner.h"

namespace loom::cli {
namespace {

struct PlanArgs {
  std::string model = "gpt2-124m", cluster = "a100-80gb", layout, precision = "mixed";
  int gpus = 8, top = 5;
  int64_t global_batch = 512, seq = 0;
  bool explain = false, json = false;
};

Registrar reg{Command{
    "plan", "choose a parallel layout for a model on a cluster and predict its memory and speed",
    [](CLI::App& sub) -> std::function<int()> {
      auto a = std::make_shared<PlanArgs>();
      sub.add_option("--model", a->model, "a preset (gpt2-124m ... gpt2-1.5b, llama-7b, llama-70b, llama3-405b) or a "
                     "model TOML file")->capture_default_str();
      sub.add_option("--cluster", a->cluster, "a100-80gb, h100-sxm, h200, cpu, or a cluster TOML file")
          ->capture_default_str();
      sub.add_option("--gpus", a->gpus, "devices in all")->capture_default_str()->check(CLI::Range(1, 1 << 20));
      sub.add_option("--global-batch", a->global_batch, "sequences per optimizer step")
          ->capture_default_str()
          ->check(CLI::Range(int64_t(1), int64_t(1) << 30));
      sub.add_option("--seq", a->seq, "sequence length (default: the model's)")->check(CLI::Range(int64_t(1), int64_t(1) << 24));
      sub.add_option("--precision", a->precision, "mixed (16-bit with f32 master weights) or f32 (loom's CPU)")
          ->capture_default_str()
          ->check(CLI::IsMember({"mixed", "f32"}));
      sub.add_option("--layout", a->layout, "predict this layout only: dp=,tp=,pp=,v=,cp=,sp=,mbs=,schedule=,"
                     "recompute=,zero=");
      sub.add_option("--top", a->top, "layouts to show")->capture_default_str()->check(CLI::Range(1, 100));
      sub.add_flag("--explain", a->explain, "say why the first choice beats the next ones");
      sub.add_flag("--json", a->json, "print JSON");
      return [a]() -> int {
        plan::Job job;
        job.model = plan::model_named(a->model);
        if (a->seq > 0) job.model.seq = a->seq;
        job.model.validate("--model " + a->model);
        job.cluster = plan::cluster_named(a->cluster);
        job.devices = a->gpus;
        job.global_batch = a->global_batch;
        job.precision = a->precision == "f32" ? plan::Precision::f32 : plan::Precision::mixed;
        if (!a->layout.empty()) {
          plan::Layout L = plan::parse_layout(a->layout);
          if (L.devices() != a->gpus && a->layout.find("dp=") == std::string::npos) {
            LOOM_CHECK(a->gpus % (L.tp * L.pp * L.cp) == 0, "--layout: tp x pp x cp = {} does not divide --gpus {}",
                       L.tp * L.pp * L.cp, a->gpus);
            L.dp = a->gpus / (L.tp * L.pp * L.cp);
          }
          const plan::Estimate e = plan::estimate(job, L);
          if (a->json) {
            std::printf("%s\n", plan::to_json(e).c_str());
          } else {
            std::printf("%s on %d x %s, global batch %lld\n", job.model.str().c_str(), job.devices,
                        job.cluster.device.name.c_str(), static_cast<long long>(job.global_batch));
            std::fputs(plan::format_table(job, {e}).c_str(), stdout);
          }
          return e.why_not.empty() || e.fits ? 0 : 1;
        }
        const plan::SearchResult r = plan::search(job, {.top = a->top});
        if (a->json) {
          std::printf("[");
          for (size_t i = 0; i < r.best.size(); ++i) std::printf("%s%s", i ? ",\n" : "", plan::to_json(r.best[i]).c_str());
          std::printf("]\n");
          return r.best.empty() ? 1 : 0;
        }
        std::printf("%s on %d x %s, global batch %lld: %lld layouts considered, %lld fit (%.2f s)\n",
                    job.model.str().c_str(), job.devices, job.cluster.device.name.c_str(),
                    static_cast<long long>(job.global_batch), static_cast<long long>(r.considered),
                    static_cast<long long>(r.fitting), r.seconds);
        if (r.best.empty()) {
          std::printf("no layout fits\n");
          return 1;
        }
        std::fputs(plan::format_table(job, r.best).c_str(), stdout);
        if (a->explain) std::fputs(plan::explain(r.best).c_str(), stdout);
        return 0;
      };
    }}};

}  // namespace
}  // namespace loom::cli

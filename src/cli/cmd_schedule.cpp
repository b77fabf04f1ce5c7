// loom schedule: generate a pipeline schedule, prove it with the checker, print its per-rank
// instruction lists or a text picture, its activation bound and bubble, and draw it as a PNG.
#include <cstdio>
#include <fmt/format.h>
#include <memory>

#include "cli/command.h"
#include "core/error.h"
#include "parallel/pipeline/checker.h"
#include "parallel/pipeline/draw.h"
#include "parallel/pipeline/schedule.h"

namespace loom::cli {
namespace {

namespace pl = loom::parallel::pipeline;

struct ScheduleArgs {
  std::string kind = "1f1b";
  int p = 4, v = 0, m = 8;  // v 0: 2 for interleaved (parallel.virtual_stages' default), else 1
  std::string png;
  bool list = false;
  std::vector<double> costs;  // forward, backward input, backward weight
};

Registrar reg{Command{
    "schedule", "generate, check and draw a pipeline schedule (gpipe, 1f1b, interleaved, zb-h1)",
    [](CLI::App& sub) -> std::function<int()> {
      auto a = std::make_shared<ScheduleArgs>();
      sub.add_option("--kind", a->kind, "gpipe, 1f1b, interleaved or zb-h1")->capture_default_str();
      sub.add_option("-p,--stages", a->p, "pipeline stages (ranks)")->capture_default_str();
      sub.add_option("-v,--virtual-stages", a->v, "model chunks per rank (interleaved; default 2, as "
                     "parallel.virtual_stages; 1 for the others)")
          ->check(CLI::Range(1, 1 << 16));
      sub.add_option("-m,--micro-batches", a->m, "micro-batches per step")->capture_default_str();
      sub.add_option("--png", a->png, "draw the schedule into this PNG file");
      sub.add_flag("--list", a->list, "print every rank's instruction list");
      sub.add_option("--costs", a->costs, "relative durations F,Bi,W of a forward and of the backward's input and "
                     "weight halves (a full backward costs Bi + W); default 1,1,1")
          ->delimiter(',')
          ->expected(3);
      return [a]() -> int {
        const pl::Kind kind = pl::parse_kind(a->kind, "--kind");
        const int v = a->v > 0 ? a->v : kind == pl::Kind::interleaved ? 2 : 1;
        pl::ScheduleSpec spec{kind, a->p, v, a->m};
        pl::OpCosts costs;
        if (!a->costs.empty()) {
          costs.forward = a->costs[0];
          costs.backward_input = a->costs[1];
          costs.backward_weight = a->costs[2];
          costs.backward = costs.backward_input + costs.backward_weight;
          try {
            costs.validate();
          } catch (const Error& e) {
            throw Error(fmt::format("--costs: {}", e.what()));
          }
        }
        pl::Schedule sch = pl::generate(spec, costs);
        pl::CheckResult res = pl::check_or_throw(sch, costs);
        pl::Timeline tl = pl::schedule_timeline(sch, res);
        if (a->list) std::fputs(sch.str().c_str(), stdout);
        std::fputs(pl::draw_text(tl, 1.0).c_str(), stdout);
        std::printf("checker: valid (every send matched, no deadlock under blocking transfers)\n");
        std::printf("rank  in-flight  idle\n");
        for (int r = 0; r < sch.p(); ++r)
          std::printf("%4d  %9d  %.3f\n", r, res.ranks[size_t(r)].peak_in_flight, res.idle_fraction(r));
        std::printf("bubble (idle / busy of rank 0; F %g, B %g, Bi %g, W %g): %.4f\n", costs.forward, costs.backward,
                    costs.backward_input, costs.backward_weight, res.bubble_ratio(0));
        if (!a->png.empty()) {
          std::string why;
          if (!pl::draw_png(a->png, tl, &why)) {
            std::fprintf(stderr, "loom schedule: --png: %s\n", why.c_str());
            return 1;
          }
          std::printf("wrote %s\n", a->png.c_str());
        }
        return 0;
      };
    }}};

}  // namespace
}  // namespace loom::cli

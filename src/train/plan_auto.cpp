#include "train/plan_auto.h"

#include <cmath>

#include <fmt/format.h>

#include "core/error.h"
#include "core/memory.h"
#include "model/recompute.h"
#include "parallel/pipeline/schedule.h"
#include "plan/planner.h"
#include "train/run_util.h"

namespace loom::train {

std::string apply_auto_plan(TrainConfig& cfg, const std::string& config_path) {
  LOOM_CHECK(cfg.device == "cpu", "--plan auto: plans layouts of CPU ranks, not of train.device = \"{}\" (set the "
             "layout's parallel.* fields yourself)", cfg.device);
  const int world = int(cfg.pp * cfg.dp * cfg.cp * cfg.tp);
  // The model as the run will build it (the vocabulary from the data).
  const model::GPTConfig mc = open_run_data(cfg, config_path).model;
  plan::Job job;
  job.model = plan::from_gpt(mc, cfg.seq_len);
  job.cluster = plan::cluster_named("cpu");
  job.devices = world;
  job.global_batch = cfg.batch_size;
  job.precision = plan::Precision::f32;
  // Within the limit with the planner's margin (a layout fits in 90% of the memory): its memory
  // model is within a few percent of loom's pools (bench/README.md, "Local truth").
  if (cfg.memory_limit > 0) job.cluster.device.memory = double(cfg.memory_limit);
  plan::SearchOptions so;
  so.top = 2;
  so.schedules = {parallel::pipeline::Kind::gpipe, parallel::pipeline::Kind::one_f_one_b,
                  parallel::pipeline::Kind::interleaved, parallel::pipeline::Kind::zb_h1};
  const plan::SearchResult r = plan::search(job, so);
  if (r.best.empty()) {
    std::string why = fmt::format("{} layouts considered", r.considered);
    if (cfg.memory_limit > 0) why += fmt::format(", train.memory_limit {}", format_bytes(int64_t(cfg.memory_limit)));
    // What the least demanding layout needs, and the limit it would fit.
    if (r.least)
      why += fmt::format("; the least any needs is {} per rank ({}), which fits a limit of {}",
                         format_bytes(int64_t(r.least->memory_total)), r.least->layout.str(),
                         format_bytes(int64_t(std::ceil(r.least->memory_total / plan::kUsableMemory))));
    throw Error(fmt::format("--plan auto: no layout of {} rank{} fits {} ({}); more ranks (parallel.dp, tp, pp, cp) or "
                            "a smaller train.batch_size or data.seq_len",
                            world, world > 1 ? "s" : "", job.model.str(), why));
  }
  const plan::Estimate& e = r.best.front();
  const plan::Layout& L = e.layout;
  cfg.dp = L.dp, cfg.tp = L.tp, cfg.pp = L.pp, cfg.cp = L.cp, cfg.sp = L.sp;
  cfg.grad_accum = cfg.batch_size / (int64_t(L.dp) * L.mbs);
  cfg.schedule = std::string(parallel::pipeline::kind_name(L.schedule));
  if (L.schedule == parallel::pipeline::Kind::interleaved && L.pp > 1) cfg.virtual_stages = L.v;
  cfg.recompute = std::string(model::recompute_name(L.recompute));
  cfg.zero = L.zero;
  cfg.stage_layers.clear();
  cfg.validate(config_path);
  std::string said = fmt::format("plan auto: {} of {} layouts of {} rank{} fit; chose {} (predicted {:.0f} tokens/s, "
                                 "{} per rank)",
                                 r.fitting, r.considered, world, world > 1 ? "s" : "", L.str(), e.tokens_per_s,
                                 format_bytes(int64_t(e.memory_total)));
  if (r.best.size() > 1)
    said += fmt::format("; next {} ({:.0f} tokens/s)", r.best[1].layout.str(), r.best[1].tokens_per_s);
  // The CPU profile (loom calibrate) holds f32 rates, and the planner's memory model has no CPU
  // bf16 operand copies: a bf16 run is planned as its f32 twin, and said so.
  if (cfg.run_precision() == "bf16")
    said += "; planned with f32 matmuls (train.precision = bf16: the CPU profile measures f32 GEMMs, so the "
            "prediction is the f32 run's; the bf16 run is faster and keeps bf16 copies of its largest operands)";
  return said;
}

}  // namespace loom::train

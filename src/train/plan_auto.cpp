#include "train/plan_auto.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/backend.h"
#include "core/error.h"
#include "core/memory.h"
#include "model/recompute.h"
#include "parallel/pipeline/schedule.h"
#include "plan/planner.h"
#include "train/run_util.h"

namespace loom::train {

namespace {

// The processes the job launcher started on this host (OpenMPI's mpirun says so in each one's
// environment before MPI starts); 0 where unknown.
int launcher_local_size() {
  const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  if (!s || !*s) return 0;
  char* end = nullptr;
  const long n = std::strtol(s, &end, 10);
  return end && *end == '\0' && n > 0 ? int(n) : 0;
}

// The cluster of the run's GPUs: the built-in profile of this host's GPU, with its memory, and a
// node of as many GPUs as below. Refuses rank threads, which would share one GPU (the planner
// gives every rank a device of its own), and a GPU without a profile.
plan::Cluster gpu_cluster(const TrainConfig& cfg, int world, std::string* gpu) {
  if (cfg.comm == "threads" && world > 1)
    throw Error(fmt::format("--plan auto: plans one GPU per rank, and with parallel.comm = threads the {} ranks would "
                            "share one GPU (run one process per GPU: mpirun -n {} loom train ... --parallel.comm nccl)",
                            world, world));
  DeviceInfo info;
  std::string why;
  if (!device_info(Device::cuda, &info, &why))
    throw Error(fmt::format("--plan auto: train.device = \"cuda\": {}", why));
  *gpu = info.name;
  const std::string name = plan::cluster_for_gpu(info.name);
  if (name.empty())
    throw Error(fmt::format("--plan auto: the planner has no profile of the GPU {} (it has the A100, H100 and H200's); "
                            "choose the layout with `loom plan --cluster FILE` (a cluster file of this GPU) and set "
                            "its parallel.* fields",
                            info.name));
  plan::Cluster c = plan::cluster_named(name);
  c.device.memory = double(info.memory);
  // A node's GPUs: the processes the launcher started on this host, each binding one (processes
  // given one visible GPU each see a count of 1), or the GPUs this process sees.
  c.per_node = std::max({1, info.count, launcher_local_size()});
  return c;
}

// The layout's fields of cfg set to L's (the planner's layouts cut stages by cost).
void apply_layout(TrainConfig& cfg, const plan::Layout& L) {
  cfg.dp = L.dp, cfg.tp = L.tp, cfg.pp = L.pp, cfg.cp = L.cp, cfg.sp = L.sp;
  cfg.grad_accum = cfg.batch_size / (int64_t(L.dp) * L.mbs);
  cfg.schedule = std::string(parallel::pipeline::kind_name(L.schedule));
  if (L.schedule == parallel::pipeline::Kind::interleaved && L.pp > 1) cfg.virtual_stages = L.v;
  cfg.recompute = std::string(model::recompute_name(L.recompute));
  cfg.zero = L.zero;
  cfg.offload = L.offload;
  cfg.stage_layers.clear();
}

// What the config gave (other than its defaults) for the fields the plan chooses, and the plan
// replaced: "parallel.zero 3 -> 1". (dp, tp, pp and cp give the number of ranks, which the plan
// divides anew.)
std::vector<std::string> replaced_fields(const TrainConfig& given, const TrainConfig& chosen) {
  const TrainConfig d;
  std::vector<std::string> out;
  const auto note = [&](const char* field, const auto& g, const auto& dflt, const auto& c) {
    if (g != dflt && g != c) out.push_back(fmt::format("{} {} -> {}", field, g, c));
  };
  note("parallel.sp", given.sp, d.sp, chosen.sp);
  note("parallel.zero", given.zero, d.zero, chosen.zero);
  note("parallel.offload", given.offload, d.offload, chosen.offload);
  note("parallel.schedule", given.schedule, d.schedule, chosen.schedule);
  note("parallel.virtual_stages", given.virtual_stages, d.virtual_stages, chosen.virtual_stages);
  note("train.grad_accum", given.grad_accum, d.grad_accum, chosen.grad_accum);
  note("memory.recompute", given.recompute, d.recompute, chosen.recompute);
  if (!given.stage_layers.empty()) out.push_back(fmt::format("parallel.stage_layers [{}] -> cut by cost",
                                                             fmt::join(given.stage_layers, ",")));
  return out;
}

}  // namespace

std::string apply_auto_plan(TrainConfig& cfg, const std::string& config_path) {
  // The plan chooses the recompute policy among none, selective and full, within train.memory_limit;
  // an activation budget is optimal recomputation's, which the user chooses with the layout.
  if (cfg.activation_budget > 0)
    throw Error(fmt::format("--plan auto: chooses memory.recompute (none, selective or full) to fit "
                            "train.memory_limit; memory.activation_budget ({} bytes) is for a policy you choose "
                            "(memory.recompute = optimal): give train.memory_limit instead, or the layout without "
                            "--plan auto",
                            cfg.activation_budget));
  const int world = int(cfg.pp * cfg.dp * cfg.cp * cfg.tp);
  // The model as the run will build it (the vocabulary from the data), its check against the host's
  // memory made for the least any layout holds (ZeRO-3, micro-batches of one sequence) rather than
  // for the config's layout, which the plan replaces.
  TrainConfig least = cfg;
  least.zero = 3;
  least.grad_accum = cfg.batch_size;
  // (The model only: the shards' headers, not their payloads, which the run's ranks verify.)
  const model::GPTConfig mc = open_run_data(least, config_path, data::VerifyShare::none()).model;
  plan::Job job;
  job.model = plan::from_gpt(mc, cfg.seq_len);
  job.devices = world;
  job.global_batch = cfg.batch_size;
  std::string ranks = fmt::format("{} rank{}", world, world > 1 ? "s" : "");
  if (cfg.device == "cuda") {
    // Each rank a GPU of this host's kind, as loom's GPU runs hold their memory.
    std::string gpu;
    job.cluster = gpu_cluster(cfg, world, &gpu);
    job.precision = plan::Precision::device;
    ranks = fmt::format("{} {} GPU{}", world, gpu, world > 1 ? "s" : "");
    // (The built-in profiles are the SXM boards': a PCIe or NVL board's peak and links are lower.)
    if (gpu.find("PCIe") != std::string::npos || gpu.find("NVL") != std::string::npos)
      ranks += fmt::format(" (planned as {}: this board's peak and links are lower)", job.cluster.name);
    if (cfg.memory_limit > 0) job.cluster.device.memory = std::min(job.cluster.device.memory, double(cfg.memory_limit));
  } else {
    // CPU ranks sharing this host (its calibrated rates where `loom calibrate` has run); the
    // emulated device's ranks run the CPU's kernels, holding what a GPU's pools would.
    job.cluster = plan::cluster_named("cpu");
    job.precision = cfg.device == "emu" && cfg.run_precision() != "f32" ? plan::Precision::device : plan::Precision::f32;
    if (cfg.memory_limit > 0) job.cluster.device.memory = double(cfg.memory_limit);
  }
  // A layout fits within the limit with the planner's margin (90% of the memory): its memory model
  // is within a few percent of loom's pools (bench/README.md, "Local truth", "Device truth").
  plan::SearchOptions so;
  so.top = 64;  // the fastest first; a layout this run refuses (its device's constraints) is passed over
  so.schedules = {parallel::pipeline::Kind::gpipe, parallel::pipeline::Kind::one_f_one_b,
                  parallel::pipeline::Kind::interleaved, parallel::pipeline::Kind::zb_h1};
  // fp16 on a GPU runs whole replicas over dp only (its loss scaling is the replica engine's).
  if (cfg.device == "cuda" && cfg.run_precision() == "fp16") {
    so.tp = so.pp = so.cp = 1;
    so.sp = 0;
    so.zeros = {0};
    so.recomputes = {model::Recompute::none};
    so.offload = false;
  }
  const plan::SearchResult r = plan::search(job, so);
  const plan::Estimate* chosen = nullptr;
  const plan::Estimate* next = nullptr;
  int refused = 0;
  std::string first_refusal;
  TrainConfig out;
  for (const plan::Estimate& e : r.best) {
    TrainConfig c = cfg;
    apply_layout(c, e.layout);
    try {
      c.validate(config_path);
      if (c.device == "cuda") c.validate_cuda_vocabulary(mc, config_path);
    } catch (const Error& err) {
      if (!chosen && refused++ == 0) first_refusal = fmt::format("{}: {}", e.layout.str(), err.what());
      continue;
    }
    if (!chosen) {
      chosen = &e;
      out = c;
    } else {
      next = &e;
      break;
    }
  }
  if (!chosen) {
    std::string why = fmt::format("{} layouts considered", r.considered);
    if (cfg.memory_limit > 0) why += fmt::format(", train.memory_limit {}", format_bytes(int64_t(cfg.memory_limit)));
    if (refused > 0)
      why += fmt::format(", {} that fit refused by the run (the first: {})", refused, first_refusal);
    // What the least demanding layout needs, and the limit it would fit.
    else if (r.least)
      why += fmt::format("; the least any needs is {} per rank ({}), which fits a limit of {}",
                         format_bytes(int64_t(r.least->memory_total)), r.least->layout.str(),
                         format_bytes(int64_t(std::ceil(r.least->memory_total / plan::kUsableMemory))));
    throw Error(fmt::format("--plan auto: no layout of {} fits {} ({}); more ranks (parallel.dp, tp, pp, cp) or "
                            "a smaller train.batch_size or data.seq_len",
                            ranks, job.model.str(), why));
  }
  const std::vector<std::string> replaced = replaced_fields(cfg, out);
  cfg = out;
  const plan::Estimate& e = *chosen;
  std::string said = fmt::format("plan auto: {} of {} layouts of {} fit; chose {} (predicted {:.0f} tokens/s, "
                                 "{} per rank",
                                 r.fitting, r.considered, ranks, e.layout.str(), e.tokens_per_s,
                                 format_bytes(int64_t(e.memory_total)));
  if (e.layout.offload) said += fmt::format(" + {} of host memory", format_bytes(int64_t(e.host_memory_total)));
  said += ")";
  if (next) said += fmt::format("; next {} ({:.0f} tokens/s)", next->layout.str(), next->tokens_per_s);
  if (!replaced.empty()) said += fmt::format("; in place of the config's {}", fmt::join(replaced, ", "));
  if (refused > 0)
    said += fmt::format("; {} faster layout{} passed over, refused by the run (the first: {})", refused,
                        refused > 1 ? "s" : "", first_refusal);
  // The CPU profile (loom calibrate) holds f32 rates, and the planner's memory model has no CPU
  // bf16 operand copies: a bf16 run is planned as its f32 twin, and said so.
  if (cfg.device == "cpu" && cfg.run_precision() == "bf16")
    said += "; planned with f32 matmuls (train.precision = bf16: the CPU profile measures f32 GEMMs, so the "
            "prediction is the f32 run's; the bf16 run is faster and keeps bf16 copies of its largest operands)";
  if (cfg.device == "emu")
    said += "; the emulated device planned as this host's CPU ranks holding what GPUs' pools hold (its times are "
            "the CPU's)";
  return said;
}

}  // namespace loom::train

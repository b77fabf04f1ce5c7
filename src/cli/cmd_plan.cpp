// loom plan: which layout to run a model with on a cluster, and what it will cost.
//   loom plan --model M --cluster C --gpus N --global-batch B [--seq T] [--top K] [--explain] [--json]
//   loom plan ... --layout dp=8,tp=8,pp=4,v=2,mbs=1,schedule=interleaved,recompute=selective,sp=1,zero=1 [--json]
// The first form searches every layout (src/plan/planner.h) and prints the fastest that fit with
// their memory per device and step time split into compute, bubble, communication and
// recomputation; the second predicts one layout.
//
// loom simulate: one layout's predicted step as a picture.
//   loom simulate --model M --cluster C --gpus N --global-batch B [--seq T] --layout L --png OUT
//                 [--trace TRACE.json]
// The schedule's own instruction lists (the executor's) run by the checker with the planner's
// per-chunk durations (forward, backward or its two zero-bubble halves, transfers): one row per
// pipeline rank; with --trace (a `loom train --trace` of a pipeline run of the same layout) the
// measured computes of every rank below them, on the same time axis.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <toml++/toml.h>

#include "cli/command.h"
#include "core/error.h"
#include "core/file.h"
#include "parallel/pipeline/checker.h"
#include "parallel/pipeline/draw.h"
#include "plan/planner.h"
#include "data/shard.h"
#include "train/config.h"

namespace loom::cli {
namespace {

namespace pipe = parallel::pipeline;

struct PlanArgs {
  std::string model = "gpt2-124m", cluster = "a100-80gb", layout, precision = "auto";
  int gpus = 8, top = 5;
  int64_t global_batch = 512, seq = 0;
  bool explain = false, json = false;
  std::string png, trace;  // loom simulate
};

// The options both commands take.
void add_job_options(CLI::App& sub, PlanArgs& a) {
  sub.add_option("--model", a.model, "a preset (gpt2-124m ... gpt2-1.5b, llama-7b, llama-70b, llama3-405b, or one of "
                 "loom train's: gpt2-tiny, gpt2-1558m, llama-10m, smollm-135m, ...), a loom train config (its model at "
                 "its data.seq_len), or a model TOML file ([model] with layers, hidden, heads, vocab; optional seq, "
                 "kv_heads, ffn, swiglu, tied, bias, learned_positions)")->capture_default_str();
  sub.add_option("--cluster", a.cluster, "a100-80gb, h100-sxm, h200, cpu (this host: loom calibrate's profile, else "
                 "defaults), or a cluster TOML file ([device] with name, peak_tflops_bf16, peak_tflops_f32, "
                 "efficiency, gemm_half, memory_gb, memory_gbs; [cluster] with gpus_per_node, intra_gbs, "
                 "intra_latency_us, inter_gbs, inter_latency_us, host_gbs, host_latency_us, host_memory_gbs, "
                 "host_memory_gb; base = a preset to start from)")->capture_default_str();
  sub.add_option("--gpus", a.gpus, "devices in all")->capture_default_str()->check(CLI::Range(1, 1 << 20));
  sub.add_option("--global-batch", a.global_batch, "sequences per optimizer step")
      ->capture_default_str()
      ->check(CLI::Range(int64_t(1), int64_t(1) << 30));
  sub.add_option("--seq", a.seq, "sequence length (default: the model's)")->check(CLI::Range(int64_t(1), int64_t(1) << 24));
  sub.add_option("--precision", a.precision,
                 "auto (loom's runs on the cluster: f32 on the cpu cluster, device on GPUs), device (loom's GPU "
                 "runs: bf16 compute over f32 weights, gradients and moments), f32 (loom's CPU runs) or mixed "
                 "(16-bit with f32 master weights, as ZeRO and Megatron-LM account it)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "mixed", "f32", "device"}));
}

// --model: a preset, a model file, or a `loom train` config (its [model] table's preset and
// overrides, at its data.seq_len; the vocabulary model.vocab_size gives, else its data.dir's
// shards', else the preset's).
plan::ModelSpec model_of(const std::string& m) {
  if (std::filesystem::is_regular_file(m)) {
    toml::table t;
    try {
      t = toml::parse(read_file(m), m);
    } catch (const toml::parse_error&) {
      return plan::model_named(m);  // (which names the error)
    }
    bool train_config = false;
    for (const auto& [k, v] : t) train_config |= k.str() != "model";
    if (const toml::table* mt = t["model"].as_table())
      for (const char* key : {"preset", "n_layer", "n_head", "n_embd", "vocab_size", "n_kv_head", "ffn_hidden"})
        train_config |= mt->contains(key);
    if (train_config) {
      const train::TrainConfig cfg = train::load_config(m, {});
      int64_t vocab = 0;
      try {
        const std::vector<std::string> shards = data::list_shards(cfg.data_dir, "train");
        if (!shards.empty()) vocab = data::Shard(shards.front(), /*verify_payload=*/false).vocab_size();
      } catch (const Error&) {
      }
      return plan::from_gpt(cfg.model(vocab), cfg.seq_len);
    }
  }
  return plan::model_named(m);
}

plan::Job make_job(const PlanArgs& a) {
  plan::Job job;
  job.model = model_of(a.model);
  if (a.seq > 0) job.model.seq = a.seq;
  job.model.validate("--model " + a.model);
  job.cluster = plan::cluster_named(a.cluster);
  job.devices = a.gpus;
  job.global_batch = a.global_batch;
  job.precision = a.precision != "auto"      ? plan::parse_precision(a.precision, "--precision")
                  : job.cluster.shared_host ? plan::Precision::f32
                                            : plan::Precision::device;
  return job;
}

// --layout, with dp filled in from --gpus when not given.
plan::Layout layout_of(const PlanArgs& a) {
  plan::Layout L = plan::parse_layout(a.layout);
  if (L.devices() != a.gpus && a.layout.find("dp=") == std::string::npos) {
    LOOM_CHECK(a.gpus % (L.tp * L.pp * L.cp) == 0, "--layout: tp x pp x cp = {} does not divide --gpus {}",
               L.tp * L.pp * L.cp, a.gpus);
    L.dp = a.gpus / (L.tp * L.pp * L.cp);
  }
  return L;
}

// The computes of a `loom train --trace` of a pipeline run: a row per rank (the trace's threads),
// seconds from the first event.
pipe::Timeline measured_timeline(const std::string& path) {
  const std::string text = read_file(path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    throw Error(fmt::format("--trace {}: not JSON ({})", path, e.what()));
  }
  // Chrome's two forms: {"traceEvents": [...]} or the array of events itself.
  const nlohmann::json& events = j.is_object() && j.contains("traceEvents") ? j["traceEvents"] : j;
  LOOM_CHECK(events.is_array(), "--trace {}: no trace events (a Chrome trace written by `loom train --trace`)", path);
  std::map<std::string, pipe::Op> ops;
  for (pipe::Op op : {pipe::Op::forward, pipe::Op::backward, pipe::Op::backward_input, pipe::Op::backward_weight})
    ops[std::string(pipe::op_name(op))] = op;
  pipe::Timeline tl;
  double t0 = std::numeric_limits<double>::infinity();
  std::vector<std::tuple<int, pipe::Box>> boxes;
  for (const auto& e : events) {
    if (!e.is_object() || e.value("ph", "") != "X" || !e.contains("args") || !e["args"].contains("mb")) continue;
    const auto op = ops.find(e.value("cat", ""));
    if (op == ops.end()) continue;
    const double start = e.value("ts", 0.0) * 1e-6, dur = e.value("dur", 0.0) * 1e-6;
    const int tid = e.value("tid", -1);
    LOOM_CHECK(tid >= 0 && tid < (1 << 20), "--trace {}: an event with thread {}", path, tid);
    boxes.push_back({tid, pipe::Box{start, start + dur, op->second, e["args"].value("mb", 0), e["args"].value("chunk", 0)}});
    t0 = std::min(t0, start);
  }
  LOOM_CHECK(!boxes.empty(), "--trace {}: no pipeline computes in it (a `loom train --trace` of a run with "
             "parallel.pp > 1)", path);
  for (auto& [tid, b] : boxes) {
    if (size_t(tid) >= tl.rows.size()) tl.rows.resize(size_t(tid) + 1);
    b.start -= t0, b.end -= t0;
    tl.rows[size_t(tid)].push_back(b);
  }
  return tl;
}

Registrar reg{Command{
    "plan", "choose a parallel layout for a model on a cluster and predict its memory and speed",
    [](CLI::App& sub) -> std::function<int()> {
      auto a = std::make_shared<PlanArgs>();
      add_job_options(sub, *a);
      sub.add_option("--layout", a->layout, "predict this layout only: dp=,tp=,pp=,v=,cp=,sp=,mbs=,schedule=,"
                     "recompute=,zero=,offload=");
      sub.add_option("--top", a->top, "layouts to show")->capture_default_str()->check(CLI::Range(1, 100));
      sub.add_flag("--explain", a->explain, "say why the first choice beats the next ones");
      sub.add_flag("--json", a->json, "print JSON");
      return [a]() -> int {
        const plan::Job job = make_job(*a);
        if (!a->layout.empty()) {
          const plan::Estimate e = plan::estimate(job, layout_of(*a));
          if (a->json) {
            std::printf("%s\n", plan::to_json(e).c_str());
          } else {
            std::printf("%s on %d x %s, global batch %lld, %s precision\n", job.model.str().c_str(), job.devices,
                        job.cluster.device.name.c_str(), static_cast<long long>(job.global_batch),
                        std::string(plan::precision_name(job.precision)).c_str());
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
        std::printf("%s on %d x %s, global batch %lld, %s precision: %lld layouts considered, %lld fit (%.2f s)\n",
                    job.model.str().c_str(), job.devices, job.cluster.device.name.c_str(),
                    static_cast<long long>(job.global_batch), std::string(plan::precision_name(job.precision)).c_str(),
                    static_cast<long long>(r.considered),
                    static_cast<long long>(r.fitting), r.seconds);
        if (r.best.empty()) {
          std::printf("no layout fits\n");
          // None to consider: the devices cannot be divided as the layouts need.
          if (r.considered == 0)
            std::printf("no layout divides %d devices for this job: dp x tp x pp x cp must be the devices, with dp "
                        "dividing the global batch (%lld), tp the heads (%lld) and at most a node's %d devices, pp the "
                        "layers (%lld), and cp of 2, 4 or 8 only for sequences of 8192 or more (%lld)\n",
                        job.devices, static_cast<long long>(job.global_batch), static_cast<long long>(job.model.heads),
                        job.cluster.per_node, static_cast<long long>(job.model.layers),
                        static_cast<long long>(job.model.seq));
          if (r.least)
            std::printf("the least any needs is %.2f GB per device (%s): it needs a device of at least %.2f GB "
                        "(%.0f%% of one usable)\n",
                        r.least->memory_total / 1e9, r.least->layout.str().c_str(),
                        r.least->memory_total / plan::kUsableMemory / 1e9, 100 * plan::kUsableMemory);
          return 1;
        }
        std::fputs(plan::format_table(job, r.best).c_str(), stdout);
        if (a->explain) std::fputs(plan::explain(r.best).c_str(), stdout);
        return 0;
      };
    }}};

Registrar reg_simulate{Command{
    "simulate", "draw one layout's predicted step (the schedule's lists with the planner's durations) as a PNG, "
                "beside a measured one",
    [](CLI::App& sub) -> std::function<int()> {
      auto a = std::make_shared<PlanArgs>();
      add_job_options(sub, *a);
      sub.add_option("--layout", a->layout, "the layout: dp=,tp=,pp=,v=,cp=,sp=,mbs=,schedule=,recompute=,zero=,offload=")
          ->required();
      sub.add_option("--png", a->png, "the picture to write")->required();
      sub.add_option("--trace", a->trace, "a `loom train --trace` of a pipeline run of this layout: its computes "
                     "below the prediction");
      return [a]() -> int {
        check_output_path(a->png, "--png");  // before the work, not after it
        const plan::Job job = make_job(*a);
        const plan::Layout L = layout_of(*a);
        const plan::Estimate e = plan::estimate(job, L);
        LOOM_REQUIRE(e.why_not.empty() || e.fits, "--layout {}: {}", L.str(), e.why_not);
        // The step as the executor runs it: the schedule generated for the computes' durations
        // (free transfers), then run with the transfers (plan::estimate does the same).
        pipe::ScheduleSpec spec;
        spec.kind = L.pp > 1 ? L.schedule : pipe::Kind::one_f_one_b;
        spec.stages = L.pp;
        spec.virtual_stages = L.pp > 1 ? L.v : 1;
        spec.micro_batches = int(e.micro_batches);
        const pipe::Schedule sch = pipe::generate(spec, e.order_costs);
        const pipe::CheckResult res = pipe::simulate(sch, e.rank_costs);
        pipe::Timeline tl = pipe::schedule_timeline(sch, res);
        for (int r = 0; r < sch.p(); ++r) tl.labels.push_back(fmt::format("predicted stage {}", r));
        tl.title = fmt::format("{}: predicted step {:.1f} ms", L.str(), 1e3 * res.makespan);
        if (!a->trace.empty()) {
          const pipe::Timeline m = measured_timeline(a->trace);
          double span = 0;
          for (size_t r = 0; r < m.rows.size(); ++r) {
            tl.rows.push_back(m.rows[r]);
            tl.labels.push_back(fmt::format("measured rank {}", r));  // (the trace's: world ranks)
            for (const pipe::Box& b : m.rows[r]) span = std::max(span, b.end);
          }
          tl.title += fmt::format(", measured {:.1f} ms (the trace's last step)", 1e3 * span);
        }
        std::string why;
        if (!pipe::draw_png(a->png, tl, &why)) throw Error(fmt::format("--png {}: {}", a->png, why));
        std::printf("%s: wrote %s\n", tl.title.c_str(), a->png.c_str());
        return 0;
      };
    }}};

}  // namespace
}  // namespace loom::cli

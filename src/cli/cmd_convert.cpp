// loom convert: Hugging Face GPT2LMHeadModel and LlamaForCausalLM safetensors <-> loom checkpoints.
//   loom convert --from hf --to loom IN [--config config.json] OUT_DIR [--seed S]
//     IN: a model directory, model.safetensors or model.safetensors.index.json (Llama's shards)
//   loom convert --from loom --to hf CKPT_OR_RUN_DIR OUT_DIR [--max-shard-mb N]
#include <cstdio>
#include <filesystem>
#include <memory>

#include "cli/command.h"
#include "core/error.h"
#include "core/memory.h"
#include "train/checkpoint_io.h"
#include "model/gpt.h"
#include "train/hf_config.h"
#include "train/hf_gpt2.h"
#include "train/hf_llama.h"
#include "train/checkpoint.h"

namespace fs = std::filesystem;

namespace loom::cli {
namespace {

struct ConvertArgs {
  std::string from, to, in, out, config;
  uint64_t seed = 1337;
  double max_shard_mb = 5 * 1024;
};

int run_convert(const ConvertArgs& a) {
  MemoryPool pool("cpu:0");
  if (a.from == "hf" && a.to == "loom") {
    std::string config = a.config;
    if (config.empty()) {
      const fs::path dir = fs::is_directory(a.in) ? fs::path(a.in) : fs::path(a.in).parent_path();
      config = (dir / "config.json").string();
      if (!fs::exists(config))
        throw Error(fmt::format("{}: no config.json {}; pass --config (n_head cannot be read from the tensors)", a.in,
                                fs::is_directory(a.in) ? "in it" : "beside it"));
    }
    const model::GPTConfig cfg = model::read_hf_config(config);
    model::GPT gpt(cfg, pool, a.seed);
    if (model::is_llama(cfg)) {
      model::load_hf_llama(a.in, gpt);
    } else {
      const std::string st = fs::is_directory(a.in) ? (fs::path(a.in) / "model.safetensors").string() : a.in;
      model::load_hf_gpt2(st, gpt);
    }
    const std::string ckpt = model::save_initial_checkpoint(gpt, a.out, a.seed);
    std::printf("%s: %s, %.2fM parameters (seed %llu for loom train --resume)\n", ckpt.c_str(), cfg.str().c_str(),
                double(gpt.num_parameters()) / 1e6, static_cast<unsigned long long>(a.seed));
    return 0;
  }
  if (a.from == "loom" && a.to == "hf") {
    if (!a.config.empty()) throw Error("command line: --config applies to --from hf only");
    const std::string ckpt = model::resolve_checkpoint(a.in);
    const model::GPTConfig cfg = model::checkpoint_model_config(ckpt);
    if (!(a.max_shard_mb > 0)) throw Error(fmt::format("command line: --max-shard-mb must be positive, got {}", a.max_shard_mb));
    if (model::is_llama(cfg)) {
      train::CheckpointReader r(ckpt);
      model::save_hf_llama(
          cfg, [&](const model::ParamSpec& spec, float* dst) { model::read_checkpoint_param(r, ckpt, spec, dst); },
          a.out, int64_t(a.max_shard_mb * 1024 * 1024));
    } else {
      (void)model::hf_config_json(cfg);  // a mix of the families is refused before anything is written
      model::save_hf_gpt2_from_checkpoint(ckpt, a.out);  // tensor by tensor, never the whole model
    }
    const size_t files = model::is_llama(cfg) ? model::hf_files(a.out).files.size() : 1;
    std::printf("%s: %s + config.json from %s (%s)\n", a.out.c_str(),
                files == 1 ? "model.safetensors" : fmt::format("{} shards + model.safetensors.index.json", files).c_str(),
                ckpt.c_str(), cfg.str().c_str());
    return 0;
  }
  throw Error(fmt::format("command line: cannot convert --from {} --to {} (supported: hf -> loom, loom -> hf)",
                          a.from, a.to));
}

Registrar reg{Command{
    "convert", "convert GPT-2 and Llama weights between Hugging Face safetensors and loom checkpoints",
    [](CLI::App& sub) -> std::function<int()> {
      auto a = std::make_shared<ConvertArgs>();
      sub.add_option("--from", a->from, "input format: hf or loom")->required()->check(CLI::IsMember({"hf", "loom"}));
      sub.add_option("--to", a->to, "output format: loom or hf")->required()->check(CLI::IsMember({"hf", "loom"}));
      sub.add_option("input", a->in, "hf: a model directory, model.safetensors or model.safetensors.index.json; loom: "
                                     "checkpoint or run directory")
          ->required();
      sub.add_option("output", a->out, "hf: directory for model.safetensors + config.json; loom: new run directory")
          ->required();
      sub.add_option("--config", a->config, "hf: config.json (default: beside the input)");
      sub.add_option("--max-shard-mb", a->max_shard_mb, "to hf (Llama): largest safetensors shard in MiB (default 5120; "
                                                        "more than one writes model.safetensors.index.json)");
      sub.add_option("--seed", a->seed, "loom: the seed recorded in the checkpoint (train.seed of the run that "
                                        "resumes it)");
      return [a]() { return run_convert(*a); };
    }}};

}  // namespace
}  // namespace loom::cli

// loom convert: Hugging Face GPT2LMHeadModel and LlamaForCausalLM safetensors <-> loom checkpoints.
//   loom convert --from hf --to loom IN [--config config.json] OUT_DIR [--seed S]
//     IN: a model directory, model.safetensors or model.safetensors.index.json (Llama's shards)
//   loom convert --from loom --to hf CKPT_OR_RUN_DIR OUT_DIR [--max-shard-mb N]
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <set>

#include "cli/checkpoint_tokenizer.h"
#include "cli/command.h"
#include "core/error.h"
#include "core/file.h"
#include "core/memory.h"
#include "train/checkpoint_io.h"
#include "model/gpt.h"
#include "train/hf_config.h"
#include "train/hf_gpt2.h"
#include "train/hf_llama.h"
#include "train/checkpoint.h"
#include "train/safetensors.h"
#include "model/param_specs.h"

namespace fs = std::filesystem;

namespace loom::cli {
namespace {

// The first tensor of the model that none of the files holds (empty: none), named where the
// counts below fail.
std::string first_missing_tensor(model::GPTConfig cfg, const std::set<std::string>& held) {
  // (Every layer has a tensor: past as many layers as the files hold tensors one is missing, and a
  // config of 10^12 layers is not listed out.)
  cfg.n_layer = std::min<int64_t>(cfg.n_layer, int64_t(held.size()) + 1);
  if (model::is_llama(cfg)) {
    for (const model::HfPart& part : model::hf_llama_parts(cfg))
      if (!held.count(part.hf_name)) return part.hf_name;
    return "";
  }
  for (const model::ParamSpec& s : model::gpt_param_specs(cfg)) {
    const std::string k = model::hf_key(s.name).name;
    if (!held.count(k) && !held.count("transformer." + k)) return k;
  }
  return "";
}

// config.json's model against the safetensors files before a model is allocated from it: no more
// layers than the files hold tensors for, no more parameters than they hold values (the loaders
// then check every tensor's name and shape). A config.json of another model, or damaged, would
// otherwise allocate until memory runs out.
void check_config_fits_files(const model::GPTConfig& cfg, const std::vector<std::string>& files,
                             const std::string& config) {
  LOOM_CHECK(!files.empty(), "{}: no weights files", config);
  double tensors = 0, values = 0;
  std::set<std::string> held;
  for (const std::string& f : files) {
    const train::SafetensorsReader r(f);
    for (const train::SafetensorsEntry& e : r.entries()) {
      tensors += 1;
      values += double(e.numel());
      held.insert(e.name);
    }
  }
  const auto missing = [&] {
    const std::string m = first_missing_tensor(cfg, held);
    return m.empty() ? std::string() : fmt::format("; tensor '{}' is in none of them", m);
  };
  const double per_layer = double(model::block_param_specs(cfg, 0).size());
  LOOM_CHECK(double(cfg.n_layer) * per_layer <= tensors,
             "{}: the model has {} layers of {} tensors, but the weights hold {} tensors ({}{})", config, cfg.n_layer,
             per_layer, tensors, files.front(), missing());
  double params = 0;
  for (const model::ParamSpec& s : model::gpt_param_specs(cfg)) {
    double n = 1;
    for (int64_t d : s.shape) n *= double(d);
    params += n;
  }
  LOOM_CHECK(params <= values, "{}: the model ({}) has {:.0f} parameters, but the weights hold {:.0f} values ({}{})",
             config, cfg.str(), params, values, files.front(), missing());
}

struct ConvertArgs {
  std::string from, to, in, out, config;
  uint64_t seed = 1337;
  double max_shard_mb = 5 * 1024;
  bool max_shard_given = false;
};

// An export's directory may hold other files (a tokenizer, a README), but no model already: its
// weights files and config.json would be mixed with the new ones (a single model.safetensors beside
// another model's shards and index, which readers take first).
void refuse_held_model(const std::string& out) {
  std::error_code ec;
  if (!fs::is_directory(out, ec)) return;
  std::vector<std::string> held;
  for (const auto& e : fs::directory_iterator(out, ec)) {
    const std::string name = e.path().filename().string();
    const bool weights = name.starts_with("model") && (name.ends_with(".safetensors") || name.ends_with(".index.json"));
    if (weights || name == "config.json") held.push_back(name);
  }
  if (held.empty()) return;
  std::sort(held.begin(), held.end());
  std::string names;
  for (size_t i = 0; i < held.size() && i < 3; ++i) names += (i ? ", " : "") + held[i];
  if (held.size() > 3) names += fmt::format(" and {} more", held.size() - 3);
  throw Error(fmt::format("{}: already holds a model ({}); choose a new directory or remove them (nothing was written)",
                          out, names));
}

// The tokenizer beside a Hugging Face model (tokenizer.json, or vocab.json + merges.txt) into the
// converted run's directory, where generate and eval find it: only one loom reads and whose
// vocabulary fits the model; otherwise said, and the run takes --tokenizer.
void copy_model_tokenizer(const std::string& from, const std::string& run, int64_t vocab) {
  if (from.empty() || !data::Tokenizer::dir_has_tokenizer(from)) return;
  try {
    const data::Tokenizer tok = data::Tokenizer::from_dir(from);
    if (tok.vocab_size() > vocab)
      throw Error(fmt::format("{} tokens, more than the model's vocabulary of {}", tok.vocab_size(), vocab));
  } catch (const Error& e) {
    std::printf("  tokenizer beside the model not copied (%s); give generate and eval --tokenizer\n", e.what());
    return;
  }
  for (const std::string& f : data::Tokenizer::files_in_dir(from)) {
    const fs::path to = fs::path(run) / fs::path(f).filename();
    write_file_atomically(to.string(), read_file(f));
    std::printf("  tokenizer: %s\n", to.string().c_str());
  }
}

// A checkpoint's tokenizer into an export for Hugging Face: tokenizer.json as it is; GPT-2's
// encoder.json + vocab.bpe as vocab.json + merges.txt (the same formats under the names
// transformers' GPT2Tokenizer reads).
void export_tokenizer(const std::string& ckpt, const std::string& out) {
  std::string dir;
  try {
    dir = checkpoint_tokenizer_dir(ckpt, "");
    (void)checkpoint_tokenizer(ckpt, dir);  // (the vocabulary the checkpoint was trained with)
  } catch (const Error&) {
    std::printf("  no tokenizer of the checkpoint found: config.json and the weights only\n");
    return;
  }
  for (const std::string& f : data::Tokenizer::files_in_dir(dir)) {
    std::string name = fs::path(f).filename().string();
    if (name == "encoder.json") name = "vocab.json";
    if (name == "vocab.bpe") name = "merges.txt";
    const fs::path to = fs::path(out) / name;
    if (fs::exists(to)) {  // (a file the user put there is kept)
      std::printf("  tokenizer: %s kept as it was\n", to.string().c_str());
      continue;
    }
    write_file_atomically(to.string(), read_file(f));
    std::printf("  tokenizer: %s\n", to.string().c_str());
  }
}

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
    const std::string st = fs::is_directory(a.in) ? (fs::path(a.in) / "model.safetensors").string() : a.in;
    if (!model::is_llama(cfg) && st.ends_with(".index.json"))
      throw Error(fmt::format("{}: an index of sharded weights, and a GPT-2 model is read from one model.safetensors "
                              "(give that file or its directory)",
                              st));
    check_config_fits_files(cfg, model::is_llama(cfg) ? model::hf_files(a.in).files : std::vector<std::string>{st},
                            config);
    model::GPT gpt(cfg, pool, a.seed);
    if (model::is_llama(cfg)) model::load_hf_llama(a.in, gpt);
    else model::load_hf_gpt2(st, gpt);
    const std::string ckpt = model::save_initial_checkpoint(gpt, a.out, a.seed);
    std::printf("%s: %s, %.2fM parameters (seed %llu for loom train --resume)\n", ckpt.c_str(), cfg.str().c_str(),
                double(gpt.num_parameters()) / 1e6, static_cast<unsigned long long>(a.seed));
    copy_model_tokenizer(fs::path(config).parent_path().string(), a.out, cfg.vocab_size);
    return 0;
  }
  if (a.from == "loom" && a.to == "hf") {
    if (!a.config.empty()) throw Error("command line: --config applies to --from hf only");
    refuse_held_model(a.out);
    const std::string ckpt = model::resolve_checkpoint(a.in);
    const model::GPTConfig cfg = model::checkpoint_model_config(ckpt);
    if (model::is_llama(cfg)) {
      train::CheckpointReader r(ckpt);
      model::save_hf_llama(
          cfg, [&](const model::ParamSpec& spec, float* dst) { model::read_checkpoint_param(r, ckpt, spec, dst); },
          a.out, int64_t(a.max_shard_mb * 1024 * 1024));
    } else {
      if (a.max_shard_given)
        throw Error(fmt::format("command line: --max-shard-mb: {} is a GPT-2 model, which is written as one "
                                "model.safetensors (shards are for Llama exports; nothing was written)",
                                ckpt));
      (void)model::hf_config_json(cfg);  // a mix of the families is refused before anything is written
      model::save_hf_gpt2_from_checkpoint(ckpt, a.out);  // tensor by tensor, never the whole model
    }
    const size_t files = model::is_llama(cfg) ? model::hf_files(a.out).files.size() : 1;
    std::printf("%s: %s + config.json from %s (%s)\n", a.out.c_str(),
                files == 1 ? "model.safetensors" : fmt::format("{} shards + model.safetensors.index.json", files).c_str(),
                ckpt.c_str(), cfg.str().c_str());
    export_tokenizer(ckpt, a.out);
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
                                                        "more than one writes model.safetensors.index.json)")
      ->check(number_in(0.001, 1 << 30));
      sub.add_option("--seed", a->seed, "loom: the seed recorded in the checkpoint (train.seed of the run that "
                                        "resumes it)")
          ->transform(seed_validator());
      return [a, &sub]() {
        a->max_shard_given = sub.count("--max-shard-mb") > 0;
        return run_convert(*a);
      };
    }}};

}  // namespace
}  // namespace loom::cli

// loom generate CKPT_DIR --prompt TEXT --tokens N [--temperature T (0: greedy)] [--top-k K] [--seed S]
//   [--tokenizer DIR] [--ids] [--no-cache]: samples text from a checkpoint with a KV cache.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <sstream>

#include "cli/checkpoint_tokenizer.h"
#include "cli/command.h"
#include "core/error.h"
#include "core/memory.h"
#include "data/tokenizer.h"
#include "train/checkpoint_io.h"
#include "model/gpt.h"
#include "model/kv_cache.h"
#include "train/checkpoint.h"
#include "train/run_util.h"
#include "train/sample.h"

namespace fs = std::filesystem;

namespace loom::cli {
namespace {

struct GenerateArgs {
  std::string ckpt, prompt, tokenizer;
  int64_t tokens = 64, top_k = 40;
  float temperature = 1.0f;
  uint64_t seed = 1337;
  int32_t stop_id = -1;
  bool ids = false, no_cache = false, quiet = false;
};

std::vector<int32_t> parse_ids(const std::string& s) {
  std::string t = s;
  for (char& c : t) c = c == ',' ? ' ' : c;
  std::istringstream in(t);
  std::vector<int32_t> out;
  std::string w;
  while (in >> w) {
    size_t used = 0;
    long long v = 0;
    try {
      v = std::stoll(w, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != w.size() || v < 0 || v > INT32_MAX)
      throw Error(fmt::format("command line: --prompt '{}' is not a token id (with --ids)", w));
    out.push_back(int32_t(v));
  }
  return out;
}

int run_generate(const GenerateArgs& a) {
  if (!(a.temperature >= 0) || !std::isfinite(a.temperature))
    throw Error(fmt::format("command line: --temperature must be a finite number >= 0 (0: greedy), got {}",
                            a.temperature));
  if (a.tokens < 0) throw Error(fmt::format("command line: --tokens must be non-negative, got {}", a.tokens));
  if (a.top_k < 0) throw Error(fmt::format("command line: --top-k must be non-negative, got {}", a.top_k));
  const std::string ckpt = model::resolve_checkpoint(a.ckpt);
  const model::GPTConfig cfg = model::checkpoint_model_config(ckpt);
  std::unique_ptr<data::Tokenizer> tok;
  if (!a.ids) tok = std::make_unique<data::Tokenizer>(checkpoint_tokenizer(ckpt, a.tokenizer));
  // (A text prompt after the tokens tokenizer.json's post-processor starts a text with: Llama 3's
  // <|begin_of_text|>.)
  std::vector<int32_t> prompt = a.ids ? parse_ids(a.prompt) : train::prompt_ids(*tok, a.prompt);
  if (prompt.empty()) throw Error("command line: --prompt is empty (the model needs at least one token)");
  for (int32_t t : prompt)
    if (t >= cfg.vocab_size)
      throw Error(fmt::format("command line: prompt token {} is outside the model's vocabulary of {}", t, cfg.vocab_size));
  if (a.stop_id < -1 || a.stop_id >= cfg.vocab_size)
    throw Error(fmt::format("command line: --stop-id {} is outside the model's vocabulary of {} (-1: never stop)",
                            a.stop_id, cfg.vocab_size));
  if (tok && tok->vocab_size() > cfg.vocab_size)
    throw Error(fmt::format("tokenizer has {} tokens but {} has a vocabulary of {}", tok->vocab_size(), ckpt,
                            cfg.vocab_size));

  MemoryPool pool("cpu:0");
  model::GPT gpt(cfg, pool);
  model::load_checkpoint_params(ckpt, gpt);
  train::SampleOptions so;
  so.max_new_tokens = a.tokens;
  // Temperature 0: greedy decoding, the most likely token each time (top-k 1).
  so.temperature = a.temperature > 0 ? a.temperature : 1.0f;
  so.top_k = a.temperature > 0 ? a.top_k : 1;
  so.seed = a.seed;
  so.stop_token = a.stop_id;
  if (tok) so.vocab_limit = tok->vocab_size();  // (ids the tokenizer decodes)
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> out;
  if (a.no_cache) {
    out = train::sample_recompute(gpt, prompt, so);
  } else {
    out = model::generate_cached(
        gpt, prompt, a.tokens,
        [&](const float* logits, uint64_t index) { return train::sample_logits(logits, cfg.vocab_size, so, index); },
        a.stop_id);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (tok) {
    std::string text = tok->decode(prompt) + tok->decode(out);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::printf("\n");
  } else {
    std::string line;
    for (int32_t t : prompt) line += std::to_string(t) + " ";
    line += "|";
    for (int32_t t : out) line += " " + std::to_string(t);
    std::printf("%s\n", line.c_str());
  }
  if (!a.quiet)
    std::fprintf(stderr, "%zu tokens in %.3f s (%.1f tokens/s, %s)\n", out.size(), s, s > 0 ? double(out.size()) / s : 0.0,
                 a.no_cache ? "recomputed" : "KV cache");
  return 0;
}

Registrar reg{Command{
    "generate", "sample text from a checkpoint (temperature, top-k) with a KV cache",
    [](CLI::App& sub) -> std::function<int()> {
      auto a = std::make_shared<GenerateArgs>();
      sub.add_option("checkpoint", a->ckpt, "checkpoint directory, or a run directory with 'latest'")->required();
      sub.add_option("--prompt", a->prompt, "text to continue (token ids with --ids)")->required();
      sub.add_option("--tokens", a->tokens, "new tokens to sample")->capture_default_str();
      sub.add_option("--temperature", a->temperature, "sampling temperature (0: greedy, the most likely token)")
          ->capture_default_str();
      sub.add_option("--top-k", a->top_k,
                     "sample among the k most likely tokens and those tied with the k-th (0: all; 1: the most likely)")
          ->capture_default_str();
      sub.add_option("--seed", a->seed, "seed of the draws (same seed, same text)")->transform(seed_validator())
          ->capture_default_str();
      sub.add_option("--tokenizer", a->tokenizer, "directory with the tokenizer (default: the training data's)");
      sub.add_option("--stop-id", a->stop_id, "stop after this token id (-1: never)")
          ->capture_default_str();
      sub.add_flag("--ids", a->ids, "the prompt and the output are token ids");
      sub.add_flag("--no-cache", a->no_cache, "recompute the whole window for every token (for comparison)");
      sub.add_flag("--quiet", a->quiet, "no timing line on stderr");
      return [a]() { return run_generate(*a); };
    }}};

}  // namespace
}  // namespace loom::cli

// loom eval CKPT (--text FILE | --tokens FILE) [--tokenizer DIR] [--seq N] [--stride S] [--batch B]
// [--device cpu|cuda|emu] [--json]: the loss and perplexity of a checkpoint (either family) on a file.
//
// The tokens (the text encoded with the checkpoint's tokenizer, or a loom token shard written by
// `loom prepare`) are cut into windows of --seq + 1 tokens, each predicting its last --seq tokens
// from the ones before them, as training does, starting every --stride tokens (default --seq:
// consecutive windows sharing their boundary token, llm.c's and loom's validation loss). A
// window counts only the tokens no earlier window predicted, so with a stride below --seq every
// token after the first window is predicted with at least --seq - --stride tokens before it:
// Hugging Face's perplexity recipe with that stride. The last window may be shorter. The loss is
// the mean cross-entropy over every predicted token (each once), the perplexity its exponential.
// Windows run --batch at a time, on the CPU in f32 or on a GPU in bf16 (the checkpoint's f32
// weights uploaded, the CUDA backend's default attention).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <toml++/toml.h>

#include "cli/checkpoint_tokenizer.h"
#include "cli/command.h"
#include "core/backend.h"
#include "core/error.h"
#include "core/file.h"
#include "core/memory.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "model/gpt.h"
#include "train/checkpoint.h"
#include "train/checkpoint_io.h"

namespace loom::cli {
namespace {

struct EvalArgs {
  std::string ckpt, text, tokens, tokenizer, device = "cpu";
  int64_t seq = 0, batch = 8, stride = 0;
  bool json = false;
};

// Whether the checkpoint's model has its run's data's vocabulary (the run's config left
// model.vocab_size to the data): a shard of that data has exactly as many tokens. (A model given a
// larger vocabulary, or converted from elsewhere, may score shards of a smaller one.)
bool vocabulary_is_the_datas(const train::CheckpointMeta& meta) {
  if (meta.config_toml.empty()) return false;
  try {
    const toml::table t = toml::parse(meta.config_toml);
    const std::optional<int64_t> v = t["model"]["vocab_size"].value<int64_t>();
    return !v || *v == 0;
  } catch (const toml::parse_error&) {
    return false;
  }
}

std::vector<int32_t> read_tokens(const EvalArgs& a, const std::string& ckpt, const model::GPTConfig& cfg) {
  std::vector<int32_t> ids;
  if (!a.text.empty()) {
    const std::string text = read_file(a.text);
    const data::Tokenizer tok = checkpoint_tokenizer(ckpt, a.tokenizer);
    if (tok.vocab_size() > cfg.vocab_size)
      throw Error(fmt::format("tokenizer has {} tokens but {} has a vocabulary of {}", tok.vocab_size(), ckpt,
                              cfg.vocab_size));
    // As Hugging Face's tokenizer(text) encodes it: special tokens recognised, and the
    // post-processor's around it (Llama 3's <|begin_of_text|> before).
    ids = tok.template_prefix();
    for (int32_t t : tok.encode(text, {.allow_special = true})) ids.push_back(t);
    ids.insert(ids.end(), tok.template_suffix().begin(), tok.template_suffix().end());
  } else {
    const data::Shard shard(a.tokens);
    if (int64_t(shard.vocab_size()) > cfg.vocab_size)
      throw Error(fmt::format("{}: its vocabulary has {} tokens but {} has a vocabulary of {}", a.tokens,
                              shard.vocab_size(), ckpt, cfg.vocab_size));
    // The same size is not the same vocabulary: a shard of another tokenizer (`loom prepare` leaves
    // its tokenizer beside its shards) would give a loss of other text.
    // Without one, only a shard of the model's own vocabulary size is taken.
    const std::string dir = std::filesystem::path(a.tokens).parent_path().string();
    const train::CheckpointMeta meta = train::read_checkpoint_meta(ckpt);
    const std::string want = meta.vocabulary;
    if (data::Tokenizer::dir_has_tokenizer(dir.empty() ? "." : dir)) {
      const data::Tokenizer beside = data::Tokenizer::from_dir(dir.empty() ? "." : dir);
      if (int64_t(shard.vocab_size()) != int64_t(beside.vocab_size()))
        throw Error(fmt::format("{}: its header's vocabulary has {} tokens, but the tokenizer beside it has {}: not "
                                "the shard of that tokenizer",
                                a.tokens, shard.vocab_size(), beside.vocab_size()));
      const std::string have = beside.fingerprint();
      if (!want.empty() && have != want)
        throw Error(fmt::format("{}: encoded with vocabulary {} (the tokenizer beside it), but {} was trained with "
                                "vocabulary {}",
                                a.tokens, have, ckpt, want));
    } else if (int64_t(shard.vocab_size()) != cfg.vocab_size && vocabulary_is_the_datas(meta)) {
      throw Error(fmt::format("{}: its vocabulary has {} tokens and {}'s has {} (its run's data's), and no tokenizer "
                              "beside the shard says which it is: put the tokenizer it was prepared with beside it "
                              "(or use --text)",
                              a.tokens, shard.vocab_size(), ckpt, cfg.vocab_size));
    }
    ids.resize(size_t(shard.size()));
    shard.read(0, shard.size(), ids.data());
  }
  return ids;
}

int run_eval(const EvalArgs& a) {
  if (a.text.empty() == a.tokens.empty())
    throw Error("command line: give one of --text FILE (encoded with the checkpoint's tokenizer) and --tokens FILE "
                "(a loom token shard)");
  if (a.batch <= 0) throw Error(fmt::format("command line: --batch must be positive, got {}", a.batch));
  const std::string ckpt = model::resolve_checkpoint(a.ckpt);
  const model::GPTConfig cfg = model::checkpoint_model_config(ckpt);
  const int64_t T = a.seq > 0 ? a.seq : cfg.block_size;
  if (T > cfg.block_size)
    throw Error(fmt::format("command line: --seq {} exceeds the model's block_size {}", T, cfg.block_size));
  const int64_t S = a.stride > 0 ? a.stride : T;
  if (S > T)
    throw Error(fmt::format("command line: --stride {} exceeds the window (--seq {}): tokens between windows would "
                            "go unpredicted",
                            S, T));
  const std::vector<int32_t> ids = read_tokens(a, ckpt, cfg);
  const std::string file = a.text.empty() ? a.tokens : a.text;
  if (ids.size() < 2)
    throw Error(fmt::format("{}: {} token{}; the loss needs at least two", file, ids.size(), ids.size() == 1 ? "" : "s"));

  // The model on its device, its weights read from the checkpoint tensor by tensor (a GPU's
  // uploaded from one host buffer).
  MemoryPool pool("cpu:0");
  std::unique_ptr<Backend> be;
  const bool device = a.device != "cpu";
  if (a.device == "cuda") {
    std::string why;
    if (!backend_available(Device::cuda, &why)) throw Error(fmt::format("command line: --device cuda: {}", why));
    be = make_backend(Device::cuda);
  } else if (a.device == "emu") {
    be = make_backend(Device::emu);
  } else {
    be = make_backend(Device::cpu, {.pool = &pool});
  }
  model::GPT gpt(cfg, *be);
  if (device) {
    train::CheckpointReader r(ckpt);
    std::vector<float> buf;
    for (model::Parameter* p : gpt.parameters()) {
      buf.resize(size_t(p->spec.numel()));
      model::read_checkpoint_param(r, ckpt, p->spec, buf.data());
      be->upload(p->value.raw(), DType::f32, buf.data(), p->spec.numel());
    }
    gpt.refresh_compute();
  } else {
    model::load_checkpoint_params(ckpt, gpt);
  }
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t n = int64_t(ids.size());
  // The windows: their first token, length (predictions) and how many of their first predictions
  // an earlier window made (not counted again).
  struct Window {
    int64_t start, len, skip;
  };
  std::vector<Window> wins;
  for (int64_t start = 0, done = 0;; start += S) {  // done: the tokens predicted so far (1 .. done)
    const int64_t len = std::min(T, n - 1 - start);
    wins.push_back({start, len, done - start});
    done = start + len;
    if (done >= n - 1) break;
  }
  double sum = 0;
  int64_t counted = 0;
  // Windows of one length together, B at a time (the last, shorter one alone).
  auto run = [&](size_t first, int64_t B) {
    const int64_t L = wins[first].len;
    Tensor x = Tensor::empty({B, L}, DType::i32, MemTag::workspace, pool);
    Tensor y = Tensor::empty({B, L}, DType::i32, MemTag::workspace, pool);
    int64_t here = 0;
    for (int64_t b = 0; b < B; ++b) {
      const Window& w = wins[first + size_t(b)];
      std::copy_n(ids.begin() + w.start, L, x.i32() + b * L);
      std::copy_n(ids.begin() + w.start + 1, L, y.i32() + b * L);
      std::fill_n(y.i32() + b * L, w.skip, -1);  // (predicted by an earlier window)
      here += L - w.skip;
    }
    sum += double(gpt.forward(x, y)) * double(here);
    counted += here;
  };
  for (size_t w = 0; w < wins.size();) {
    size_t e = w + 1;
    while (e < wins.size() && int64_t(e - w) < a.batch && wins[e].len == wins[w].len) ++e;
    run(w, int64_t(e - w));
    w = e;
  }
  const int64_t windows = int64_t(wins.size());
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double loss = sum / double(counted), ppl = std::exp(loss);
  if (a.json) {
    std::printf("{\"checkpoint\": \"%s\", \"file\": \"%s\", \"device\": \"%s\", \"tokens\": %lld, \"predicted\": %lld, "
                "\"windows\": %lld, \"seq\": %lld, \"stride\": %lld, \"loss\": %.6f, \"perplexity\": %.6f, "
                "\"seconds\": %.3f}\n",
                ckpt.c_str(), file.c_str(), a.device.c_str(), (long long)n, (long long)counted, (long long)windows,
                (long long)T, (long long)S, loss, ppl, s);
  } else {
    std::printf("%s on %s: %lld tokens, %lld predicted in %lld windows of up to %lld %s | loss %.4f | perplexity "
                "%.3f | %.0f tokens/s\n",
                ckpt.c_str(), file.c_str(), (long long)n, (long long)counted, (long long)windows, (long long)T,
                S == T ? "(consecutive)" : fmt::format("every {} tokens", S).c_str(), loss, ppl,
                s > 0 ? double(counted) / s : 0.0);
  }
  return 0;
}

Registrar reg{Command{
    "eval", "loss and perplexity of a checkpoint on a text file or a token shard",
    [](CLI::App& sub) -> std::function<int()> {
      auto a = std::make_shared<EvalArgs>();
      sub.add_option("checkpoint", a->ckpt, "checkpoint directory, or a run directory with 'latest'")->required();
      sub.add_option("--text", a->text, "a text file, encoded with the checkpoint's tokenizer as Hugging Face's "
                                        "tokenizer(text) does (special tokens recognised; tokenizer.json's "
                                        "post-processor's around it)");
      sub.add_option("--tokens", a->tokens, "a loom token shard (loom prepare's train_*.bin / val_*.bin)");
      sub.add_option("--tokenizer", a->tokenizer, "directory with the tokenizer (default: the training data's)");
      sub.add_option("--seq", a->seq, "predicted tokens per window (default: the model's block_size)")
          ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
      sub.add_option("--stride", a->stride,
                     "tokens between windows' starts (default --seq: consecutive windows, llm.c's validation loss; "
                     "below it, each token is predicted once, past the first window with at least --seq - --stride "
                     "tokens before it: Hugging Face's perplexity recipe)")
          ->check(CLI::Range(int64_t(1), int64_t(1) << 40));
      sub.add_option("--batch", a->batch, "windows per forward pass")
          ->capture_default_str();
      sub.add_option("--device", a->device,
                     "cpu (f32), cuda (bf16; a build with CUDA) or emu (bf16 on the emulated device, for testing)")
          ->check(CLI::IsMember({"cpu", "cuda", "emu"}));
      sub.add_flag("--json", a->json, "one JSON line instead of the summary");
      return [a]() { return run_eval(*a); };
    }}};

}  // namespace
}  // namespace loom::cli

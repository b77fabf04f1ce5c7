#include "train/config.h"

#include "model/recompute.h"
#include "train/schedule.h"

#include <charconv>
#include <cstring>
#include <string_view>
#include <iterator>
#include <filesystem>
#include <fstream>
#include <cmath>
#include <functional>
#include <sstream>
#include <utility>
#include <thread>
#include <variant>
#include <algorithm>
#include <fmt/ranges.h>
#include <toml++/toml.h>

#include "core/error.h"
#include "core/file.h"
#include "data/unicode.h"
#include "parallel/pipeline/stage_layers.h"

namespace loom::train {

int max_threads() { return 8 * std::max(1, int(std::thread::hardware_concurrency())); }

namespace {

using Value =
    std::variant<int64_t*, uint64_t*, float*, bool*, std::string*, std::vector<int64_t>*, std::optional<bool>*>;

struct Field {
  const char* key;
  const char* help;
  Value (*get)(TrainConfig&);
};

#define F(key, member, help) Field{key, help, [](TrainConfig& c) -> Value { return &c.member; }}
const Field kFields[] = {
    F("model.preset", model_preset, "model preset: gpt2-tiny, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1558m; the Llama family: llama-tiny, llama-10m, smollm-135m, tinyllama-1.1b"),
    F("model.n_layer", n_layer, "transformer blocks (0: the preset's)"),
    F("model.n_head", n_head, "attention heads (0: the preset's)"),
    F("model.n_embd", n_embd, "embedding width (0: the preset's)"),
    F("model.block_size", block_size, "longest sequence, rows of wpe (0: the preset's, at least seq_len)"),
    F("model.vocab_size", vocab_size, "vocabulary size (0: the data's)"),
    F("model.norm", norm, "layernorm (GPT-2) or rmsnorm (Llama) (\"\": the preset's)"),
    F("model.mlp", mlp, "feed-forward: gelu (GPT-2's tanh-GELU MLP) or swiglu (Llama's gated SiLU) (\"\": the preset's)"),
    F("model.position", position, "positions: learned (a wpe table) or rope (rotary embeddings of queries and keys) (\"\": the preset's)"),
    F("model.n_kv_head", n_kv_head, "key/value heads, dividing n_head: grouped-query attention (0: the preset's; the presets' 0 is n_head)"),
    F("model.ffn_hidden", ffn_hidden, "the feed-forward's hidden width (0: the preset's; the GPT-2 presets' is 4 n_embd)"),
    F("model.bias", bias, "biases in the linear layers (unset: the preset's; GPT-2 true, Llama false)"),
    F("model.tied_embeddings", tied_embeddings, "the lm_head shares wte (unset: the preset's)"),
    F("model.norm_eps", norm_eps, "epsilon of the LayerNorms or RMSNorms (0: the preset's, 1e-5)"),
    F("model.rope_theta", rope_theta, "rotary base (0: the preset's, 10000)"),
    F("model.rope_scaling_factor", rope_scaling_factor, "Llama 3 rotary frequency scaling factor (0: none)"),
    F("model.rope_low_freq_factor", rope_low_freq_factor, "Llama 3 rotary scaling's low_freq_factor (0: 1)"),
    F("model.rope_high_freq_factor", rope_high_freq_factor, "Llama 3 rotary scaling's high_freq_factor (0: 4)"),
    F("model.rope_original_max_position", rope_original_max_position, "Llama 3 rotary scaling's original context (0: 8192)"),
    F("model.prune_embedding", prune_embedding, "fine-tuning with untied embeddings: the input embedding keeps only the rows of the tokens in data.dir (and the sample prompt), with the same losses as the whole table; a run starts from a checkpoint (--resume), whose other rows it keeps in train.out_dir/pruned_rows.safetensors for export and generation"),
    F("data.dir", data_dir, "directory of train_*.bin / val_*.bin token shards (loom prepare)"),
    F("data.tokenizer", tokenizer_dir, "directory with the tokenizer (encoder.json + vocab.bpe, or tokenizer.json) for text samples (\"\": data.dir)"),
    F("data.seq_len", seq_len, "tokens per training sequence"),
    F("train.steps", steps, "optimizer steps"),
    F("train.batch_size", batch_size, "sequences per optimizer step (global batch)"),
    F("train.grad_accum", grad_accum, "micro-steps per optimizer step: train.batch_size (the global batch) is split into this many micro-batches of batch_size / (grad_accum x parallel.dp) sequences per rank (the pipeline's micro-batches under parallel.pp)"),
    F("train.seed", seed, "seed of initialisation and data order"),
    F("train.device", device, "cpu, or cuda: GPUs (a build with -DLOOM_CUDA=ON; dp, tp, sp, cp, pp, ZeRO, offload and recomputation: dp alone as one process per GPU rank, the others as threads sharing a GPU or processes), or emu: for testing, an emulated device in host memory that runs every layout's device paths on the CPU's kernels (activations in bf16, or f32, with the parameters' bf16 compute copies; f32 master weights and moments)"),
    F("train.cuda_graph", cuda_graph, "with train.device cuda: run each step as one CUDA graph (false: kernel by kernel, for debugging)"),
    F("train.cuda_attention", cuda_attention, "with train.device cuda: flash (loom's kernels), cudnn (cuDNN's fused attention), gemm (probabilities materialised), or auto (cudnn where loom has cuDNN 9.16 or newer and the head size is 64 or 128, else flash for those head sizes, else gemm)"),
    F("train.precision", precision, "auto (f32 on the CPU, bf16 on CUDA and emu), f32, or bf16: on the CPU the linear layers' products in bf16 with f32 accumulation, weights, activations and gradients in f32 (needs AVX512-BF16 or AMX-BF16); on CUDA bf16 compute with f32 master weights and moments. fp16 (train.device cuda): f16 compute with f32 master weights and moments and dynamic loss scaling (train.loss_scale_*)"),
    F("train.loss_scale_init", loss_scale_init, "train.precision fp16: the first loss scale (the loss gradient is multiplied by it, the parameter gradients divided by it again; a step whose gradients overflow f16 is skipped and the scale halved)"),
    F("train.loss_scale_window", loss_scale_window, "train.precision fp16: clean steps in a row after which the loss scale doubles"),
    F("train.loss_scale_min", loss_scale_min, "train.precision fp16: the smallest loss scale; gradients that overflow f16 below it stop the run"),
    F("train.threads", threads, "CPU threads per process (0: all cores; under mpi, the host's cores shared among its processes)"),
    F("train.log_every", log_every, "steps between metric lines"),
    F("train.eval_every", eval_every, "steps between validation losses (0: never)"),
    F("train.eval_batches", eval_batches, "validation batches of train.batch_size sequences per evaluation: the split's first, the same for any train.grad_accum and layout (fewer where the split is shorter)"),
    F("train.sample_every", sample_every, "steps between text samples (0: at the end only)"),
    F("train.sample_tokens", sample_tokens, "tokens per text sample"),
    F("train.sample_temperature", sample_temperature, "sampling temperature"),
    F("train.sample_top_k", sample_top_k, "sample from the k most likely tokens and those tied with the k-th (0: all; 1: the most likely)"),
    F("train.sample_prompt", sample_prompt, "text the samples continue (\"\": the start of the validation split)"),
    F("train.checkpoint_every", checkpoint_every, "steps between checkpoints (0: at the end only)"),
    F("train.keep_checkpoints", keep_checkpoints, "checkpoints kept (older ones are deleted)"),
    F("train.memory_limit", memory_limit, "bytes loom may allocate per rank (its model pool: parameters, gradients, optimizer state, activations, workspace, communication buffers; 0: no limit); a layout that cannot fit is refused before its first step, naming the tag"),
    F("train.skip_nonfinite", skip_nonfinite, "steps with a non-finite loss or gradient norm skipped (no update) in a row before the run stops (0: stop at the first); no checkpoint is written inside such a streak, and a run that ends in one fails"),
    F("train.time_limit_min", time_limit_min, "minutes after the start after which the run stops between two steps and writes a checkpoint, to go on with --resume (0: none; leave a step's and a checkpoint's time before the allocation ends); SIGINT, SIGTERM and SIGUSR1 stop it the same way at any time"),
    F("train.out_dir", out_dir, "directory for checkpoints, metrics.jsonl, memory.json and loss.png"),
    F("optim.lr", lr, "peak learning rate"),
    F("optim.min_lr", min_lr, "final learning rate of the decay, at most optim.lr (-1: optim.lr / 10)"),
    F("optim.warmup_steps", warmup_steps, "linear warm-up: update u (from 0; a skipped step makes none) at optim.lr (u + 1) / warmup_steps"),
    F("optim.decay_steps", decay_steps, "the update the decay reaches optim.min_lr at, the rate staying there after it (0: train.steps; at most warmup_steps: no decay, optim.lr after the warm-up); give the first run's to train on past it with --resume"),
    F("optim.schedule", lr_schedule, "learning-rate decay after warm-up: cosine, linear or constant"),
    F("optim.weight_decay", weight_decay, "AdamW decoupled weight decay (matrices only)"),
    F("optim.beta1", beta1, "AdamW beta1"),
    F("optim.beta2", beta2, "AdamW beta2"),
    F("optim.eps", eps, "AdamW epsilon"),
    F("optim.grad_clip", grad_clip, "global gradient-norm clip (0: off)"),
    F("optim.name", optimizer, "adamw, or galore: AdamW with the moments of the transformer blocks' matrices in a low-rank subspace of their gradients, refreshed by an SVD (Zhao et al. 2024; needs parallel.tp 1 and parallel.zero 0, CPU only)"),
    F("optim.galore_rank", galore_rank, "optim.name = galore: the rank of the projected gradients (a matrix whose smaller side is not above it keeps full AdamW)"),
    F("optim.galore_update_every", galore_update_every, "optim.name = galore: optimizer steps between projector refreshes"),
    F("optim.galore_scale", galore_scale, "optim.name = galore: the scale of the update projected back (alpha)"),
    F("parallel.dp", dp, "data-parallel ranks"),
    F("parallel.tp", tp, "tensor-parallel ranks"),
    F("parallel.pp", pp, "pipeline stages"),
    F("parallel.cp", cp, "context-parallel ranks"),
    F("parallel.sp", sp, "sequence parallelism within the tensor-parallel group"),
    F("parallel.zero", zero, "ZeRO stage 0-3, over the data-parallel group (dp x cp; 0 where it has one rank)"),
    F("parallel.comm", comm, "communicator backend: threads, mpi (one process per rank: mpirun -n pp x dp x cp x tp), or nccl (train.device cuda: mpi processes whose collectives NCCL runs, each with a GPU of its own)"),
    F("parallel.offload", offload, "ZeRO-Offload: optimizer state, update and f32 master weights in host memory, and under ZeRO 2/3 the reduced gradients (a device computing in bf16 keeps only the weights' bf16 copy)"),
    F("parallel.bucket_mb", bucket_mb, "data-parallel gradient bucket size in MiB"),
    F("parallel.prefetch", prefetch, "ZeRO-3: gather the next block's weights while a block computes (one more buffer of the largest block)"),
    F("parallel.schedule", schedule, "pipeline schedule when parallel.pp > 1: gpipe, 1f1b, interleaved or zb-h1"),
    F("parallel.virtual_stages", virtual_stages, "model chunks per pipeline rank under the interleaved schedule (>= 2)"),
    F("parallel.stage_layers", stage_layers, "transformer blocks of each pipeline stage in order (of each model chunk under interleaved; the first also holds the embedding, the last the head); []: balanced by cost"),
    F("parallel.timeout_s", timeout_s, "communicator timeout in seconds: a rank waiting longer in one collective fails the job"),
    F("memory.recompute", recompute, "activation recomputation: none, full (every block keeps only its input), every-k (segments of memory.recompute_every blocks), sqrt (segments of sqrt(n_layer)), optimal (the least recompute that fits memory.activation_budget) or selective (every block's attention output)"),
    F("memory.recompute_every", recompute_every, "blocks per recomputed segment under memory.recompute = every-k"),
    F("memory.activation_budget", activation_budget, "saved-activation bytes allowed per rank (memory.recompute = optimal plans for it; any plan over it is refused; 0: none)"),
};
#undef F

const Field* find_field(std::string_view key) {
  for (const auto& f : kFields)
    if (key == f.key) return &f;
  return nullptr;
}

std::string type_name(const Value& v) {
  switch (v.index()) {
    case 0: case 1: return "int";
    case 2: return "float";
    case 3: case 6: return "bool";
    case 4: return "string";
    default: return "int list";
  }
}

std::string value_str(const Value& v) {
  return std::visit([](auto* p) -> std::string {
    using T = std::remove_pointer_t<decltype(p)>;
    if constexpr (std::is_same_v<T, std::string>) {
      std::string e = "\"";
      for (char ch : *p) {
        if (ch == '"' || ch == '\\') e += '\\';
        e += ch;
      }
      return e + "\"";
    }
    else if constexpr (std::is_same_v<T, bool>) return *p ? "true" : "false";
    else if constexpr (std::is_same_v<T, std::optional<bool>>) return p->has_value() ? (**p ? "true" : "false") : "";
    else if constexpr (std::is_same_v<T, std::vector<int64_t>>) return fmt::format("[{}]", fmt::join(*p, ", "));
    else return fmt::format("{}", *p);
  }, v);
}

// Integer fields are counts and sizes; products of two or three of them (batch x sequence,
// layers x width, dp x grad_accum) size the run's arrays and loops, so each is bounded where those
// products cannot overflow 64 bits.
constexpr int64_t kIntFieldMax = int64_t(1) << 31;

void check_int_range(int64_t x, const std::string& where) {
  if (x > kIntFieldMax || x < -kIntFieldMax)
    throw Error(fmt::format("{}: {} is out of range (at most 2^31 in magnitude)", where, x));
}

// Sets a field from a TOML node; `where` is "FILE: field" for messages.
void set_from_node(const Value& v, const toml::node& n, const std::string& where) {
  auto bad = [&](std::string_view got) {
    throw Error(fmt::format("{}: expected {}, got {}", where, type_name(v), got));
  };
  auto node_type = [&]() -> std::string {
    switch (n.type()) {
      case toml::node_type::string: return "a string";
      case toml::node_type::integer: return "an integer";
      case toml::node_type::floating_point: return "a float";
      case toml::node_type::boolean: return "a boolean";
      case toml::node_type::table: return "a table";
      case toml::node_type::array: return "an array";
      default: return "a date/time";
    }
  };
  switch (v.index()) {
    case 0: {
      auto x = n.value_exact<int64_t>();
      if (!x) bad(node_type());
      check_int_range(*x, where);
      *std::get<0>(v) = *x;
      break;
    }
    case 1: {
      auto x = n.value_exact<int64_t>();
      if (!x) bad(node_type());
      if (*x < 0) throw Error(fmt::format("{}: must be non-negative, got {}", where, *x));
      *std::get<1>(v) = uint64_t(*x);
      break;
    }
    case 2: {
      if (n.is_integer()) *std::get<2>(v) = float(*n.value<int64_t>());
      else if (n.is_floating_point()) *std::get<2>(v) = float(*n.value<double>());
      else bad(node_type());
      break;
    }
    case 3: {
      auto x = n.value_exact<bool>();
      if (!x) bad(node_type());
      *std::get<3>(v) = *x;
      break;
    }
    case 4: {
      auto x = n.value_exact<std::string>();
      if (!x) bad(node_type());
      *std::get<4>(v) = *x;
      break;
    }
    case 6: {
      auto x = n.value_exact<bool>();
      if (!x) bad(node_type());
      *std::get<6>(v) = *x;
      break;
    }
    default: {
      const toml::array* a = n.as_array();
      if (!a) bad(node_type());
      std::vector<int64_t> list;
      for (const toml::node& e : *a) {
        auto x = e.value_exact<int64_t>();
        if (!x) throw Error(fmt::format("{}: expected int list, entry {} is not an integer", where, list.size()));
        check_int_range(*x, fmt::format("{} entry {}", where, list.size()));
        list.push_back(*x);
      }
      *std::get<5>(v) = std::move(list);
    }
  }
}

// Command-line values are parsed as TOML values, with bare words taken as strings.
void set_from_text(const Value& v, const std::string& text, const std::string& where) {
  if (v.index() == 4) {
    std::string s = text;
    if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
    *std::get<4>(v) = s;
    return;
  }
  toml::table t;
  // An int list also reads without brackets: --parallel.stage_layers 3,5,4
  const size_t first = text.find_first_not_of(" \t");
  const bool list = v.index() == 5 && (first == std::string::npos || text[first] != '[');
  try {
    t = toml::parse("x = " + (list ? "[" + text + "]" : text));
  } catch (const toml::parse_error&) {
    throw Error(fmt::format("{}: cannot parse '{}' as {}", where, text, type_name(v)));
  }
  set_from_node(v, *t.get("x"), where);
}

// A key as an error shows it: at most 80 characters (a megabyte-long key was echoed whole).
std::string shown(const std::string& key) {
  return key.size() <= 80 ? key : key.substr(0, 80) + fmt::format("... ({} characters)", key.size());
}

void walk(const toml::table& t, const std::string& prefix, TrainConfig& c, const std::string& file) {
  for (const auto& [k, node] : t) {
    std::string key = prefix.empty() ? std::string(k.str()) : prefix + "." + std::string(k.str());
    if (node.is_table()) {
      if (const Field* f = find_field(key)) set_from_node(f->get(c), node, fmt::format("{}: {}", file, key));  // throws
      const bool section = std::any_of(std::begin(kFields), std::end(kFields), [&](const Field& f) {
        return std::string_view(f.key).starts_with(key + ".");
      });
      if (!section)
        throw Error(fmt::format("{}:{}: unknown section [{}] (see `loom train --help-config`)", file,
                                k.source().begin.line, shown(key)));
      walk(*node.as_table(), key, c, file);
      continue;
    }
    const Field* f = find_field(key);
    if (!f) {
      auto line = k.source().begin.line;
      throw Error(fmt::format("{}:{}: unknown key '{}' (see `loom train --help-config`)", file, line, shown(key)));
    }
    set_from_node(f->get(c), node, fmt::format("{}: {}", file, key));
  }
}

}  // namespace

std::vector<FieldInfo> config_fields() {
  TrainConfig defaults;
  std::vector<FieldInfo> out;
  for (const auto& f : kFields) {
    Value v = f.get(defaults);
    const std::string value = value_str(v);
    out.push_back({f.key, type_name(v), f.help, value.empty() && v.index() == 6 ? "(unset)" : value});
  }
  return out;
}

model::GPTConfig TrainConfig::model(int64_t data_vocab) const {
  model::GPTConfig m = model::gpt_preset(model_preset);
  if (n_layer) m.n_layer = n_layer;
  if (n_head) m.n_head = n_head;
  if (n_embd) m.n_embd = n_embd;
  if (block_size) m.block_size = block_size;
  else m.block_size = std::max(m.block_size, seq_len);
  if (vocab_size) m.vocab_size = vocab_size;
  else if (data_vocab > 0) m.vocab_size = data_vocab;
  // Names were checked by validate; an unchecked config gets the same error here.
  if (!norm.empty()) m.norm = model::norm_from_name(norm, "model.norm");
  if (!mlp.empty()) m.mlp = model::mlp_from_name(mlp, "model.mlp");
  if (!position.empty()) m.position = model::position_from_name(position, "model.position");
  if (n_kv_head) m.n_kv_head = n_kv_head;
  if (ffn_hidden) m.ffn_hidden = ffn_hidden;
  if (bias) m.bias = *bias;
  if (tied_embeddings) m.tied_embeddings = *tied_embeddings;
  if (norm_eps > 0) m.ln_eps = norm_eps;
  if (rope_theta > 0) m.rope_theta = rope_theta;
  if (rope_scaling_factor > 0) m.rope_scaling_factor = rope_scaling_factor;
  if (rope_low_freq_factor > 0) m.rope_low_freq_factor = rope_low_freq_factor;
  if (rope_high_freq_factor > 0) m.rope_high_freq_factor = rope_high_freq_factor;
  if (rope_original_max_position > 0) m.rope_original_max_position = rope_original_max_position;
  if (n_layer || n_head || n_embd || vocab_size || !norm.empty() || !mlp.empty() || !position.empty() || n_kv_head ||
      ffn_hidden || bias || tied_embeddings)
    m.name = "custom";
  return m;
}

void TrainConfig::validate(const std::string& where, const std::vector<std::string>& command_line) const {
  auto need = [&](bool ok, const char* field, const std::string& msg) {
    if (ok) return;
    if (std::find(command_line.begin(), command_line.end(), field) != command_line.end())
      throw Error(fmt::format("command line: --{}: {}", field, msg));
    throw Error(fmt::format("{}: {}: {}", where, field, msg));
  };
  // Strings go into the checkpoint's manifest (JSON, UTF-8 only) and the metrics: a byte that is
  // not UTF-8 would fail the first checkpoint after the run had trained up to it.
  auto utf8 = [](const std::string& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    const auto* end = p + v.size();
    while (p < end) {
      uint32_t cp = 0;
      p += data::decode_utf8(p, end, &cp);
      if (cp >= data::kInvalidByteBase) return false;
    }
    return true;
  };
  for (const auto& [field, value] :
       {std::pair<const char*, const std::string*>{"model.preset", &model_preset}, {"data.dir", &data_dir},
        {"data.tokenizer", &tokenizer_dir}, {"train.device", &device}, {"train.cuda_attention", &cuda_attention},
        {"train.precision", &precision}, {"train.sample_prompt", &sample_prompt}, {"train.out_dir", &out_dir}, {"optim.schedule", &lr_schedule},
        {"parallel.comm", &comm}, {"parallel.schedule", &schedule}})
    need(utf8(*value), field, "is not valid UTF-8");
  need(seq_len > 0, "data.seq_len", fmt::format("must be positive, got {}", seq_len));
  need(steps >= 0, "train.steps", fmt::format("must be non-negative, got {}", steps));
  need(batch_size > 0, "train.batch_size", fmt::format("must be positive, got {}", batch_size));
  need(grad_accum > 0, "train.grad_accum", fmt::format("must be positive, got {}", grad_accum));
  need(batch_size % grad_accum == 0, "train.grad_accum",
       fmt::format("batch_size {} is not divisible by grad_accum {}", batch_size, grad_accum));
  need(threads >= 0, "train.threads", "must be non-negative");
  need(threads <= max_threads(), "train.threads",
       fmt::format("{} is more than 8 per core of this host ({} cores; 0 takes them all)", threads, max_threads() / 8));
  need(log_every > 0, "train.log_every", "must be positive");
  need(eval_every >= 0, "train.eval_every", fmt::format("must be non-negative (0: no validation), got {}", eval_every));
  need(eval_batches > 0, "train.eval_batches", fmt::format("must be positive, got {}", eval_batches));
  need(sample_every >= 0, "train.sample_every", fmt::format("must be non-negative, got {}", sample_every));
  need(!out_dir.empty(), "train.out_dir", "must name a directory");
  need(sample_tokens >= 0, "train.sample_tokens", fmt::format("must be non-negative, got {}", sample_tokens));
  need(sample_top_k >= 0, "train.sample_top_k", fmt::format("must be non-negative (0: all), got {}", sample_top_k));
  need(sample_temperature > 0 && std::isfinite(sample_temperature), "train.sample_temperature",
       fmt::format("must be positive and finite, got {}", sample_temperature));
  need(checkpoint_every >= 0, "train.checkpoint_every", "must be non-negative");
  need(keep_checkpoints >= 1, "train.keep_checkpoints", "must be at least 1");
  need(skip_nonfinite >= 0, "train.skip_nonfinite", fmt::format("must be non-negative, got {}", skip_nonfinite));
  need(time_limit_min >= 0 && std::isfinite(time_limit_min), "train.time_limit_min",
       fmt::format("must be non-negative and finite (0: none), got {}", time_limit_min));
  need(model::recompute_parse(recompute).has_value(), "memory.recompute",
       fmt::format("must be none, full, every-k, sqrt, optimal or selective, got '{}'", recompute));
  need(recompute_every >= 1, "memory.recompute_every", fmt::format("must be at least 1, got {}", recompute_every));
  // (Byte sizes are unsigned fields: 0 to 2^63, unlike the counts' 2^31.)
  need(memory_limit <= (uint64_t(1) << 50), "train.memory_limit",
       fmt::format("must be at most 2^50 bytes (1 PiB), got {}", memory_limit));
  need(activation_budget <= (uint64_t(1) << 50), "memory.activation_budget",
       fmt::format("must be at most 2^50 bytes (1 PiB), got {}", activation_budget));
  need(recompute != "optimal" || activation_budget > 0, "memory.activation_budget",
       "memory.recompute = optimal plans for a budget: set memory.activation_budget (bytes per rank)");
  for (const auto& [field, value] :
       {std::pair<const char*, float>{"optim.lr", lr}, {"optim.min_lr", min_lr}, {"optim.beta1", beta1},
        {"optim.beta2", beta2}, {"optim.eps", eps}, {"optim.weight_decay", weight_decay},
        {"optim.grad_clip", grad_clip}, {"optim.galore_scale", galore_scale},
        {"train.sample_temperature", sample_temperature},
        {"parallel.timeout_s", timeout_s}, {"parallel.bucket_mb", bucket_mb}})
    need(std::isfinite(value), field, fmt::format("must be a finite number, got {}", value));
  need(lr >= 0, "optim.lr", fmt::format("must be non-negative, got {}", lr));
  need(min_lr >= 0 || min_lr == -1, "optim.min_lr",
       fmt::format("must be non-negative, or -1 for optim.lr / 10, got {}", min_lr));
  need(lr_schedule == "constant" || min_lr <= lr, "optim.min_lr",
       fmt::format("{} is above optim.lr {}: the decay would raise the learning rate (-1 gives optim.lr / 10)", min_lr,
                   lr));
  need(warmup_steps >= 0, "optim.warmup_steps", "must be non-negative");
  need(decay_steps >= 0, "optim.decay_steps", fmt::format("must be non-negative (0: train.steps), got {}", decay_steps));
  need(lr_schedule == "cosine" || lr_schedule == "linear" || lr_schedule == "constant", "optim.schedule",
       fmt::format("'{}' is not one of cosine, linear, constant", lr_schedule));
  need(beta1 >= 0 && beta1 < 1, "optim.beta1", fmt::format("must lie in [0, 1), got {}", beta1));
  need(beta2 >= 0 && beta2 < 1, "optim.beta2", fmt::format("must lie in [0, 1), got {}", beta2));
  need(eps > 0, "optim.eps", "must be positive");
  need(weight_decay >= 0, "optim.weight_decay", "must be non-negative");
  need(grad_clip >= 0, "optim.grad_clip", "must be non-negative");
  need(optimizer == "adamw" || optimizer == "galore", "optim.name",
       fmt::format("'{}' is not adamw or galore", optimizer));
  need(galore_rank >= 1, "optim.galore_rank", fmt::format("must be at least 1, got {}", galore_rank));
  need(galore_update_every >= 1, "optim.galore_update_every",
       fmt::format("must be at least 1, got {}", galore_update_every));
  need(galore_scale > 0, "optim.galore_scale", fmt::format("must be positive, got {}", galore_scale));
  if (prune_embedding) {
    // Exact only where the output layer is not the same table: a tied lm_head reads every row.
    need(!model(0).tied_embeddings, "model.tied_embeddings",
         "model.prune_embedding needs untied embeddings: a tied lm_head scores every token with wte's rows, so "
         "pruning them would change the loss");
    need(tp == 1, "parallel.tp", fmt::format("model.prune_embedding runs without tensor parallelism (got {})", tp));
    need(device == "cpu", "model.prune_embedding", "runs on the CPU only");
  }
  if (optimizer == "galore") {
    // GaLore projects whole matrices: every rank that updates one must hold all of it.
    need(tp == 1, "parallel.tp",
         fmt::format("optim.name = galore needs whole matrices on each rank: tensor parallelism splits them (got {})",
                     tp));
    need(zero == 0, "parallel.zero",
         fmt::format("optim.name = galore needs whole matrices on each rank: ZeRO {} shards the optimizer over a "
                     "flat buffer that cuts them; use 0",
                     zero));
    need(device == "cpu", "optim.name", "galore runs on the CPU only (its SVD is LAPACK's); use adamw on cuda and emu");
    // Every block matrix's smaller side is n_embd: a rank not below it projects nothing.
    const int64_t C = model(0).n_embd;
    need(galore_rank < C, "optim.galore_rank",
         fmt::format("{} is not below the smaller side of the blocks' matrices (model.n_embd {}): GaLore would keep "
                     "every matrix in plain AdamW",
                     galore_rank, C));
  }
  need(dp >= 1 && tp >= 1 && pp >= 1 && cp >= 1, "parallel", "dp, tp, pp, cp must be at least 1");
  need(zero >= 0 && zero <= 3, "parallel.zero", fmt::format("must be 0, 1, 2 or 3, got {}", zero));
  need(bucket_mb > 0, "parallel.bucket_mb", fmt::format("must be positive, got {}", bucket_mb));
  need(timeout_s >= 0.001f && timeout_s <= 1e7f, "parallel.timeout_s",
       fmt::format("must be between 0.001 and 1e7 seconds, got {}", timeout_s));
  need(batch_size % (dp * grad_accum) == 0, "train.batch_size",
       fmt::format("batch_size {} is not divisible by parallel.dp {} x train.grad_accum {}", batch_size, dp,
                   grad_accum));
  need(schedule == "gpipe" || schedule == "1f1b" || schedule == "interleaved" || schedule == "zb-h1",
       "parallel.schedule", fmt::format("'{}' is not one of gpipe, 1f1b, interleaved, zb-h1", schedule));
  need(virtual_stages >= 2, "parallel.virtual_stages", fmt::format("must be at least 2, got {}", virtual_stages));
  need(comm == "threads" || comm == "mpi" || comm == "nccl", "parallel.comm",
       fmt::format("'{}' is not threads, mpi or nccl", comm));
  try {
    (void)model::gpt_preset(model_preset);
  } catch (const Error& e) {
    throw Error(fmt::format("{}: model.preset: {}", origin({"model.preset"}, where), e.what()));
  }
  need(norm.empty() || norm == "layernorm" || norm == "rmsnorm", "model.norm",
       fmt::format("'{}' is not layernorm or rmsnorm", norm));
  need(mlp.empty() || mlp == "gelu" || mlp == "swiglu", "model.mlp", fmt::format("'{}' is not gelu or swiglu", mlp));
  need(position.empty() || position == "learned" || position == "rope", "model.position",
       fmt::format("'{}' is not learned or rope", position));
  need(n_kv_head >= 0, "model.n_kv_head", fmt::format("must be non-negative, got {}", n_kv_head));
  need(ffn_hidden >= 0, "model.ffn_hidden", fmt::format("must be non-negative, got {}", ffn_hidden));
  for (const auto& [field, v] : {std::pair<const char*, float>{"model.norm_eps", norm_eps},
                                 {"model.rope_theta", rope_theta},
                                 {"model.rope_scaling_factor", rope_scaling_factor},
                                 {"model.rope_low_freq_factor", rope_low_freq_factor},
                                 {"model.rope_high_freq_factor", rope_high_freq_factor}})
    need(v >= 0 && std::isfinite(v), field, fmt::format("must be non-negative (0: the preset's), got {}", v));
  need(rope_original_max_position >= 0, "model.rope_original_max_position",
       fmt::format("must be non-negative, got {}", rope_original_max_position));
  if (pp > 1) {
    // The chain is the embedding, the blocks and the head: each (virtual) stage needs one element.
    const int64_t chunks = schedule == "interleaved" ? virtual_stages : 1, elements = model(0).n_layer + 2;
    need(pp * chunks <= elements, "parallel.pp",
         fmt::format("{} pipeline stages{} but the model's chain has only {} elements (model.n_layer + 2)", pp * chunks,
                     chunks > 1 ? fmt::format(" (x parallel.virtual_stages {})", chunks) : "", elements));
    need(schedule != "interleaved" || grad_accum % pp == 0, "train.grad_accum",
         fmt::format("the interleaved schedule needs micro-batches (train.grad_accum {}) divisible by parallel.pp {}",
                     grad_accum, pp));
  }
  if (!stage_layers.empty()) {
    need(pp > 1, "parallel.stage_layers", "needs pipeline stages (parallel.pp > 1)");
    const int64_t chunks = schedule == "interleaved" ? virtual_stages : 1;
    need(int64_t(stage_layers.size()) == pp * chunks, "parallel.stage_layers",
         fmt::format("has {} entries for {} pipeline stages{}", stage_layers.size(), pp * chunks,
                     chunks > 1 ? fmt::format(" (parallel.pp {} x parallel.virtual_stages {})", pp, chunks) : ""));
    try {
      (void)parallel::pipeline::cuts_from_stage_layers(stage_layers, model(0).n_layer, "parallel.stage_layers");
    } catch (const Error& e) {
      throw Error(fmt::format("{}: {}", origin({"parallel.stage_layers", "model.n_layer"}, where), e.what()));
    }
  }
  need(device == "cpu" || device == "cuda" || device == "emu", "train.device",
       fmt::format("'{}' is not cpu, cuda or emu", device));
  need(cuda_attention == "auto" || cuda_attention == "flash" || cuda_attention == "cudnn" || cuda_attention == "gemm",
       "train.cuda_attention", fmt::format("'{}' is not auto, flash, cudnn or gemm", cuda_attention));
  need(precision == "auto" || precision == "f32" || precision == "bf16" || precision == "fp16", "train.precision",
       fmt::format("'{}' is not auto, f32, bf16 or fp16", precision));
  need(!(precision == "fp16" && device != "cuda"), "train.precision",
       "fp16 (f16 compute with loss scaling) runs on CUDA (train.device = \"cuda\"); on the CPU use f32, or bf16 "
       "where the CPU has AVX512-BF16 or AMX-BF16");
  need(std::isfinite(loss_scale_init) && loss_scale_init > 0, "train.loss_scale_init",
       fmt::format("must be positive, got {}", loss_scale_init));
  need(loss_scale_window >= 1, "train.loss_scale_window", fmt::format("must be at least 1, got {}", loss_scale_window));
  need(std::isfinite(loss_scale_min) && loss_scale_min > 0 && loss_scale_min <= loss_scale_init,
       "train.loss_scale_min",
       fmt::format("must be positive and at most train.loss_scale_init {}, got {}", loss_scale_init, loss_scale_min));
  if (device == "cpu" && precision == "bf16") {
    const std::string missing = cpu_bf16_missing();
    need(missing.empty(), "train.precision",
         fmt::format("bf16 on the CPU needs {}; use f32 (or auto) on this CPU", missing));
  }
  need(!(device == "cuda" && precision == "f32"), "train.precision",
       "f32 with train.device = \"cuda\": the CUDA engine computes in bf16 (or f16 with loss scaling: fp16), with f32 "
       "master weights and moments; use bf16, fp16 or auto");
  need(comm != "nccl" || device == "cuda", "parallel.comm",
       fmt::format("nccl reduces GPU buffers: it needs train.device = \"cuda\" (got \"{}\"); on the CPU use mpi",
                   device));
  if (device == "cuda") validate_cuda(where);
}

void TrainConfig::validate_cuda_vocabulary(const model::GPTConfig& m, const std::string& where) const {
  // Under tp the lm_head's output columns are the rank's vocabulary shard, a GEMM width too.
  if (tp > 1 && m.vocab_size > 0 && m.vocab_shard_rows(int(tp)) % 8 != 0)
    throw Error(fmt::format("{}: parallel.tp: {} splits the padded vocabulary of {} rows into shards of {}, and the "
                            "GPU's GEMMs take widths that are multiples of 8 with train.device = \"cuda\": use a tp "
                            "that leaves shards of a multiple of 8 rows (a power of two up to {})",
                            where, tp, m.padded_vocab(), m.vocab_shard_rows(int(tp)),
                            std::min<int64_t>(16, m.padded_vocab() / 8)));
}

void TrainConfig::validate_cuda(const std::string& where) const {
  auto refuse = [&](const char* field, const std::string& msg) {
    throw Error(fmt::format("{}: {}: {}", where, field, msg));
  };
  const char* gpu = "with train.device = \"cuda\"";
  // The GPU runs whole replicas over dp (its replica engine, one CUDA graph per step), and tensor,
  // sequence, context and pipeline parallelism, ZeRO 1-3, offload and activation recomputation
  // composed with dp on the mesh engine (train/engine.h).
  if (cuda_mesh() && run_precision() == "fp16")
    refuse("train.precision",
           fmt::format("fp16 {} runs whole replicas over dp (its loss scaling is the replica engine's); with "
                       "tensor, sequence, context or pipeline parallelism, ZeRO, offload or recomputation use bf16",
                       gpu));
  // Whole replicas as threads of one process would share its CUDA state (the device pool, the
  // captured graphs' memory): the replica engine's ranks are processes. The mesh engine's ranks may
  // be threads sharing the GPU (each with a backend of its own; their collectives staged through
  // host memory).
  if (dp > 1 && comm == "threads" && !cuda_mesh())
    refuse("parallel.comm",
           fmt::format("must be mpi or nccl {} and parallel.dp = {} (one process per GPU rank: mpirun -n {} loom train "
                       "... --parallel.comm nccl); threads runs one GPU rank",
                       gpu, dp, dp));
  // The CUDA backend's kernels: widths that are multiples of 8 (vectors of 8 bf16). Flash
  // attention takes head sizes 64 and 128; other head sizes use the GEMM attention. (Its tied
  // embeddings are what every training config builds.)
  const model::GPTConfig m = model(0);
  // (n_head not dividing n_embd is the model validation's to name.)
  const bool shaped = m.n_head > 0 && m.n_embd > 0 && m.n_embd % m.n_head == 0;
  if (shaped && m.n_embd % 8 != 0)
    refuse("model.n_embd", fmt::format("must be a multiple of 8 {}, got {}", gpu, m.n_embd));
  if (shaped && m.head_size() % 8 != 0)
    refuse("model.n_head", fmt::format("the head size n_embd / n_head = {} / {} = {} must be a multiple of 8 {}",
                                       m.n_embd, m.n_head, m.head_size(), gpu));
  // The feed-forward's hidden width, the rank's share of it under tp: a GEMM width.
  if (shaped && m.ffn() > 0 && m.ffn() % tp == 0 && (m.ffn() / tp) % 8 != 0)
    refuse(tp > 1 ? "parallel.tp" : "model.ffn_hidden",
           tp > 1 ? fmt::format("{} splits the feed-forward's hidden width {} into {} per rank, and the GPU's GEMMs "
                                "take widths that are multiples of 8 {}",
                                tp, m.ffn(), m.ffn() / tp, gpu)
                  : fmt::format("must be a multiple of 8 {}, got {}", gpu, m.ffn()));
  // The vocabulary is the data's unless the config sets it: checked again once the data is open.
  if (shaped && vocab_size > 0) validate_cuda_vocabulary(m, where);
  // Ring attention (cp) and selective recomputation call the kernels that keep no probabilities:
  // flash or cuDNN, which take head sizes 64 and 128.
  const bool flash_sizes = m.head_size() == 64 || m.head_size() == 128;
  const bool keeps_probs = cuda_attention == "gemm" || !flash_sizes;
  if (shaped && cp > 1 && keeps_probs)
    refuse("parallel.cp",
           fmt::format("{} {} needs flash or cuDNN attention (head sizes 64 and 128) for ring attention, and the "
                       "run has train.cuda_attention = {} with n_embd / n_head = {} / {} = {}",
                       cp, gpu, cuda_attention, m.n_embd, m.n_head, m.head_size()));
  if (shaped && recompute == "selective" && keeps_probs)
    refuse("memory.recompute",
           fmt::format("selective {} needs flash or cuDNN attention (head sizes 64 and 128: the GEMM kernels keep the "
                       "probabilities it drops), and the run has train.cuda_attention = {} with n_embd / n_head = "
                       "{} / {} = {}",
                       gpu, cuda_attention, m.n_embd, m.n_head, m.head_size()));
  if (shaped && (cuda_attention == "flash" || cuda_attention == "cudnn") && !flash_sizes)
    refuse("train.cuda_attention",
           fmt::format("{} takes head sizes 64 and 128, and n_embd / n_head = {} / {} = {} (use gemm or auto)",
                       cuda_attention, m.n_embd, m.n_head, m.head_size()));
  // Last: a config the GPU trainer would refuse anyway is told why first, in any build.
#ifndef LOOM_HAVE_CUDA
  refuse("train.device", "\"cuda\" needs loom built with CUDA: reconfigure with `cmake -DLOOM_CUDA=ON` (the CUDA "
                         "toolkit's nvcc on PATH) and rebuild");
#endif
}

namespace {

// Refuses, by line and column, what no TOML text holds and toml++ 3 mishandles before its own
// error (both found by fuzz_config): control characters (a NUL in a table header trips an
// assertion), and non-ASCII characters outside strings and comments (TOML's keys are ASCII; where
// toml++ asks whether such a character is whitespace, code points like U+FE7F reach an
// "unreachable" branch, undefined behaviour in a release build).
void check_toml_text(const std::string& text, const std::string& path) {
  enum { normal, comment, basic, literal, ml_basic, ml_literal } state = normal;
  int64_t line = 1, column = 0;
  auto fail = [&](const std::string& what) {
    throw Error(fmt::format("{}:{}:{}: {} (not a TOML text file)", path, line, column, what));
  };
  auto starts = [&](size_t i, const char* s) { return text.compare(i, std::strlen(s), s) == 0; };
  // (A UTF-8 byte order mark, as some editors write one, is not part of the text.)
  const size_t start = text.starts_with("\xEF\xBB\xBF") ? 3 : 0;
  for (size_t i = start; i < text.size(); ++i) {
    const unsigned char ch = static_cast<unsigned char>(text[i]);
    ++column;
    if (ch == '\n') {
      if (state == basic || state == literal) fail("a newline inside a one-line string");
      if (state == comment) state = normal;
      ++line;
      column = 0;
      continue;
    }
    if ((ch < 0x20 && ch != '\t' && ch != '\r') || ch == 0x7f) fail(fmt::format("control character 0x{:02x}", int(ch)));
    switch (state) {
      case normal:
        if (ch >= 0x80) fail("a non-ASCII character outside a string or comment");
        if (ch == '#') state = comment;
        if (ch == '"') {
          if (starts(i, "\"\"\"")) state = ml_basic, i += 2, column += 2;
          else state = basic;
        }
        if (ch == '\'') {
          if (starts(i, "'''")) state = ml_literal, i += 2, column += 2;
          else state = literal;
        }
        break;
      case comment: break;
      case basic:
        if (ch == '\\' && i + 1 < text.size() && text[i + 1] != '\n') ++i, ++column;  // an escape's character
        else if (ch == '"') state = normal;
        break;
      case literal:
        if (ch == '\'') state = normal;
        break;
      case ml_basic:
        if (ch == '\\' && i + 1 < text.size() && text[i + 1] != '\n') {
          ++i, ++column;
        } else if (starts(i, "\"\"\"")) {
          state = normal, i += 2, column += 2;
          // Up to two more quotes belong to the string ("""a"""" holds a").
          for (int more = 0; more < 2 && i + 1 < text.size() && text[i + 1] == '"'; ++more) ++i, ++column;
        }
        break;
      case ml_literal:
        if (starts(i, "'''")) {
          state = normal, i += 2, column += 2;
          for (int more = 0; more < 2 && i + 1 < text.size() && text[i + 1] == '\''; ++more) ++i, ++column;
        }
        break;
    }
  }
}

}  // namespace

TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides) {
  TrainConfig c;
  if (!path.empty()) {
    toml::table t;
    std::string text = read_file(path);
    check_toml_text(text, path);
    if (text.starts_with("\xEF\xBB\xBF")) text.erase(0, 3);
    try {
      t = toml::parse(text, path);
    } catch (const toml::parse_error& e) {
      const auto& b = e.source().begin;
      throw Error(fmt::format("{}:{}:{}: malformed TOML: {}", path, b.line, b.column, e.description()));
    }
    walk(t, "", c, path);
  }
  std::vector<std::string> from_command_line;
  for (const auto& o : overrides) {
    auto eq = o.find('=');
    LOOM_CHECK(eq != std::string::npos, "command line: override '{}' is not key=value", o);
    std::string key = o.substr(0, eq), val = o.substr(eq + 1);
    const Field* f = find_field(key);
    if (!f) throw Error(fmt::format("command line: unknown key '--{}' (see `loom train --help-config`)", shown(key)));
    set_from_text(f->get(c), val, fmt::format("command line: --{}", key));
    from_command_line.push_back(key);
  }
  c.from_command_line = from_command_line;
  c.validate(path.empty() ? "command line" : path, from_command_line);
  return c;
}

std::string TrainConfig::origin(const std::vector<std::string>& fields, const std::string& where) const {
  std::string flags;
  for (const std::string& f : fields)
    if (std::find(from_command_line.begin(), from_command_line.end(), f) != from_command_line.end())
      flags += (flags.empty() ? "--" : ", --") + f;
  if (flags.empty()) return where.empty() ? "config" : where;
  // A file's values with flags over them: both (the flags may not be what is wrong).
  if (where.empty() || where == "config" || where == "command line" || where == "model config")
    return "command line (" + flags + ")";
  return where + " with " + flags;
}

std::vector<std::string> collect_overrides(const std::vector<std::string>& args) {
  std::vector<std::string> out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0) throw Error(fmt::format("command line: unexpected argument '{}'", a));
    std::string body = a.substr(2);
    if (body.find('=') != std::string::npos) {
      out.push_back(body);
    } else {
      if (i + 1 >= args.size()) throw Error(fmt::format("command line: --{} needs a value", body));
      out.push_back(body + "=" + args[++i]);
    }
  }
  return out;
}

std::vector<std::pair<std::string, std::string>> config_values(const TrainConfig& cfg) {
  TrainConfig c = cfg;
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& f : kFields) out.emplace_back(f.key, value_str(f.get(c)));
  return out;
}

int64_t checkpoint_batch_size(const std::string& then_toml, const std::string& where) {
  TrainConfig then;  // the default where an older config lacks the field
  toml::table t;
  try {
    t = toml::parse(then_toml, where);
  } catch (const toml::parse_error& e) {
    throw Error(fmt::format("{}: its config_toml is not TOML: {}", where, e.description()));
  }
  if (const toml::node* n = t.at_path("train.batch_size").node())
    set_from_node(find_field("train.batch_size")->get(then), *n, where + ": train.batch_size");
  return then.batch_size;
}

std::vector<std::string> changed_on_resume(const TrainConfig& now, const std::string& then_toml,
                                           const std::string& where, int64_t from_update, int64_t from_step) {
  TrainConfig then;  // defaults where an older config lacks a field
  toml::table t;
  try {
    t = toml::parse(then_toml, where);
  } catch (const toml::parse_error& e) {
    throw Error(fmt::format("{}: its config_toml is not TOML: {}", where, e.description()));
  }
  static const char* kCompared[] = {"optim.lr",     "optim.min_lr",    "optim.warmup_steps", "optim.decay_steps",
                                    "optim.schedule", "train.steps",   "optim.weight_decay", "optim.beta1",
                                    "optim.beta2",  "optim.eps",       "optim.grad_clip",    "train.batch_size",
                                    "data.seq_len", "optim.name",      "optim.galore_update_every",
                                    "optim.galore_scale"};
  for (const char* key : kCompared)
    if (const toml::node* n = t.at_path(key).node()) set_from_node(find_field(key)->get(then), *n, where + ": " + key);
  std::vector<std::string> out;
  auto cmp = [&](const char* what, const auto& a, const auto& b) {
    if (a != b) out.push_back(fmt::format("{} {} (the checkpoint's {})", what, a, b));
  };
  // The learning rate of every update still to make, under each run's schedule (within a float's
  // rounding: an older config's optim.min_lr = 6e-05 is the default -1's optim.lr / 10 of 6e-4
  // but for its last bit). A schedule that differs only where no update falls (a decay after a
  // warm-up longer than both runs) is the same schedule.
  auto close = [](double x, double y) { return std::abs(x - y) <= 1e-6 * std::max(std::abs(x), std::abs(y)); };
  const LrSchedule a{now.lr, now.final_lr(), now.warmup_steps, now.decay_end(), now.lr_schedule},
      b{then.lr, then.final_lr(), then.warmup_steps, then.decay_end(), then.lr_schedule};
  for (int64_t u = from_update; u < from_update + (now.steps - from_step); ++u) {
    const double x = a.at(u), y = b.at(u);
    if (close(x, y)) continue;
    std::vector<std::string> fields;
    if (now.lr != then.lr) fields.push_back(fmt::format("optim.lr {} (the checkpoint's {})", now.lr, then.lr));
    if (now.lr_schedule != then.lr_schedule)
      fields.push_back(fmt::format("optim.schedule {} (the checkpoint's {})", now.lr_schedule, then.lr_schedule));
    if (now.warmup_steps != then.warmup_steps)
      fields.push_back(
          fmt::format("optim.warmup_steps {} (the checkpoint's {})", now.warmup_steps, then.warmup_steps));
    if (!close(now.final_lr(), then.final_lr()))
      fields.push_back(fmt::format("a final rate (optim.min_lr) of {:.6g} (the checkpoint's {:.6g})", now.final_lr(),
                                   then.final_lr()));
    if (now.decay_end() != then.decay_end())
      fields.push_back(fmt::format("a decay ending at step {} (optim.decay_steps, else train.steps; the "
                                   "checkpoint's {})",
                                   now.decay_end(), then.decay_end()));
    out.push_back(fmt::format("the learning-rate schedule: update {} at {:.6g} (the checkpoint's schedule: {:.6g}), "
                              "from {}",
                              u + 1, x, y, fmt::join(fields, ", ")));
    break;
  }
  cmp("optim.weight_decay", now.weight_decay, then.weight_decay);
  cmp("optim.beta1", now.beta1, then.beta1);
  cmp("optim.beta2", now.beta2, then.beta2);
  cmp("optim.eps", now.eps, then.eps);
  cmp("optim.grad_clip", now.grad_clip, then.grad_clip);
  cmp("train.batch_size", now.batch_size, then.batch_size);
  // GaLore's refresh interval and scale (its rank and the optimizer itself are in the state's
  // shapes, which the resume checks on its own).
  if (now.optimizer == "galore" && then.optimizer == "galore") {
    cmp("optim.galore_update_every", now.galore_update_every, then.galore_update_every);
    cmp("optim.galore_scale", now.galore_scale, then.galore_scale);
  }
  cmp("data.seq_len", now.seq_len, then.seq_len);
  return out;
}

std::string config_to_toml(const TrainConfig& cfg) {
  std::string out, section;
  for (const auto& [key, value] : config_values(cfg)) {
    auto dot = key.find('.');
    std::string sec = key.substr(0, dot), name = key.substr(dot + 1);
    if (sec != section) {
      out += fmt::format("{}[{}]\n", out.empty() ? "" : "\n", sec);
      section = sec;
    }
    if (value.empty()) continue;  // an unset optional field
    out += fmt::format("{} = {}\n", name, value);
  }
  return out;
}

}  // namespace loom::train

// The training configuration: a TOML file whose every field can be overridden on the command
// line (`--optim.lr 1e-3` or `--optim.lr=1e-3`). Unknown keys, wrong types and out-of-range values
// are errors that name the file (or "command line") and the field.
#pragma once
#include "core/dtype.h"
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "model/config.h"

namespace loom::train {

// The most OpenMP threads a run may take: 8 per core of this host (teams far beyond the cores only
// thrash, and libgomp crashes starting hundreds of thousands of threads). train.threads,
// OMP_NUM_THREADS and bench --threads are held to it.
int max_threads();

struct TrainConfig {
  // [model]
  std::string model_preset = "gpt2-tiny";  // a preset name; the fields below override it when set
  int64_t n_layer = 0, n_head = 0, n_embd = 0, block_size = 0;  // 0: the preset's value
  int64_t vocab_size = 0;                  // 0: the data's vocabulary size
  // Architecture options (model/config.h); "", 0 or unset: the preset's.
  std::string norm, mlp, position;         // layernorm | rmsnorm; gelu | swiglu; learned | rope
  int64_t n_kv_head = 0, ffn_hidden = 0;
  std::optional<bool> bias, tied_embeddings;
  float norm_eps = 0, rope_theta = 0;
  float rope_scaling_factor = 0, rope_low_freq_factor = 0, rope_high_freq_factor = 0;
  int64_t rope_original_max_position = 0;
  // [data]
  std::string data_dir = "data";           // train_*.bin and val_*.bin from `loom prepare`
  std::string tokenizer_dir;               // encoder.json + vocab.bpe, for text samples ("" = data_dir)
  int64_t seq_len = 256;
  // [train]
  int64_t steps = 1000;
  int64_t batch_size = 8;                  // sequences per optimizer step (global batch)
  int64_t grad_accum = 1;                  // micro-steps per optimizer step (batch_size divisible)
  uint64_t seed = 1337;
  std::string device = "cpu";              // cpu | cuda (GPUs: needs a CUDA build) | emu (testing: an emulated device)
  bool cuda_graph = true;                  // device cuda: each step one CUDA graph (false: eager launches)
  std::string cuda_attention = "auto";     // device cuda: auto | flash | cudnn | gemm
  std::string precision = "auto";          // auto (the device's) | f32 | bf16 | fp16 (CUDA, loss-scaled)
  float loss_scale_init = 65536;           // fp16: the first loss scale (train/loss_scale.h)
  int64_t loss_scale_window = 1000;        // fp16: clean steps in a row before the scale doubles
  float loss_scale_min = 1;                // fp16: an overflow below this stops the run
  // train.precision with auto resolved: the device's (f32 on the CPU, bf16 on CUDA and emu).
  std::string run_precision() const { return precision != "auto" ? precision : device == "cpu" ? "f32" : "bf16"; }
  // The CPU backend's matmul inputs for train.precision (BackendOptions::matmul).
  DType cpu_matmul() const { return device == "cpu" && run_precision() == "bf16" ? DType::bf16 : DType::f32; }
  // On CUDA: whether the layout needs the mesh engine (tensor / sequence / context / pipeline
  // parallelism, ZeRO, offload or activation recomputation: train/engine.h's make_mesh_engine)
  // rather than the GPU's replica engine (whole replicas over dp, one CUDA graph per step).
  bool cuda_mesh() const {
    return tp > 1 || sp || cp > 1 || pp > 1 || zero > 0 || offload || recompute != "none";
  }
  int64_t threads = 0;                     // per process; 0: all cores (under mpi: shared by the host's processes)
  int64_t log_every = 10;
  int64_t eval_every = 100;                // 0: never
  int64_t eval_batches = 20;
  int64_t sample_every = 0;                // 0: only at the end
  int64_t sample_tokens = 64;
  float sample_temperature = 1.0f;
  int64_t sample_top_k = 40;
  std::string sample_prompt;               // text the samples continue ("": the first val tokens)
  int64_t checkpoint_every = 0;            // 0: only at the end
  int64_t keep_checkpoints = 2;
  int64_t skip_nonfinite = 3;   // steps with a non-finite loss or gradient skipped in a row before the run stops
  uint64_t memory_limit = 0;    // bytes loom may hold per rank (its model pool; 0: no limit)
  float time_limit_min = 0.0f;  // minutes after which the run stops with a checkpoint (0: none; train/stop.h)
  std::string out_dir = "runs/default";
  bool prune_embedding = false;            // keep only the input embedding rows of the data's tokens (fine-tuning)
  // [optim]
  float lr = 6e-4f, min_lr = -1.f;       // min_lr -1: lr / 10 (final_lr())
  int64_t warmup_steps = 100;
  int64_t decay_steps = 0;                 // the decay ends at this step (0: train.steps; decay_end())
  std::string lr_schedule = "cosine";      // cosine | constant | linear
  float weight_decay = 0.1f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  float grad_clip = 1.0f;                  // global-norm clip; 0 disables
  std::string optimizer = "adamw";         // adamw | galore (optim/galore.h)
  int64_t galore_rank = 128;               // GaLore's projection rank
  int64_t galore_update_every = 200;       // steps between GaLore's projector refreshes (SVDs)
  float galore_scale = 0.25f;              // GaLore's scale of the projected-back update
  // [parallel]
  int64_t dp = 1, tp = 1, pp = 1, cp = 1;
  bool sp = false;
  int64_t zero = 0;
  std::string comm = "threads";            // threads | mpi | nccl (train.device cuda)
  bool offload = false;                    // ZeRO-Offload: optimizer state and update in host memory
  float bucket_mb = 25.0f;                 // data-parallel gradient bucket size (MiB)
  bool prefetch = true;                    // ZeRO-3: gather the next block while one computes
  float timeout_s = 300.0f;                // a rank waiting longer in one collective fails the job
  std::string schedule = "1f1b";           // pipeline schedule (pp > 1): gpipe | 1f1b | interleaved | zb-h1
  int64_t virtual_stages = 2;              // model chunks per pipeline rank under the interleaved schedule
  std::vector<int64_t> stage_layers;       // blocks per (virtual) pipeline stage; empty: balanced by cost
  // [memory]
  std::string recompute = "none";          // none | full | every-k | sqrt | optimal (model/recompute.h)
  int64_t recompute_every = 2;             // every-k's k
  uint64_t activation_budget = 0;          // saved-activation bytes per rank (optimal's budget; 0: none)

  // The learning rate the decay ends at (optim.min_lr, or optim.lr / 10 for -1) and the step it
  // ends at (optim.decay_steps, or train.steps for 0).
  float final_lr() const { return min_lr < 0 ? lr / 10 : min_lr; }
  int64_t decay_end() const { return decay_steps > 0 ? decay_steps : steps; }
  // The model configuration these fields describe (vocab from the data when vocab_size is 0).
  model::GPTConfig model(int64_t data_vocab) const;
  // `command_line`: the fields set by command-line flags, named as such in the messages.
  void validate(const std::string& where, const std::vector<std::string>& command_line = {}) const;
  // The fields load_config set from command-line flags (not part of the config's values).
  std::vector<std::string> from_command_line;
  // Where `fields` came from, for a message about them: "FILE with --a.b" when one was set by a flag
  // over the config file `where` ("command line (--a.b)" without one), else `where`.
  std::string origin(const std::vector<std::string>& fields, const std::string& where) const;
  // The refusals of train.device = "cuda" (called by validate): a build without CUDA, any parallel
  // dimension, ZeRO, offload, and model shapes the GPU model lacks; errors name the field.
  void validate_cuda(const std::string& where) const;
  // train.device = "cuda": the model's vocabulary (the data's, once known) splits over tp into
  // shards the GPU's GEMMs take; throws naming parallel.tp.
  void validate_cuda_vocabulary(const model::GPTConfig& m, const std::string& where) const;
};

// A field of the schema, for parsing, errors and the config reference.
struct FieldInfo {
  std::string key;   // "optim.lr"
  std::string type;  // "int", "float", "string", "bool", "int list"
  std::string help;
  std::string default_value;
};
std::vector<FieldInfo> config_fields();
// Every field of `c` as (key, value written as in TOML), in the schema's order.
std::vector<std::pair<std::string, std::string>> config_values(const TrainConfig& c);

// Parses `path` (may be empty: defaults only), then applies the overrides ("optim.lr=1e-3" or the
// pair "--optim.lr", "1e-3" already joined by the caller as "optim.lr=1e-3").
TrainConfig load_config(const std::string& path, const std::vector<std::string>& overrides);

// Turns trailing CLI arguments (--a.b v | --a.b=v) into "a.b=v" overrides; throws on a stray
// argument.
std::vector<std::string> collect_overrides(const std::vector<std::string>& args);

// The config as TOML text (written next to checkpoints and metrics).
std::string config_to_toml(const TrainConfig& c);

// What `now` would do otherwise than the run whose config is `then_toml` (a checkpoint's
// config_toml, read where `where` says), resuming at step from_step after `from_update` updates
// (fewer where steps were skipped): the learning rate
// of any update still to make (the first that differs, and the schedule's fields that differ:
// peak, final rate, warm-up, kind, the step its decay ends at), AdamW's hyper-parameters (and GaLore's
// refresh interval and scale), gradient
// clipping and the batch's shape (train.batch_size, data.seq_len), each as "field X (the
// checkpoint's Y)". A field the older config lacks counts at its default.
std::vector<std::string> changed_on_resume(const TrainConfig& now, const std::string& then_toml,
                                           const std::string& where, int64_t from_update, int64_t from_step);
// train.batch_size of a checkpoint's config_toml (the default where it lacks the field).
int64_t checkpoint_batch_size(const std::string& then_toml, const std::string& where);

}  // namespace loom::train

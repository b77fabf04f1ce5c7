// Small pieces shared by the trainers (single device / data parallel, and the mesh trainer).
#pragma once
#include <chrono>
#include <functional>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <fstream>
#include <memory>

#include "comm/comm.h"
#include "data/loader.h"
#include "data/tokenizer.h"
#include "model/gpt.h"
#include "optim/adamw.h"
#include "model/config.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/sample.h"
#include "train/schedule.h"
#include "train/trainer.h"

namespace loom::train {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t);

// Under mpirun (parallel.comm = "mpi", or "nccl" for GPU ranks): checks that mpirun started `world_size` processes
// (`count` says which fields make that number, e.g. "parallel.dp is 2"), applies train.threads,
// and runs `rank` on this process's rank of the MPI world with a failure hook that aborts the
// whole job naming the rank. Without MPI in the build it throws naming `where`.
using RankBody =
    std::function<TrainResult(comm::Comm& world, std::function<void(int rank, const std::string& what)> on_fail)>;
TrainResult run_mpi_rank(const TrainConfig& cfg, const std::string& where, int world_size, const std::string& count,
                         const comm::CommOptions& co, const RankBody& rank);

// The GEMM rate of the whole job in FLOP/s, the peak against which model-FLOPs utilisation is
// reported: every rank measures at once with its own threads (so ranks that share cores share
// them here as in training, and ranks on other hosts add theirs) and the rates are added.
// Collective over world. `measure` is one rank's rate in FLOP/s (default: the CPU's f32 GEMM rate;
// the GPU trainer passes its GPU's rate in its compute dtype, so ranks sharing a GPU share it).
// (source: where the figure came from, "measured now" or "calibrated <date> by <who>".)
double job_gemm_peak(comm::Comm& world, const std::function<double()>& measure = {}, std::string* source = nullptr);

// The communicators' options of a run: parallel.timeout_s.
comm::CommOptions comm_options(const TrainConfig& cfg);

// "1h02m", "3m05s", "42s" ("?" for a negative or non-finite time).
std::string human_time(double seconds);

// Cross-entropy (nats per token) of the add-one smoothed unigram distribution of `train`,
// measured on `val` (or on train when there is no validation split): the loss of the best
// predictor that ignores context, printed as the baseline a model must beat. Each split is read
// whole up to `limit` tokens; a larger one, about `limit` of its tokens spread evenly over it (rank
// 0 computes it while the other ranks wait at their first collective: a pass over a corpus of
// billions of tokens outlasted parallel.timeout_s).
struct UnigramBaseline {
  double loss = 0;
  uint64_t counted = 0, scored = 0;  // training tokens counted, tokens scored
};
inline constexpr uint64_t kUnigramTokens = uint64_t(1) << 27;
UnigramBaseline unigram_loss(const data::Loader& train, const data::Loader* val, int64_t vocab,
                             uint64_t limit = kUnigramTokens);

// The data of a run and the model it configures: the train split, the validation split when
// DIR/val_*.bin exist, and the model config (vocabulary from the data unless set), validated
// against the data; errors name `config_path` and the field.
struct RunData {
  data::Loader train;
  std::unique_ptr<data::Loader> val;
  model::GPTConfig model;
  std::unique_ptr<data::Tokenizer> tokenizer;  // load_run_tokenizer's, checked against the shards
};
// `verify`: the shards whose payload this opening checks (data::VerifyShare; a rank of a job
// its own part).
RunData open_run_data(const TrainConfig& cfg, const std::string& config_path, data::VerifyShare verify = {});

// Before the first step, every rank of `world` compares what it was started with: every config
// field, the model it resolved, and its data (vocabulary fingerprint, token counts). A hash per
// item is gathered once; any difference is refused on every rank alike, naming the item and the
// ranks that differ from rank 0 (ranks started differently would otherwise train diverging
// replicas, or crash inside a collective of mismatched sizes). A collective: call it first.
// `flags`: the command line's own items beyond the config (--resume, --overwrite, --trace).
void check_ranks_agree(comm::Comm& world, const TrainConfig& cfg, const RunData& data,
                       const std::vector<std::pair<std::string, std::string>>& flags = {});

// Writes the loss-curve PNG `png` (train loss, validation loss, the unigram baseline as a line)
// and returns the line to print about it and the metrics file.
std::string write_loss_curve(const std::string& png, const std::string& metrics_path, const std::string& title,
                             const std::vector<std::pair<double, double>>& train,
                             const std::vector<std::pair<double, double>>& val, double unigram);

// Checks that checkpoint `ckpt` (manifest `meta`) can continue this run: the same seed and
// model (every field of the manifest's "model" but the name), and a data position at its step.
// Errors name the manifest and the field.
// `vocabulary`: the fingerprint of this run's tokenizer ("" when it has none).
void check_resume_checkpoint(const std::string& ckpt, const CheckpointMeta& meta, const TrainConfig& cfg,
                             const model::GPTConfig& mc,
                             const std::string& vocabulary);

// Keeps only the metric lines of steps <= last_step (a resumed run rewrites what follows).
void truncate_metrics(const std::string& path, int64_t last_step);

// An exclusive lock on DIR/.lock (flock) for the life of the object: a second run writing into the
// same train.out_dir at once is refused naming the directory, before it changes anything. Held by
// the rank that writes (rank 0); released when the process ends, however it ends.
class RunDirLock {
 public:
  explicit RunDirLock(const std::string& dir);
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

 private:
  int fd_ = -1;
};

// The (step, loss) and (step, val_loss) points of a metrics file (for the curve of a resumed run).
void read_loss_points(const std::string& path, std::vector<std::pair<double, double>>& train,
                      std::vector<std::pair<double, double>>& val);

// A failure injected on purpose (LOOM_FAULT_INJECT="rank=R,step=S,kind=K", a testing aid): rank R
// of the run's `ranks` fails at the start of step S (1-based) by throwing, exiting (_Exit(3)),
// being killed (SIGKILL) or stalling (sleeping for ever), or its step S gets a NaN in its gradients (kind=nan) or in its weights
// from then on (kind=nan_weight), or (train.precision fp16) step S of every rank (the loss scale is
// the job's) runs at a loss scale 2^16 times larger, so that its gradients overflow f16
// (kind=overflow: the loss scaler's recovery; R must still name a rank).
struct FaultInjection {
  int rank = -1;  // -1: none
  int64_t step = 0;
  std::string kind;  // throw | exit | kill | stall | nan | nan_weight | overflow | sigint | sigterm | sigusr1

  // Parses LOOM_FAULT_INJECT (none when unset or empty); errors name the variable.
  static FaultInjection from_env(int ranks);
  // Fires when rank r of `ranks` starts step `step`: throws, exits, is killed or raises a stop
  // signal; returns the NaN kind for the step to apply ("" for none).
  std::string maybe_fire(int r, int ranks, int64_t step) const;
};

// The pieces both trainers build from the config the same way.
optim::AdamWConfig adamw_config(const TrainConfig& cfg);
// GPT-2 format vocabulary (encoder.json + vocab.bpe) of data.tokenizer_dir, else of data.dir;
// null when data.dir has none (samples are then printed as token ids). An error naming the files
// when data.tokenizer names a directory without them, or when the vocabulary's size is not the
// `data_vocab` the token shards were written for.
std::unique_ptr<data::Tokenizer> load_run_tokenizer(const TrainConfig& cfg, int64_t data_vocab);
// A prompt's ids as the documents `loom prepare` lays out begin and as Hugging Face's
// tokenizer(text) gives them: the post-processor's prefix (Llama 3's <|begin_of_text|>), special
// tokens recognised (loom generate's and the samples').
std::vector<int32_t> prompt_ids(const data::Tokenizer& tok, const std::string& text);
// train.sample_prompt encoded (prompt_ids, with a tokenizer), else the first 8 tokens of the
// validation split (or of training).
std::vector<int32_t> sample_prompt(const TrainConfig& cfg, const data::Tokenizer* tok, const data::Loader& train,
                                   const data::Loader* val);
// Collective over `world`: rank 0's sample_prompt (it alone loads the tokenizer), on every rank.
std::vector<int32_t> shared_sample_prompt(comm::Comm& world, const TrainConfig& cfg, const data::Tokenizer* tok,
                                          const data::Loader& train, const data::Loader* val);
// The sampling options of train.sample_* at `step` (seeded by it).
SampleOptions sample_options(const TrainConfig& cfg, int64_t step);
// A prompt and its sampled continuation as text (token ids without a tokenizer: the
// continuation's only).
std::string sample_as_text(const std::vector<int32_t>& prompt, const std::vector<int32_t>& out,
                           const data::Tokenizer* tok);
// The manifest of a checkpoint of this run at `step`, after `consumed_samples` training samples.
CheckpointMeta checkpoint_meta(const TrainConfig& cfg, const model::GPTConfig& mc, int64_t step,
                               int64_t optimizer_steps, const std::string& vocabulary, int64_t consumed_samples);

// Rank 0's record of a run: metrics.jsonl lines, the loss points of the PNG, the progress lines
// every train.log_every steps (tokens/s, MFU, ETA over the window since the last one). Other
// ranks keep only the timing.
class RunLog {
 public:
  RunLog(const TrainConfig& cfg, const std::string& metrics_path, int64_t start_step, bool lead, bool quiet,
         double flops_per_token, double peak_flops, double unigram);
  // After each optimizer step (dt: its seconds).
  // loss_scale > 0 (fp16): the step's loss scale, in the metrics line.
  void record(int64_t done, double loss, float lr, double grad_norm, double dt, double loss_scale = 0);
  void record_val(int64_t done, double val_loss);
  // A step skipped for a non-finite loss or norm: its metrics line says so (no loss).
  void record_skip(int64_t done, float lr, double dt, double loss_scale = 0);
  // The progress line when due (every log_every steps, the first after the start, the last).
  void progress(int64_t done, double loss, float lr, double grad_norm);
  void say(const std::string& line) const;
  double train_seconds() const { return train_time_; }
  // Closes metrics.jsonl and writes the loss-curve PNG `png`.
  void finish(const std::string& png, const std::string& title);

 private:
  void check_metrics_write();
  // Model FLOPs over the peak; a peak below what the steps reach is raised to it (said once).
  double mfu(double tokens_per_s);
  bool raised_ = false;
  const TrainConfig& cfg_;
  std::string metrics_path_;
  int64_t start_step_;
  bool lead_, quiet_;
  double tokens_per_step_, flops_per_token_, peak_, unigram_;
  std::ofstream metrics_;
  std::vector<std::pair<double, double>> train_pts_, val_pts_;
  Clock::time_point t_start_ = Clock::now();
  double window_time_ = 0, train_time_ = 0;
  int64_t window_steps_ = 0;
};

// One optimizer step's outcome: the mean loss over the global batch and the gradient norm before
// clipping (every rank); whether the update was skipped (a non-finite loss or norm, the same on
// every rank) and where the first non-finite value was (a weight, a block's forward output or a
// gradient; "" when not located).
struct StepOut {
  double loss = 0, grad_norm = 0;
  bool skipped = false;
  std::string nonfinite;
  // train.precision fp16: the loss scale the step ran at, and whether its scaled gradients
  // overflowed f16 (the update was skipped and the scale halved: loss scaling at work, not a
  // divergence, so not counted against train.skip_nonfinite). 0 and false otherwise.
  double loss_scale = 0;
  bool overflow = false;
};

// What one trainer does at each point of the run; run_steps calls them at the config's cadence.
// Each is collective exactly when the trainer's own work is (every rank calls every hook).
struct RunHooks {
  std::function<StepOut(int64_t step, float lr)> step;  // one optimizer step (step is 0-based)
  std::function<void(const std::string& kind)> poison;  // a fault injection (nan, nan_weight, overflow)
  std::function<double()> evaluate;                     // the mean validation loss
  std::function<std::string(int64_t done)> sample;      // a sample's text ("" when none is wanted)
  std::function<void(int64_t done)> checkpoint;         // writes the checkpoint of step `done`
  // Collective: why the run stops now, agreed by every rank (0: it goes on; train/stop.h).
  std::function<int()> stop;
};

// The training loop of every trainer, steps start_step .. cfg.steps: at each, the injected fault
// (rank `rank` of `ranks`), the step at the schedule's learning rate for the updates made before
// it (`updates` at start_step; a skipped step makes none, so it does not move the schedule, as in
// Megatron-LM) (a step whose loss or gradient norm is not finite was skipped by the engine, said
// with where the first non-finite value was; after train.skip_nonfinite of them in a row, or one
// the engine could not skip, the run stops with an error naming the step and that place), the
// metrics, validation
// every train.eval_every steps and at the end (when there is validation data), the progress line,
// a sample every train.sample_every steps (not at the end, which the trainer samples after its
// summary), a checkpoint every train.checkpoint_every steps and at the end. After every step but
// the last the ranks agree whether to stop early (hooks.stop: a signal or train.time_limit_min),
// and before the first whether a signal came during the set-up; a run stopped after a step writes
// that step's checkpoint (unless it has, or the step ends a streak of non-finite ones) and returns. Fills res's last_loss, steps_done,
// last_val_loss, train_seconds, stopped and stop_checkpoint.
void run_steps(const TrainConfig& cfg, RunLog& log, const LrSchedule& sched, const FaultInjection& fault, int rank,
               int ranks, int64_t start_step, int64_t updates, bool has_val, const RunHooks& hooks, TrainResult& res);

}  // namespace loom::train

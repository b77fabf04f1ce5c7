#include "train/run_util.h"
#include "core/threads.h"

#include <chrono>
#include <thread>

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/file.h>
#include <unistd.h>
#include <nlohmann/json.hpp>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "comm/mpi_comm.h"
#include "core/error.h"
#include "core/file.h"
#include "data/shard.h"
#include "kernels/cpu/matmul.h"
#include "optim/galore.h"
#include "parallel/data/flat_layout.h"
#include "plan/calibration.h"
#include "train/checkpoint_io.h"
#include "train/config.h"
#include "train/plot.h"
#include "train/sample.h"
#include "train/stop.h"

namespace fs = std::filesystem;

namespace loom::train {

TrainResult run_mpi_rank(const TrainConfig& cfg, const std::string& where, int world_size, const std::string& count,
                         const comm::CommOptions& co, const RankBody& rank) {
#ifdef LOOM_HAVE_MPI
  comm::MpiSession session(nullptr, nullptr);
  // A rank that fails before the job's communicator exists aborts the job too: unwinding would
  // finalise MPI, which waits for ranks that wait in MPI_Comm_dup for this one (a silent hang).
  std::unique_ptr<comm::Comm> world;
  try {
    if (session.size() != world_size)
      throw Error(fmt::format("{}: {} but mpirun started {} processes (they must match)", where, count, session.size()));
    // train.threads = 0: the host's cores shared among the job's processes on it, as the threads
    // backend shares them among its rank threads (each process taking them all would oversubscribe
    // the cores, and OpenMP's spinning barriers then stall every parallel region).
    set_omp_threads(cfg.threads > 0 ? int(cfg.threads) : std::max(1, omp_get_max_threads() / session.local_size()));
    world = comm::mpi_world(co);
  } catch (const std::exception& e) {
    comm::mpi_abort(fmt::format("loom: rank {} of {} failed: {}", session.rank(), session.size(), e.what()));
  }
  return rank(*world, [&](int who, const std::string& what) {
    comm::mpi_abort(fmt::format("loom: rank {} of {} failed: {}", who, world_size, what));
  });
#else
  (void)world_size, (void)count, (void)co, (void)rank;
  throw Error(fmt::format("{}: parallel.comm = \"{}\" needs loom built with MPI", where, cfg.comm));
#endif
}

double job_gemm_peak(comm::Comm& world, const std::function<double()>& measure, std::string* source) {
  world.barrier();
  double rate = 0;
  std::string from = "measured now";
  if (measure) {
    rate = measure();
  } else {
    // The larger of a quick measurement now and this host's calibration (loom calibrate): a rate
    // measured while the host is busy is too low, and an MFU over it too high.
    rate = cpu::measure_gemm_peak_gflops(1024, 0.3) * 1e9;
    if (const auto cal = plan::cached_profile(omp_get_max_threads()); cal && cal->gemm_peak > rate) {
      rate = cal->gemm_peak;
      from = fmt::format("calibrated {} by {}", cal->date, cal->source);
    }
  }
  if (source) *source = from;
  return parallel::sum_over_ranks(world, rate);
}

comm::CommOptions comm_options(const TrainConfig& cfg) {
  comm::CommOptions co;
  co.timeout = std::chrono::milliseconds(std::max<int64_t>(1, std::llround(double(cfg.timeout_s) * 1000.0)));
  return co;
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string human_time(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  int64_t t = int64_t(s + 0.5);
  if (t >= 3600) return fmt::format("{}h{:02d}m", t / 3600, (t / 60) % 60);
  if (t >= 60) return fmt::format("{}m{:02d}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

namespace {

// The tokens of a loader's split, a chunk at a time: all of them when they are at most `limit`,
// else `limit` of them (rounded down to whole chunks of 64K, or one chunk of `limit`) in chunks
// spread evenly over the whole split, its first and last included, so a corpus whose start is
// unlike the rest is still represented, however many shards it has. Token ids are checked against
// the vocabulary (another rank may have verified the shard's payload).
template <class F>
void for_each_token(const data::Loader& l, uint64_t limit, F&& f) {
  const uint64_t total = l.total_tokens();
  const uint64_t chunk = std::min<uint64_t>(uint64_t(1) << 16, std::max<uint64_t>(limit, 1));
  std::vector<int32_t> buf(static_cast<size_t>(chunk));
  auto take = [&](uint64_t start, uint64_t n) {
    l.read(start, n, buf.data());
    for (uint64_t j = 0; j < n; ++j) {
      if (uint32_t(buf[j]) >= l.vocab_size()) {
        const auto [file, at] = l.locate(start + j);
        throw Error(fmt::format("{}: token {} is {}, outside the vocabulary of {}: the shard is damaged (re-run "
                                "`loom prepare`)",
                                file, at, uint32_t(buf[j]), l.vocab_size()));
      }
      f(buf[j]);
    }
  };
  if (total <= limit) {
    for (uint64_t s = 0; s < total; s += chunk) take(s, std::min(chunk, total - s));
    return;
  }
  const uint64_t count = std::max<uint64_t>(1, limit / chunk);
  for (uint64_t k = 0; k < count; ++k) take(count == 1 ? 0 : k * (total - chunk) / (count - 1), chunk);
}

}  // namespace

UnigramBaseline unigram_loss(const data::Loader& train, const data::Loader* val, int64_t vocab, uint64_t limit) {
  std::vector<double> count(size_t(vocab), 1.0);
  double total = double(vocab);
  UnigramBaseline u;
  for_each_token(train, limit, [&](int32_t t) { count[size_t(t)] += 1, total += 1; });
  u.counted = uint64_t(total) - uint64_t(vocab);
  double nll = 0, n = 0;
  for_each_token(val ? *val : train, limit, [&](int32_t t) { nll -= std::log(count[size_t(t)] / total), n += 1; });
  u.scored = uint64_t(n);
  u.loss = n > 0 ? nll / n : NAN;
  return u;
}

// With every rank a thread of this process on the CPU, the whole job's memory is this host's. A
// lower bound of what any layout holds at once: the f32 weights of each data-parallel replica
// (one sharded copy under ZeRO-3) and one copy of their gradients, 4 bytes a parameter each; and
// for one micro-batch of every data-parallel rank, its token ids and targets (i32) and the head's
// logits over the padded vocabulary (f32; tensor parallelism splits them, it does not shrink
// them). AdamW's moments and the other activations come on top. A model, batch or layout that
// far exceeds the host is refused here, naming the fields (and whether a flag set them), instead
// of failing to allocate part-way through building it or stopped by the kernel's out-of-memory
// killer.
static void check_host_memory(const TrainConfig& cfg, const model::GPTConfig& m, const std::string& config_path) {
  if (cfg.device == "cuda" || cfg.comm != "threads") return;  // (the emulated device's memory is the host's)
  const double host = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGESIZE));
  if (host <= 0) return;
  const double C = double(m.n_embd);
  const double params = double(m.nonembedding_parameters()) +
                        (double(m.padded_vocab()) * (m.tied_embeddings ? 1 : 2) +
                         (m.position == model::Position::learned ? double(m.block_size) : 0.0)) *
                            C;
  const double replicas = cfg.zero >= 3 ? 1.0 : double(cfg.dp);
  const double need = 4 * params * (replicas + 1);
  if (need > host)
    throw Error(fmt::format("{}: model.n_layer {}, model.n_embd {}, model.block_size {} and parallel.dp {} (ZeRO {}): "
                            "{:.3g} parameters, whose f32 weights and gradients alone take {:.1f} GiB, more than "
                            "this host's {:.1f} GiB of memory",
                            cfg.origin({"model.n_layer", "model.n_embd", "model.block_size", "model.vocab_size",
                                        "model.preset", "parallel.dp", "parallel.zero"},
                                       config_path),
                            m.n_layer, m.n_embd, m.block_size, cfg.dp, cfg.zero, params, need / double(1 << 30),
                            host / double(1 << 30)));
  const double tokens = double(cfg.batch_size / cfg.grad_accum) * double(cfg.seq_len);  // one micro-batch, all dp ranks
  const double batch = tokens * (8.0 + 4.0 * double(m.padded_vocab()));
  if (batch > host)
    throw Error(fmt::format("{}: train.batch_size {} / train.grad_accum {} sequences of data.seq_len {}: a micro-batch "
                            "of {:.3g} tokens, whose token ids and logits (vocabulary {}) alone take {:.1f} GiB, more "
                            "than this host's {:.1f} GiB of memory",
                            cfg.origin({"train.batch_size", "train.grad_accum", "data.seq_len", "model.vocab_size"},
                                       config_path),
                            cfg.batch_size, cfg.grad_accum, cfg.seq_len, tokens, m.padded_vocab(),
                            batch / double(1 << 30), host / double(1 << 30)));
}

RunData open_run_data(const TrainConfig& cfg, const std::string& config_path, data::VerifyShare verify) {
  RunData r{data::Loader(cfg.data_dir, "train", cfg.seq_len, cfg.seed, verify), nullptr, {}, nullptr};
  if (!data::list_shards(cfg.data_dir, "val").empty()) {
    r.val = std::make_unique<data::Loader>(cfg.data_dir, "val", cfg.seq_len, cfg.seed, verify);
    LOOM_CHECK(r.val->vocab_size() == r.train.vocab_size(),
               "{}: the val shards' vocabulary is {} tokens, the train shards' ({}) {}: they come from different "
               "tokenizers (re-run `loom prepare`)",
               r.val->files().front(), r.val->vocab_size(), r.train.files().front(), r.train.vocab_size());
  }
  r.model = cfg.model(int64_t(r.train.vocab_size()));
  r.model.validate(cfg.origin({"model.preset", "model.n_layer", "model.n_head", "model.n_embd", "model.vocab_size",
                               "model.block_size", "model.n_kv_head", "model.ffn_hidden", "model.norm_eps",
                               "model.position", "model.rope_theta", "model.rope_scaling_factor",
                               "model.rope_low_freq_factor", "model.rope_high_freq_factor",
                               "model.rope_original_max_position"},
                              config_path.empty() ? "model config" : config_path + ": [model]"));
  if (int64_t(r.train.vocab_size()) > r.model.vocab_size)
    throw Error(fmt::format("{}: model.vocab_size {} is smaller than the data's vocabulary {}",
                            cfg.origin({"model.vocab_size"}, config_path), r.model.vocab_size, r.train.vocab_size()));
  if (cfg.seq_len > r.model.block_size)
    throw Error(fmt::format("{}: data.seq_len {} exceeds model.block_size {}",
                            cfg.origin({"data.seq_len", "model.block_size", "model.preset"}, config_path), cfg.seq_len,
                            r.model.block_size));
  check_host_memory(cfg, r.model, config_path);
  r.tokenizer = load_run_tokenizer(cfg, int64_t(r.train.vocab_size()));
  if (cfg.prune_embedding) {
    // The tokens the run can feed the model: its data's, and the sample prompt's.
    std::vector<char> used(size_t(r.model.vocab_size), 0);
    for (const data::Loader* l : {&r.train, r.val.get()})
      if (l) for_each_token(*l, UINT64_MAX, [&](int32_t t) { used[size_t(t)] = 1; });
    if (r.tokenizer && !cfg.sample_prompt.empty())
      for (int32_t id : prompt_ids(*r.tokenizer, cfg.sample_prompt)) used[size_t(id)] = 1;
    auto kept = std::make_shared<std::vector<int32_t>>();
    for (size_t id = 0; id < used.size(); ++id)
      if (used[id]) kept->push_back(int32_t(id));
    r.model.kept_tokens = std::move(kept);
  }
  return r;
}

std::string write_loss_curve(const std::string& png, const std::string& metrics_path, const std::string& title,
                             const std::vector<std::pair<double, double>>& train,
                             const std::vector<std::pair<double, double>>& val, double unigram) {
  std::vector<Series> series{{"train loss", train, 0.12, 0.4, 0.8}};
  if (!val.empty()) series.push_back({"val loss", val, 0.85, 0.33, 0.1});
  if (std::isfinite(unigram) && !train.empty())
    series.push_back({"unigram baseline", {{train.front().first, unigram}, {train.back().first, unigram}}, 0.5, 0.5, 0.5});
  std::string why;
  if (plot_png(png, title, series, "loss (nats/token)", &why)) return fmt::format("wrote {} and {}", metrics_path, png);
  return fmt::format("wrote {} ({})", metrics_path, why);
}

void check_ranks_agree(comm::Comm& world, const TrainConfig& cfg, const RunData& data,
                       const std::vector<std::pair<std::string, std::string>>& flags) {
  if (world.size() == 1) return;
  // What each rank was started with, item by item: the command line's flags, every config field,
  // then the resolved model and the data.
  std::vector<std::pair<std::string, std::string>> items = flags;
  for (auto& item : config_values(cfg)) items.push_back(std::move(item));
  items.emplace_back("the model (as resolved from the config and the data)", data.model.str());
  items.emplace_back("the data's vocabulary", data.tokenizer ? data.tokenizer->fingerprint() : "");
  items.emplace_back("the data's training tokens", std::to_string(data.train.total_tokens()));
  items.emplace_back("the data's validation tokens", data.val ? std::to_string(data.val->total_tokens()) : "none");
  auto hash = [](const std::string& s) {  // FNV-1a, 64 bits
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    return h;
  };
  const int n = world.size(), me = world.rank();
  // First the number of items (the same loom on every rank has the same), then the hashes.
  const int32_t count = int32_t(items.size());
  std::vector<int32_t> counts(static_cast<size_t>(n));
  world.all_gather(&count, counts.data(), n, DType::i32);
  for (int r = 0; r < n; ++r)
    if (counts[size_t(r)] != counts[0])
      throw Error(fmt::format("ranks disagree before the first step: rank {} compares {} items of its config and "
                              "data, rank 0 {} (every rank must run the same loom)",
                              r, counts[size_t(r)], counts[0]));
  std::vector<uint32_t> mine(2 * items.size()), all(2 * items.size() * size_t(n));
  for (size_t i = 0; i < items.size(); ++i) {
    const uint64_t h = hash(items[i].second);
    mine[2 * i] = uint32_t(h);
    mine[2 * i + 1] = uint32_t(h >> 32);
  }
  world.all_gather(mine.data(), all.data(), int64_t(all.size()), DType::u32);
  for (size_t i = 0; i < items.size(); ++i) {
    std::vector<int> differ;
    for (int r = 1; r < n; ++r) {
      const size_t at = size_t(r) * mine.size() + 2 * i;
      if (all[at] != all[2 * i] || all[at + 1] != all[2 * i + 1]) differ.push_back(r);
    }
    if (differ.empty()) continue;
    const bool mine_differs = std::find(differ.begin(), differ.end(), me) != differ.end();
    throw Error(fmt::format("ranks disagree before the first step: {} on rank{} {} differs from rank 0's{} (every "
                            "rank must be started with the same config, model and data)",
                            items[i].first, differ.size() > 1 ? "s" : "", fmt::join(differ, ", "),
                            mine_differs || me == 0 ? fmt::format(" (this rank, {}, has {})", me, items[i].second) : ""));
  }
}

void check_resume_checkpoint(const std::string& ckpt, const CheckpointMeta& meta, const TrainConfig& cfg,
                             const model::GPTConfig& mc, const std::string& vocabulary) {
  const std::string manifest = (fs::path(ckpt) / "manifest.json").string();
  LOOM_CHECK(meta.seed == cfg.seed, "{}: the checkpoint's seed {} differs from train.seed {}", manifest, meta.seed,
             cfg.seed);
  // A run that ended before the checkpoint's step has nothing to continue: say so rather than
  // exit having done nothing.
  if (meta.step > cfg.steps)
    throw Error(fmt::format("train.steps is {} but the checkpoint {} is at step {}: --resume continues up to "
                            "train.steps (raise it to train on; nothing was changed)",
                            cfg.steps, ckpt, meta.step));
  const model::GPTConfig c = model::gpt_config_from_manifest(meta.model, manifest);
  auto same = [&](const char* field, auto have, auto want) {
    if (have != want)
      throw Error(fmt::format("{}: the checkpoint's model.{} is {} but this run's is {} (--resume continues the "
                              "model the checkpoint was written with)",
                              manifest, field, have, want));
  };
  same("n_layer", c.n_layer, mc.n_layer);
  same("n_head", c.n_head, mc.n_head);
  same("n_embd", c.n_embd, mc.n_embd);
  same("vocab_size", c.vocab_size, mc.vocab_size);
  same("block_size", c.block_size, mc.block_size);
  same("tied_embeddings", c.tied_embeddings, mc.tied_embeddings);
  if (meta.model.contains("ln_eps")) same("ln_eps", c.ln_eps, mc.ln_eps);
  same("norm", model::norm_name(c.norm), model::norm_name(mc.norm));
  same("mlp", model::mlp_name(c.mlp), model::mlp_name(mc.mlp));
  same("position", model::position_name(c.position), model::position_name(mc.position));
  same("n_kv_head", c.kv_heads(), mc.kv_heads());
  same("ffn_hidden", c.ffn(), mc.ffn());
  same("bias", c.bias, mc.bias);
  same("rope_theta", c.rope_theta, mc.rope_theta);
  same("rope_scaling_factor", c.rope_scaling_factor, mc.rope_scaling_factor);
  if (c.rope_scaling_factor > 0) {  // (a converted Llama 3's: its bands, not the config's defaults)
    same("rope_low_freq_factor", c.rope_low_freq_factor, mc.rope_low_freq_factor);
    same("rope_high_freq_factor", c.rope_high_freq_factor, mc.rope_high_freq_factor);
    same("rope_original_max_position", c.rope_original_max_position, mc.rope_original_max_position);
  }
  if (meta.model.contains("input_rows") && !cfg.prune_embedding)
    throw Error(fmt::format("{}: the checkpoint's input embedding is pruned to {} rows (model.prune_embedding); resume "
                            "it with --model.prune_embedding true, or export it (`loom convert`) for a run of the "
                            "whole vocabulary",
                            manifest, meta.model["input_rows"].dump()));
  if (meta.model.contains("input_rows") && meta.model["input_rows"] != mc.input_rows())
    throw Error(fmt::format("{}: the checkpoint's pruned input embedding keeps {} tokens, but data.dir {} uses {} "
                            "(model.prune_embedding keeps the tokens of the run's data: resume on the data the run "
                            "was pruned for)",
                            manifest, meta.model["input_rows"].dump(), cfg.data_dir, mc.input_rows()));
  // Every parameter of the model at its shape in the manifest (a rank reads its slices by element:
  // a tensor of another shape with as many elements would be read as if it were this one).
  if (!meta.tensors.empty()) {
    std::map<std::string, Shape> listed;
    for (const TensorInfo& t : meta.tensors) listed[t.name] = t.shape;
    for (const model::ParamSpec& s : model::gpt_param_specs(mc)) {
      auto it = listed.find("param/" + s.name);
      const bool widened = mc.kept_tokens && s.name == "wte.weight" && it != listed.end() &&
                           it->second == Shape{mc.vocab_size, mc.n_embd};
      if (it != listed.end() && (it->second == s.shape || widened)) continue;
      throw Error(fmt::format("{}: the checkpoint's parameter '{}' is {}, but this run's model has it {}", manifest,
                              s.name, it == listed.end() ? std::string("missing") : shape_str(it->second),
                              shape_str(s.shape)));
    }
  }
  // The optimizer's state must be the one this run's optimizer keeps (after its first step:
  // before it, every optimizer's state is zero, and a run may start any optimizer from it).
  if (meta.optimizer_steps > 0 && meta.tensors.empty() && cfg.optimizer != "adamw")
    throw Error(fmt::format("{}: a checkpoint of format version 1 or 2 holds AdamW's state only, but this run's "
                            "optim.name = {} (--resume continues with the optimizer the checkpoint was written with)",
                            manifest, cfg.optimizer));
  if (meta.optimizer_steps > 0 && !meta.tensors.empty()) {
    std::map<std::string, Shape> have;
    for (const TensorInfo& t : meta.tensors) have[t.name] = t.shape;
    const optim::AdamWConfig oc = adamw_config(cfg);
    for (const model::ParamSpec& s : model::gpt_param_specs(mc)) {
      const optim::GaLoreShapes g = optim::galore_shapes(s.name, s.shape, oc.galore_rank, s.row_blocks);
      // (Of a matrix GaLore treats in parts, the first part's moments.)
      const optim::GaLorePart* first = g.low_rank ? &g.parts.front() : nullptr;
      const std::string name = first ? optim::galore_part_tensors(s.name, *first)[0] : "adam_m/" + s.name;
      const Shape want = first ? first->moments : s.shape;
      auto it = have.find(name);
      // (A pruned input embedding reads its rows from the whole vocabulary's table.)
      const bool widened = mc.kept_tokens && s.name == "wte.weight" && it != have.end() &&
                           it->second == Shape{mc.vocab_size, mc.n_embd};
      if (it != have.end() && (it->second == want || widened)) continue;
      // What the checkpoint keeps for it: GaLore's moments (of the whole matrix or of its first
      // part, "name[label]"), or AdamW's.
      std::string held = fmt::format("AdamW's, moments {}", shape_str(have.count("adam_m/" + s.name)
                                                                          ? have.at("adam_m/" + s.name) : Shape{}));
      const std::string same_part = first ? optim::galore_state_name("galore_m/", s.name, *first) : "";
      if (first && have.count(same_part)) {
        held = fmt::format("GaLore's, moments {}{}", shape_str(have.at(same_part)),
                           first->label.empty() ? "" : " for [" + first->label + "]");
      } else if (have.count("galore_m/" + s.name)) {
        held = fmt::format("GaLore's, moments {}", shape_str(have.at("galore_m/" + s.name)));
        // (A checkpoint of a loom that projected a Llama block's fused matrices whole.)
        if (first && !first->label.empty())
          throw Error(fmt::format("{}: the checkpoint keeps GaLore's state of '{}' as one matrix (moments {}), as loom "
                                  "did before it projected a Llama block's q, k, v and gate, up apart, as Hugging "
                                  "Face's modules; this loom cannot continue that state (its weights can start a new "
                                  "run: loom convert --to hf, then --from hf)",
                                  manifest, s.name, shape_str(have.at("galore_m/" + s.name))));
      } else {
        for (const auto& [n, shape] : have)
          if (n.rfind("galore_m/" + s.name + "[", 0) == 0) {
            held = fmt::format("GaLore's, moments {} for {}", shape_str(shape), n.substr(9 + s.name.size()));
            break;
          }
      }
      throw Error(fmt::format(
          "{}: the checkpoint's optimizer state for '{}' is {} but this run's optim.name = {}{} keeps {} {}{} "
          "(--resume continues with the optimizer the checkpoint was written with)",
          manifest, s.name, held, cfg.optimizer, g.low_rank ? fmt::format(" (optim.galore_rank {})", cfg.galore_rank) : "",
          first && first->low_rank ? "GaLore moments" : "AdamW moments", shape_str(want),
          first && !first->label.empty() ? " for [" + first->label + "]" : ""));
    }
  }
  // The sampler's position is the step (the samples drawn are consumed_samples, data/loader.h).
  LOOM_CHECK(meta.data_position == meta.step, "{}: field 'data_position' is {} but 'step' is {} (they must match)",
             manifest, meta.data_position, meta.step);
  // The same vocabulary size is not the same vocabulary: ids would mean other text.
  if (!meta.vocabulary.empty() && !vocabulary.empty() && meta.vocabulary != vocabulary)
    throw Error(fmt::format("{}: the checkpoint was trained with vocabulary {}, but the tokenizer of data.dir {} (or "
                            "data.tokenizer) is {}: its token ids mean other text (resume on the data the checkpoint "
                            "was trained on)",
                            manifest, meta.vocabulary, cfg.data_dir, vocabulary));
}

RunDirLock::RunDirLock(const std::string& dir) {
  const std::string path = (fs::path(dir) / ".lock").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw Error(fmt::format("{}: cannot create the run's lock file: {}", path, std::strerror(errno)));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK)
      throw Error(fmt::format("train.out_dir {} is in use by another run (it holds {}); wait for it to end or "
                              "choose another train.out_dir",
                              dir, path));
    throw Error(fmt::format("{}: cannot lock: {}", path, std::strerror(err)));
  }
}

RunDirLock::~RunDirLock() {
  if (fd_ >= 0) ::close(fd_);  // closing releases the lock
}

void truncate_metrics(const std::string& path, int64_t last_step) {
  if (!fs::exists(path)) return;
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  // Keeps the records of steps <= last_step, a step being any number (5.0 and 2^64 - 1 compared as
  // the numbers they are, as read_loss_points and a reader of the file take them). A line that is
  // not a record with a numeric step is kept as it is (its step is unknown: dropping it, or
  // everything after it, would lose records), except as the last line, where it is the torn write
  // of a killed run.
  std::string kept;
  for (size_t i = 0; i < lines.size(); ++i) {
    const auto j = nlohmann::json::parse(lines[i], nullptr, false);
    const bool record = !j.is_discarded() && j.is_object() && j.contains("step") && j["step"].is_number();
    if (record ? j["step"].get<double>() <= double(last_step) : i + 1 < lines.size()) kept += lines[i] + "\n";
  }
  // Through a temporary copy that must be written whole before it replaces the file: on a full
  // disk the history stays as it was.
  try {
    write_file_atomically(path, kept);
  } catch (const Error& e) {
    throw Error(fmt::format("cannot rewrite the metrics for the resume: {}", e.what()));
  }
}

void read_loss_points(const std::string& path, std::vector<std::pair<double, double>>& train,
                      std::vector<std::pair<double, double>>& val) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number()) continue;
    if (j.contains("loss") && j["loss"].is_number()) train.push_back({j["step"].get<double>(), j["loss"].get<double>()});
    if (j.contains("val_loss") && j["val_loss"].is_number())
      val.push_back({j["step"].get<double>(), j["val_loss"].get<double>()});
  }
}

FaultInjection FaultInjection::from_env(int ranks) {
  FaultInjection f;
  const char* env = std::getenv("LOOM_FAULT_INJECT");
  if (!env || !*env) return f;
  const std::string spec = env;
  auto bad = [&](const std::string& why) {
    return Error(fmt::format("LOOM_FAULT_INJECT='{}': {} (expected rank=R,step=S,kind=throw|exit|kill|stall|nan|nan_weight|overflow|sigint|sigterm|sigusr1)",
                             spec, why));
  };
  auto number = [&](const std::string& key, const std::string& v) -> int64_t {
    size_t used = 0;
    int64_t n = 0;
    try {
      n = std::stoll(v, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != v.size()) throw bad(fmt::format("{} '{}' is not an integer", key, v));
    return n;
  };
  bool has_rank = false, has_step = false;
  size_t start = 0;
  while (start <= spec.size()) {
    size_t end = spec.find(',', start);
    if (end == std::string::npos) end = spec.size();
    std::string item = spec.substr(start, end - start);
    size_t eq = item.find('=');
    if (eq == std::string::npos) throw bad(fmt::format("'{}' is not key=value", item));
    std::string key = item.substr(0, eq), val = item.substr(eq + 1);
    if (key == "rank") {
      int64_t r = number(key, val);
      if (r < 0 || r >= ranks) throw bad(fmt::format("rank {} is not one of the {} ranks", r, ranks));
      f.rank = int(r);
      has_rank = true;
    } else if (key == "step") {
      f.step = number(key, val);
      if (f.step < 1) throw bad(fmt::format("step {} is not positive", f.step));
      has_step = true;
    } else if (key == "kind") {
      if (val != "throw" && val != "exit" && val != "kill" && val != "stall" && val != "nan" && val != "nan_weight" &&
          val != "overflow" && val != "sigint" && val != "sigterm" && val != "sigusr1")
        throw bad(fmt::format("unknown kind '{}'", val));
      f.kind = val;
    } else {
      throw bad(fmt::format("unknown key '{}'", key));
    }
    start = end + 1;
  }
  if (!has_rank || !has_step || f.kind.empty()) throw bad("rank, step and kind are all required");
  return f;
}

std::string FaultInjection::maybe_fire(int r, int ranks, int64_t at) const {
  if (at != step) return "";
  // The loss scale is the job's: an overflow is injected into the step of every rank.
  if (kind == "overflow") return kind;
  if (r != rank) return "";
  if (kind == "nan" || kind == "nan_weight") return kind;
  // A signal this rank's process receives as the step starts (train/stop.h: the run stops after it).
  if (kind == "sigint" || kind == "sigterm" || kind == "sigusr1") {
    send_stop_signal_to_self(kind == "sigint" ? SIGINT : kind == "sigterm" ? SIGTERM : SIGUSR1);
    return "";
  }
  std::string what = fmt::format("LOOM_FAULT_INJECT: rank {} of {} fails on purpose at step {} ({})", r, ranks, at, kind);
  if (kind == "throw") throw Error(what);
  std::fflush(stdout);
  std::fprintf(stderr, "loom: %s\n", what.c_str());
  std::fflush(stderr);
  if (kind == "exit") std::_Exit(3);
  if (kind == "stall")  // alive but silent: its peers' collectives time out waiting for it
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  std::raise(SIGKILL);
  return "";
}

optim::AdamWConfig adamw_config(const TrainConfig& cfg) {
  optim::AdamWConfig oc;
  oc.lr = cfg.lr;
  oc.beta1 = cfg.beta1;
  oc.beta2 = cfg.beta2;
  oc.eps = cfg.eps;
  oc.weight_decay = cfg.weight_decay;
  oc.max_norm = cfg.grad_clip;
  if (cfg.optimizer == "galore") {
    oc.galore_rank = cfg.galore_rank;
    oc.galore_update_every = cfg.galore_update_every;
    oc.galore_scale = cfg.galore_scale;
  }
  return oc;
}

std::unique_ptr<data::Tokenizer> load_run_tokenizer(const TrainConfig& cfg, int64_t data_vocab) {
  const std::filesystem::path dir = cfg.tokenizer_dir.empty() ? cfg.data_dir : cfg.tokenizer_dir;
  const bool present = data::Tokenizer::dir_has_tokenizer(dir.string());
  if (!present && !cfg.tokenizer_dir.empty())
    throw Error(fmt::format("data.tokenizer: {} has no tokenizer (encoder.json + vocab.bpe, or tokenizer.json)",
                            dir.string()));
  if (!present) {
    // Half of a tokenizer's pair of files is a broken tokenizer, not none.
    for (const auto& [a, b] : {std::pair{"encoder.json", "vocab.bpe"}, std::pair{"vocab.json", "merges.txt"}})
      if (std::filesystem::exists(dir / a) != std::filesystem::exists(dir / b))
        throw Error(fmt::format("{}: {} without {} (a tokenizer is both files)", dir.string(),
                                std::filesystem::exists(dir / a) ? a : b, std::filesystem::exists(dir / a) ? b : a));
    if (!cfg.sample_prompt.empty() && cfg.sample_tokens > 0)
      throw Error(fmt::format("train.sample_prompt: encoding \"{}\" needs a tokenizer, and {} has none (data.tokenizer "
                              "names the directory of one)",
                              cfg.sample_prompt.size() > 40 ? cfg.sample_prompt.substr(0, 40) + "..." : cfg.sample_prompt,
                              dir.string()));
    return nullptr;
  }
  auto tok = std::make_unique<data::Tokenizer>(data::Tokenizer::from_dir(dir.string()));
  if (tok->vocab_size() != data_vocab)
    throw Error(fmt::format("{}: the tokenizer has {} tokens, but the token shards in {} were written for a "
                            "vocabulary of {} (data.tokenizer and data.dir must belong to one `loom prepare`)",
                            (std::filesystem::exists(dir / "encoder.json")     ? dir / "encoder.json"
                             : std::filesystem::exists(dir / "tokenizer.json") ? dir / "tokenizer.json"
                                                                               : dir / "vocab.json")
                                .string(),
                            tok->vocab_size(), cfg.data_dir, data_vocab));
  return tok;
}

std::vector<int32_t> shared_sample_prompt(comm::Comm& world, const TrainConfig& cfg, const data::Tokenizer* tok,
                                          const data::Loader& train, const data::Loader* val) {
  std::vector<int32_t> prompt;
  if (world.rank() == 0) prompt = sample_prompt(cfg, tok, train, val);
  int32_t n = int32_t(prompt.size());
  world.broadcast(&n, 1, DType::i32, 0);
  prompt.resize(size_t(n));
  world.broadcast(prompt.data(), n, DType::i32, 0);
  return prompt;
}

std::vector<int32_t> prompt_ids(const data::Tokenizer& tok, const std::string& text) {
  std::vector<int32_t> ids = tok.template_prefix();
  for (int32_t t : tok.encode(text, {.allow_special = true})) ids.push_back(t);
  return ids;
}

std::vector<int32_t> sample_prompt(const TrainConfig& cfg, const data::Tokenizer* tok, const data::Loader& train,
                                   const data::Loader* val) {
  std::vector<int32_t> prompt;
  if (tok && !cfg.sample_prompt.empty()) prompt = prompt_ids(*tok, cfg.sample_prompt);
  if (prompt.empty()) {
    const int64_t T = cfg.seq_len;
    std::vector<int32_t> xi(static_cast<size_t>(T)), yi(static_cast<size_t>(T));
    if (val && val->val_batches(1) > 0) val->val_batch(0, 1, 0, 1, xi.data(), yi.data());
    else train.sample(0, xi.data(), yi.data());  // (the run's first sample, whatever a resume's batch)
    prompt.assign(xi.begin(), xi.begin() + std::min<int64_t>(8, T));
  }
  return prompt;
}

SampleOptions sample_options(const TrainConfig& cfg, int64_t step) {
  SampleOptions so;
  so.max_new_tokens = cfg.sample_tokens;
  so.temperature = cfg.sample_temperature;
  so.top_k = cfg.sample_top_k;
  so.seed = cfg.seed + uint64_t(step);
  return so;
}

std::string sample_as_text(const std::vector<int32_t>& prompt, const std::vector<int32_t>& out,
                           const data::Tokenizer* tok) {
  if (tok) return tok->decode(prompt) + tok->decode(out);
  std::string s;
  for (int32_t t : out) s += std::to_string(t) + " ";
  return s;
}

CheckpointMeta checkpoint_meta(const TrainConfig& cfg, const model::GPTConfig& mc, int64_t step,
                               int64_t optimizer_steps, const std::string& vocabulary, int64_t consumed_samples) {
  CheckpointMeta meta;
  meta.step = step;
  meta.optimizer_steps = optimizer_steps;
  meta.data_position = step;
  meta.consumed_samples = consumed_samples;
  meta.seed = cfg.seed;
  meta.model = model::gpt_config_manifest(mc);
  meta.config_toml = config_to_toml(cfg);
  meta.vocabulary = vocabulary;
  return meta;
}

RunLog::RunLog(const TrainConfig& cfg, const std::string& metrics_path, int64_t start_step, bool lead, bool quiet,
               double flops_per_token, double peak_flops, double unigram)
    : cfg_(cfg), metrics_path_(metrics_path), start_step_(start_step), lead_(lead), quiet_(quiet),
      tokens_per_step_(double(cfg.batch_size * cfg.seq_len)), flops_per_token_(flops_per_token), peak_(peak_flops),
      unigram_(unigram) {
  if (!lead_) return;
  metrics_.open(metrics_path_, std::ios::app);
  LOOM_CHECK(metrics_.good(), "{}: cannot write the metrics", metrics_path_);
  if (start_step_ > 0) read_loss_points(metrics_path_, train_pts_, val_pts_);  // the steps before a resume
}

double RunLog::mfu(double tokens_per_s) {
  const double achieved = tokens_per_s * flops_per_token_;
  if (achieved > peak_) {
    // The steps run faster than the peak measured at the start: it was measured while the host
    // was busy. The achieved rate is a better lower bound for the peak.
    if (!raised_)
      say(fmt::format("note: the steps reach {:.1f} GFLOP/s, above the GEMM peak measured at the start ({:.1f}); "
                      "MFU is now a share of the former (`loom calibrate` measures this host once for every run)",
                      achieved / 1e9, peak_ / 1e9));
    raised_ = true;
    peak_ = achieved;
  }
  return achieved / peak_;
}

void RunLog::say(const std::string& line) const {
  if (lead_ && !quiet_) std::printf("%s\n", line.c_str()), std::fflush(stdout);
}

void RunLog::record(int64_t done, double loss, float lr, double grad_norm, double dt, double loss_scale) {
  train_time_ += dt;
  window_time_ += dt;
  ++window_steps_;
  if (!lead_) return;
  const double tps = tokens_per_step_ / dt;
  nlohmann::json j = {{"step", done}, {"loss", loss}, {"lr", lr}, {"grad_norm", grad_norm},
                      {"tokens_per_s", tps}, {"mfu", mfu(tps)},
                      {"time_s", seconds_since(t_start_)}};
  if (loss_scale > 0) j["loss_scale"] = loss_scale;
  metrics_ << j.dump() << "\n";
  metrics_.flush();
  check_metrics_write();
  train_pts_.push_back({double(done), loss});
}

// A metrics line that could not be written stops the run at once (the history would have a hole),
// naming the file and the reason.
void RunLog::check_metrics_write() {
  if (metrics_) return;
  const int err = errno;
  throw Error(fmt::format("{}: cannot write the metrics: {}", metrics_path_, err ? std::strerror(err) : "write failed"));
}

void RunLog::record_skip(int64_t done, float lr, double dt, double loss_scale) {
  train_time_ += dt;
  if (!lead_) return;
  nlohmann::json j{{"step", done}, {"skipped", true}, {"lr", lr}, {"time_s", seconds_since(t_start_)}};
  if (loss_scale > 0) j["loss_scale"] = loss_scale;
  metrics_ << j.dump() << "\n";
  metrics_.flush();
  check_metrics_write();
}

void RunLog::record_val(int64_t done, double val_loss) {
  if (lead_) {
    metrics_ << nlohmann::json{{"step", done}, {"val_loss", val_loss}}.dump() << "\n";
    metrics_.flush();
    check_metrics_write();
    val_pts_.push_back({double(done), val_loss});
  }
  say(fmt::format("step {:>6} | val loss {:.4f} (unigram {:.4f})", done, val_loss, unigram_));
}

void RunLog::progress(int64_t done, double loss, float lr, double grad_norm) {
  if (done % cfg_.log_every != 0 && done != cfg_.steps && done != start_step_ + 1) return;
  const double avg = window_time_ / double(window_steps_);
  say(fmt::format("step {:>6}/{} | loss {:.4f} | lr {:.2e} | norm {:.3f} | {:.0f} tok/s | MFU {:.1f}% | ETA {}", done,
                  cfg_.steps, loss, lr, grad_norm, tokens_per_step_ / avg, 100 * mfu(tokens_per_step_ / avg),
                  human_time(avg * double(cfg_.steps - done))));
  window_time_ = 0;
  window_steps_ = 0;
}

void RunLog::finish(const std::string& png, const std::string& title) {
  if (!lead_) return;
  metrics_.close();
  say(write_loss_curve(png, metrics_path_, title, train_pts_, val_pts_, unigram_));
}

void run_steps(const TrainConfig& cfg, RunLog& log, const LrSchedule& sched, const FaultInjection& fault, int rank,
               int ranks, int64_t start_step, int64_t updates, bool has_val, const RunHooks& hooks, TrainResult& res) {
  int64_t skipped_in_a_row = 0;
  int64_t checkpointed = -1;  // the step of this run's last checkpoint
  // A signal received while the run was being set up stops it before its first step; the time
  // limit lets it make one step (Megatron-LM's rule: a run resumed past its limit still moves).
  if (start_step < cfg.steps && hooks.stop) {
    if (const int why = hooks.stop(); why != 0 && why != kStopTimeLimit) {
      res.stopped = why;
      res.steps_done = start_step;
      return;
    }
  }
  for (int64_t step = start_step; step < cfg.steps; ++step) {
    const std::string poison = fault.maybe_fire(rank, ranks, step + 1);
    if (!poison.empty()) {
      LOOM_CHECK(hooks.poison, "LOOM_FAULT_INJECT kind={}: this trainer has no such aid", poison);
      hooks.poison(poison);
    }
    auto t0 = Clock::now();
    const float lr = sched.at(updates);
    const StepOut st = hooks.step(step, lr);
    const int64_t done = step + 1;
    if (st.overflow) {
      // fp16's loss scaling: the engine skipped the update and halved the scale (it stops the
      // run itself when the scale would fall below train.loss_scale_min).
      log.say(fmt::format("step {}: the gradients overflow f16 at loss scale {:g}: step skipped, the scale halved",
                          done, st.loss_scale));
      log.record_skip(done, lr, seconds_since(t0), st.loss_scale);
    } else if (st.skipped || !std::isfinite(st.loss) || !std::isfinite(st.grad_norm)) {
      const std::string what = fmt::format("step {}: the loss is {:.6g} and the gradient norm {:.6g}{}", done, st.loss,
                                           st.grad_norm, st.nonfinite.empty() ? "" : "; first non-finite: " + st.nonfinite);
      LOOM_CHECK(st.skipped, "{} (diverged, and the update could not be skipped); lower optim.lr or raise "
                 "optim.warmup_steps", what);
      ++skipped_in_a_row;
      if (skipped_in_a_row > cfg.skip_nonfinite)
        throw Error(fmt::format("{}: {} step{} in a row not finite (train.skip_nonfinite = {}): diverged; lower "
                                "optim.lr or raise optim.warmup_steps (the checkpoints before are kept)",
                                what, skipped_in_a_row, skipped_in_a_row > 1 ? "s" : "", cfg.skip_nonfinite));
      log.say(fmt::format("{}: step skipped, no update ({} of train.skip_nonfinite = {} in a row)", what,
                          skipped_in_a_row, cfg.skip_nonfinite));
      log.record_skip(done, lr, seconds_since(t0), st.loss_scale);
    } else {
      skipped_in_a_row = 0;
      ++updates;
      log.record(done, st.loss, lr, st.grad_norm, seconds_since(t0), st.loss_scale);
      res.last_loss = st.loss;
    }
    res.steps_done = done;
    // A run that ends inside a streak of non-finite steps has diverged: its weights are those of
    // the last finite step, whose next forward was not finite. It fails, and writes no checkpoint
    // over the good ones.
    if (done == cfg.steps && skipped_in_a_row > 0)
      throw Error(fmt::format("step {}: the run ends after {} step{} in a row not finite (the last finite one at step "
                              "{}): diverged; lower optim.lr or raise optim.warmup_steps (no checkpoint of it is "
                              "written; the checkpoints before are kept)",
                              done, skipped_in_a_row, skipped_in_a_row > 1 ? "s" : "", done - skipped_in_a_row));
    if (cfg.eval_every > 0 && (done % cfg.eval_every == 0 || done == cfg.steps) && has_val) {
      res.last_val_loss = hooks.evaluate();
      log.record_val(done, res.last_val_loss);
      if (!std::isfinite(res.last_val_loss))
        throw Error(fmt::format("step {}: the validation loss is {:.6g}: diverged; lower optim.lr or raise "
                                "optim.warmup_steps (no checkpoint of it is written; the checkpoints before are kept)",
                                done, res.last_val_loss));
    }
    if (skipped_in_a_row == 0 && !st.overflow) log.progress(done, st.loss, lr, st.grad_norm);
    if (cfg.sample_every > 0 && done % cfg.sample_every == 0 && done != cfg.steps)
      log.say(fmt::format("--- sample at step {} ---\n{}\n---", done, hooks.sample(done)));
    if ((cfg.checkpoint_every > 0 && done % cfg.checkpoint_every == 0) || done == cfg.steps) {
      // Not inside a streak of non-finite steps (its weights may be what diverges): the next
      // checkpoint after the streak ends is written as usual.
      if (skipped_in_a_row > 0)
        log.say(skipped_in_a_row > 1
                    ? fmt::format("step {}: checkpoint not written: the last {} steps were not finite", done,
                                  skipped_in_a_row)
                    : fmt::format("step {}: checkpoint not written: the last step was not finite", done));
      else
        hooks.checkpoint(checkpointed = done);
    }
    if (done < cfg.steps && hooks.stop && (res.stopped = hooks.stop()) != 0) {
      // Not inside a streak of non-finite steps, as above: the run resumes from the checkpoint
      // before it.
      if (skipped_in_a_row == 0 && checkpointed != done) hooks.checkpoint(checkpointed = done);
      break;
    }
  }
  res.stop_checkpoint = checkpointed;
  res.train_seconds = log.train_seconds();
}

}  // namespace loom::train

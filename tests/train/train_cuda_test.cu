// `loom train --train.device cuda` end to end, through the loom executable, on the tiny pattern
// corpus (tests/cli_util.h): losses against the CPU trainer, resume from a checkpoint,
// checkpoints that cross devices (resumed on the other device, loaded by `loom generate` on the
// CPU), cuDNN's attention against loom's, and data parallelism over GPU processes under mpirun
// against one GPU, `--plan auto` for a GPU. Skipped without a GPU, except the GPU trainer's config
// checks and --plan auto's refusal of ranks sharing a GPU. Host code only: compiled by the C++ compiler.
//
// Tolerances:
//  - GPU against CPU, 2e-2 relative on every step's loss and on the validation loss: the GPU
//    computes in bf16 (weights' compute copies, activations, logits; 8 significant bits, a
//    relative rounding of up to 2^-9 = 2e-3 each) with f32 accumulation and f32 master weights,
//    the CPU in f32 throughout. The first step's loss differs by a few 1e-3; twenty AdamW steps
//    (updates normalised by the second moment, so small gradient differences still move weights
//    by about lr) let the trajectories drift apart by a few times that.
//  - A resumed GPU run against the uninterrupted one, 1e-3 relative: the checkpoint restores the
//    f32 master weights, both moments and the step count exactly, so the runs differ only where
//    the GPU sums in a varying order: f32 atomics in the token-embedding gradient and in the
//    attention's dq, flash's and cuDNN's (kernels/cuda/embedding.cuh, attention.cuh,
//    cudnn_attention.cuh). Those change last bits (about 1e-7 relative) of a few gradients per
//    step, and through the bf16 rounding of the weights' compute copies a few weights by one bf16
//    step; over ten steps that stays far below 1e-3.
//    Each process also times its GEMMs' candidate algorithms (LOOM_GEMM_TUNE) and may keep other
//    ones than the run before it did: algorithms differ in how they split and order the same sums
//    (tiles, split-K), so this too changes only last bits.
//  - Data-parallel GPU processes against one GPU, 1e-3 relative, for the same reason: two
//    processes with grad_accum a against one with 2a run the same micro-batches (the ranks' shares
//    are the single run's micro-batches) in the same shapes, so they differ where the sums' order
//    does: the atomics above, and the replicas' gradients added after their backward instead of
//    accumulated into one buffer during it. Validation covers the same sequences in the same
//    shapes too (one validation batch of twice the sequences, split over the ranks, against two).
//    Ranks training on the same sequences instead of their own shares are caught by far: on this
//    corpus a batch of 4 sequences against 8 moves the losses by 2-7% from step 4 on; a wrong
//    gradient scale (a factor dp) by the norms. The gradient norms get 1e-2: a norm adds up the
//    squares of many gradients each carrying that noise, and late in the run, with the
//    gradients small, the noise weighs more (the CPU comparison gives the norms 5 times the
//    losses' tolerance for the same reason); a factor dp is still 100 times that.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "cli_util.h"
#include "core/error.h"
#include "data/loader.h"
#include "kernels/cuda/cuda_test_util.h"
#include "comm/nccl_comm.h"
#include "kernels/cuda/cudnn_attention.cuh"
#include "train/mesh_layouts.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::test;

namespace {

constexpr double kCpuTol = 2e-2;     // GPU (bf16) against CPU (f32); see the top of the file
constexpr double kResumeTol = 1e-3;  // resumed GPU run against the uninterrupted one
// Gradient norms, GPU against CPU: a norm adds the squares of gradients each carrying bf16 error,
// so it differs more than the loss; 1e-1 still catches a wrong accumulation scale (a factor of
// grad_accum = 2 is a 50-100% difference), which the losses barely show under AdamW and clipping.
constexpr double kNormTol = 1e-1;
constexpr double kDpTol = 1e-3;      // data-parallel GPU processes against one GPU (see the top of the file)
constexpr double kDpNormTol = 1e-2;  // and their gradient norms

struct Fixture {
  fs::path root, data;
  explicit Fixture(const std::string& name) {
    root = fs::temp_directory_path() / fmt::format("loom_train_cuda_{}_{}", name, ::getpid());
    fs::remove_all(root);
    data = root / "data";
    write_pattern_corpus(data);
  }
  ~Fixture() { fs::remove_all(root); }

  // `loom train` of a 2-layer model with head size 64 (attention auto: cuDNN's where loom has it,
  // else flash), 20 steps, validation at steps 10 and 20; `extra` adds or overrides flags.
  CliRun train(const std::string& device, const std::string& out, const std::string& extra = "",
               const std::string& env = "") const {
    fs::create_directories(root / "logs");
    const std::string args = fmt::format(
        "train --data.dir '{}' --train.out_dir '{}' --train.device {} --model.n_layer 2 --model.n_head 2 "
        "--model.n_embd 128 --data.seq_len 64 --train.batch_size 8 --train.steps 20 --train.eval_every 10 "
        "--train.eval_batches 2 --train.sample_tokens 0 --train.threads 2 --train.seed 7 --optim.lr 1e-3 "
        "--optim.warmup_steps 5 --train.checkpoint_every 5 --train.keep_checkpoints 10 {}",
        data.string(), (root / out).string(), device, extra);
    return loom_cli(args, root / "logs", env);
  }
  std::map<int64_t, double> metrics(const std::string& out, const char* key) const {
    return read_metrics(root / out / "metrics.jsonl", key);
  }
};

// Every step of `want` in [first, last] is in `got` within rel relative.
void expect_close(const std::map<int64_t, double>& got, const std::map<int64_t, double>& want, int64_t first,
                  int64_t last, double rel, const std::string& what) {
  for (int64_t s = first; s <= last; ++s) {
    if (!want.count(s)) continue;
    ASSERT_TRUE(got.count(s)) << what << ": no value at step " << s;
    const double g = got.at(s), w = want.at(s);
    EXPECT_TRUE(std::isfinite(g)) << what << " at step " << s;
    EXPECT_LE(std::abs(g - w), rel * std::abs(w)) << what << " at step " << s << ": " << g << " vs " << w;
  }
}

std::vector<int32_t> ints_of(const std::string& s) {
  std::istringstream in(s);
  std::vector<int32_t> v;
  int32_t x;
  while (in >> x) v.push_back(x);
  return v;
}

}  // namespace

// run_training takes configs that did not come through load_config: what the GPU trainer
// lacks is refused naming the field, and a machine without a GPU is told so (with one, the run
// stops at the missing data directory). Needs no GPU.
TEST(CudaTrain, RunTrainingCudaChecksTheConfig) {
  train::TrainConfig c;
  c.data_dir = (fs::temp_directory_path() / fmt::format("loom_cuda_no_data_{}", ::getpid())).string();
  c.out_dir = c.data_dir + "_out";
  c.device = "cuda";
  auto message = [&]() -> std::string {
    try {
      train::run_training(c, {});
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  c.dp = 2;  // ranks as threads: GPU ranks must be processes
  std::string m = message();
  EXPECT_NE(m.find("parallel.comm"), std::string::npos) << m;
  c.dp = 1;
  c.cp = 2;  // ring attention needs kernels that keep no probabilities
  c.cuda_attention = "gemm";
  m = message();
  EXPECT_NE(m.find("parallel.cp"), std::string::npos) << m;
  c.cp = 1;
  c.cuda_attention = "auto";
  m = message();
  EXPECT_TRUE(m.find("no CUDA device") != std::string::npos || m.find(c.data_dir) != std::string::npos) << m;
  c.device = "gpu";
  m = message();
  EXPECT_NE(m.find("train.device"), std::string::npos) << m;
  fs::remove_all(c.out_dir);
}

TEST(CudaTrain, LossesMatchTheCpuTrainer) {
  LOOM_REQUIRE_GPU();
  LOOM_REQUIRE_LOOM();
  Fixture f("parity");
  // grad_accum 1 replays the whole-step graph; 2 the accumulating forward + backward graph and
  // a separate update.
  for (int accum : {1, 2}) {
    SCOPED_TRACE(fmt::format("grad_accum {}", accum));
    const std::string extra = fmt::format("--quiet --train.grad_accum {}", accum);
    const std::string cpu = fmt::format("cpu{}", accum), gpu = fmt::format("gpu{}", accum);
    CliRun c = f.train("cpu", cpu, extra);
    ASSERT_EQ(c.code, 0) << c.err;
    CliRun g = f.train("cuda", gpu, extra);
    ASSERT_EQ(g.code, 0) << g.err;
    const auto lc = f.metrics(cpu, "loss"), lg = f.metrics(gpu, "loss");
    ASSERT_EQ(lc.size(), 20u);
    ASSERT_EQ(lg.size(), 20u);
    expect_close(lg, lc, 1, 20, kCpuTol, "loss");
    const auto vc = f.metrics(cpu, "val_loss"), vg = f.metrics(gpu, "val_loss");
    ASSERT_EQ(vc.size(), 2u);
    expect_close(vg, vc, 10, 20, kCpuTol, "val_loss");
    EXPECT_LT(lg.at(20), lg.at(1) - 0.5) << "the GPU run did not learn";
    const auto nc = f.metrics(cpu, "grad_norm"), ng = f.metrics(gpu, "grad_norm");
    ASSERT_EQ(ng.size(), 20u);
    expect_close(ng, nc, 1, 20, kNormTol, "grad_norm");
    // The same metrics keys as the CPU trainer's, with a positive rate and utilisation.
    const auto tps = f.metrics(gpu, "tokens_per_s"), mfu = f.metrics(gpu, "mfu");
    ASSERT_EQ(tps.size(), 20u);
    ASSERT_EQ(mfu.size(), 20u);
    EXPECT_GT(tps.at(20), 0);
    EXPECT_GT(mfu.at(20), 0);
    EXPECT_LT(mfu.at(20), 1);
  }
}

TEST(CudaTrain, ResumeMatchesTheUninterruptedRun) {
  LOOM_REQUIRE_GPU();
  LOOM_REQUIRE_LOOM();
  Fixture f("resume");
  for (int accum : {1, 2}) {
    SCOPED_TRACE(fmt::format("grad_accum {}", accum));
    const std::string extra = fmt::format("--quiet --train.grad_accum {}", accum);
    const std::string full = fmt::format("full{}", accum), cut = fmt::format("cut{}", accum);
    CliRun a = f.train("cuda", full, extra);
    ASSERT_EQ(a.code, 0) << a.err;
    // Stops at the start of step 11, after the step-10 checkpoint.
    CliRun b = f.train("cuda", cut, extra, "LOOM_FAULT_INJECT=rank=0,step=11,kind=exit");
    ASSERT_EQ(b.code, 3) << b.err;
    EXPECT_EQ(f.metrics(cut, "loss").size(), 10u);
    CliRun r = f.train("cuda", cut, extra + " --resume");
    ASSERT_EQ(r.code, 0) << r.err;
    const auto la = f.metrics(full, "loss"), lr = f.metrics(cut, "loss");
    ASSERT_EQ(lr.size(), 20u);
    expect_close(lr, la, 1, 20, kResumeTol, "loss");
    expect_close(f.metrics(cut, "val_loss"), f.metrics(full, "val_loss"), 10, 20, kResumeTol, "val_loss");
  }
}

// train.precision fp16: f16 compute with dynamic loss scaling (train/loss_scale.h).
//  - Losses within kCpuTol of the bf16 run and of the CPU's f32 run at every step: f16 rounds to 11
//    significant bits where bf16 rounds to 8, so fp16 sits closer to f32 than bf16 does, and the
//    bf16 bound (see the top of the file) holds for it too. The gradient norms within kNormTol of
//    the CPU's: the update divides the gradients by the scale exactly once (not dividing would put
//    them 1024 times or more above, dividing twice as far below).
//  - The scale is in every metrics line and doubles after train.loss_scale_window clean steps:
//    1024 x 2^floor((s - 1) / 6) at step s, exactly. The scales stay small enough (the loss
//    gradient at most 8192 / 512 counted targets = 16) that nothing overflows on its own.
//  - An injected overflow (LOOM_FAULT_INJECT kind=overflow: step 8 at 2^16 times the scale, so the
//    loss gradient of a target is about 2^26 / 512 = 131072, past f16's 65504) is skipped (its
//    metrics line says so, with the scale it ran at), the scale halves to 512, and the run goes on
//    learning: steps 1-7 equal the uninterrupted run's (kResumeTol: same work), step 20's loss is
//    below step 9's and within 10% of the uninterrupted run's (one AdamW update of twenty missing).
//  - A run resumed from its step-10 checkpoint continues at the checkpoint's scale and clean-step
//    count: the same scales at steps 11-20 as the uninterrupted run.
TEST(CudaTrain, Fp16LossScalingTracksBf16AndRecoversFromAnOverflow) {
  LOOM_REQUIRE_GPU();
  LOOM_REQUIRE_LOOM();
  Fixture f("fp16");
  const std::string fp16 = "--quiet --train.precision fp16 --train.loss_scale_init 1024 --train.loss_scale_window 6";
  CliRun c = f.train("cpu", "cpu", "--quiet");
  ASSERT_EQ(c.code, 0) << c.err;
  CliRun b = f.train("cuda", "bf16", "--quiet");
  ASSERT_EQ(b.code, 0) << b.err;
  CliRun h = f.train("cuda", "fp16", fp16);
  ASSERT_EQ(h.code, 0) << h.err;
  const auto lc = f.metrics("cpu", "loss"), lb = f.metrics("bf16", "loss"), lh = f.metrics("fp16", "loss");
  ASSERT_EQ(lh.size(), 20u);
  expect_close(lh, lb, 1, 20, kCpuTol, "fp16 against bf16");
  expect_close(lh, lc, 1, 20, kCpuTol, "fp16 against the CPU's f32");
  EXPECT_LT(lh.at(20), lh.at(1) - 0.5) << "the fp16 run did not learn";
  expect_close(f.metrics("fp16", "grad_norm"), f.metrics("cpu", "grad_norm"), 1, 20, kNormTol, "fp16 grad_norm");
  double worst_b = 0, worst_c = 0;
  for (int64_t s = 1; s <= 20; ++s) {
    worst_b = std::max(worst_b, std::abs(lh.at(s) - lb.at(s)) / lb.at(s));
    worst_c = std::max(worst_c, std::abs(lh.at(s) - lc.at(s)) / lc.at(s));
  }
  std::printf("fp16: worst relative loss difference over 20 steps %.2e against bf16, %.2e against f32\n", worst_b,
              worst_c);
  EXPECT_TRUE(f.metrics("bf16", "loss_scale").empty()) << "a bf16 run reports a loss scale";
  const auto sh = f.metrics("fp16", "loss_scale");
  ASSERT_EQ(sh.size(), 20u);
  for (int64_t s = 1; s <= 20; ++s) EXPECT_EQ(sh.at(s), 1024.0 * double(1 << ((s - 1) / 6))) << "step " << s;

  CliRun o = f.train("cuda", "overflow", fp16 + " --train.loss_scale_window 1000",
                     "LOOM_FAULT_INJECT=rank=0,step=8,kind=overflow");
  ASSERT_EQ(o.code, 0) << o.err;
  // Step 8's line is the skipped step's (a scale and no loss).
  const auto lo = f.metrics("overflow", "loss"), so = f.metrics("overflow", "loss_scale");
  ASSERT_EQ(lo.size(), 19u) << "step 8 should have no loss line";
  EXPECT_FALSE(lo.count(8));
  ASSERT_EQ(so.size(), 20u);
  for (int64_t s = 1; s <= 20; ++s)
    EXPECT_EQ(so.at(s), s < 8 ? 1024.0 : s == 8 ? 1024.0 * 65536 : 512.0) << "step " << s;
  CliRun clean = f.train("cuda", "clean", fp16 + " --train.loss_scale_window 1000");
  ASSERT_EQ(clean.code, 0) << clean.err;
  const auto lclean = f.metrics("clean", "loss");
  expect_close(lo, lclean, 1, 7, kResumeTol, "before the overflow");
  EXPECT_LT(lo.at(20), lo.at(9)) << "no learning after the overflow";
  EXPECT_LE(std::abs(lo.at(20) - lclean.at(20)), 0.1 * lclean.at(20))
      << "step 20 after a skipped step: " << lo.at(20) << " against " << lclean.at(20);
  std::printf("fp16 overflow at step 8: step 20's loss %.4f against %.4f without it\n", lo.at(20), lclean.at(20));

  CliRun cut = f.train("cuda", "cut", fp16, "LOOM_FAULT_INJECT=rank=0,step=11,kind=exit");
  ASSERT_EQ(cut.code, 3) << cut.err;
  CliRun r = f.train("cuda", "cut", fp16 + " --resume");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto sr = f.metrics("cut", "loss_scale");
  ASSERT_EQ(sr.size(), 20u);
  for (int64_t s = 11; s <= 20; ++s) EXPECT_EQ(sr.at(s), sh.at(s)) << "resumed, step " << s;
  expect_close(f.metrics("cut", "loss"), lh, 11, 20, kResumeTol, "resumed fp16 loss");
}

TEST(CudaTrain, CheckpointsResumeOnTheOtherDevice) {
  LOOM_REQUIRE_GPU();
  LOOM_REQUIRE_LOOM();
  Fixture f("cross");
  const std::string extra = "--quiet --train.grad_accum 2";
  const std::string kill = "LOOM_FAULT_INJECT=rank=0,step=11,kind=exit";
  const std::pair<const char*, const char*> runs[] = {{"cpu", "cpu"}, {"cuda", "gpu"}};  // device, name
  for (const auto& [device, name] : runs) {
    CliRun full = f.train(device, fmt::format("{}_full", name), extra);
    ASSERT_EQ(full.code, 0) << full.err;
    CliRun cut = f.train(device, fmt::format("{}_cut", name), extra, kill);
    ASSERT_EQ(cut.code, 3) << cut.err;
  }
  // The CPU run's step-10 checkpoint (weights and AdamW moments) continues on the GPU, the GPU
  // run's on the CPU: each within the bf16 tolerance of the run that was not interrupted.
  CliRun g = f.train("cuda", "cpu_cut", extra + " --resume");
  ASSERT_EQ(g.code, 0) << g.err;
  expect_close(f.metrics("cpu_cut", "loss"), f.metrics("cpu_full", "loss"), 11, 20, kCpuTol, "CPU -> GPU loss");
  expect_close(f.metrics("cpu_cut", "val_loss"), f.metrics("cpu_full", "val_loss"), 20, 20, kCpuTol,
               "CPU -> GPU val_loss");
  CliRun c = f.train("cpu", "gpu_cut", extra + " --resume");
  ASSERT_EQ(c.code, 0) << c.err;
  expect_close(f.metrics("gpu_cut", "loss"), f.metrics("gpu_full", "loss"), 11, 20, kCpuTol, "GPU -> CPU loss");
  expect_close(f.metrics("gpu_cut", "val_loss"), f.metrics("gpu_full", "val_loss"), 20, 20, kCpuTol,
               "GPU -> CPU val_loss");
}

// train.cuda_attention = cudnn trains like loom's flash attention, with the loss tolerance of the
// CPU comparison: the two kernels both compute in bf16 with f32 accumulation but round
// differently in every attention output (other tiling, other exponentials), a systematic
// difference of the kind bf16 against f32 is, confined to attention.
TEST(CudaTrain, CudnnAttentionTrainsLikeFlash) {
  LOOM_REQUIRE_CUDNN();
  LOOM_REQUIRE_LOOM();
  Fixture f("cudnn");
  CliRun a = f.train("cuda", "flash", "--quiet --train.cuda_attention flash");
  ASSERT_EQ(a.code, 0) << a.err;
  CliRun b = f.train("cuda", "cudnn", "--train.cuda_attention cudnn");
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_NE(b.out.find("| cudnn attention |"), std::string::npos) << b.out;
  const auto la = f.metrics("flash", "loss"), lb = f.metrics("cudnn", "loss");
  ASSERT_EQ(lb.size(), 20u);
  expect_close(lb, la, 1, 20, kCpuTol, "loss");
  expect_close(f.metrics("cudnn", "val_loss"), f.metrics("flash", "val_loss"), 10, 20, kCpuTol, "val_loss");
}

// train.cuda_attention = auto takes cuDNN's attention where loom has a cuDNN it takes (9.16 or
// newer), else loom's flash kernels. LOOM_GEMM_TUNE=0 (cuBLASLt's first choices, the bias
// gradient from the epilogue) trains like the default tuned run within the resume tolerance: the
// GEMM algorithms differ only in the order of their sums. A value other than 0, 1 or 2 is refused,
// naming the variable.
TEST(CudaTrain, AutoAttentionAndGemmTuning) {
  LOOM_REQUIRE_GPU();
  LOOM_REQUIRE_LOOM();
  Fixture f("auto");
  const bool cudnn = cuda::cudnn_available() && cuda::cudnn_runtime_version() >= 91600;
  CliRun a = f.train("cuda", "tuned", "", "LOOM_GEMM_TUNE=2");
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_NE(a.out.find(cudnn ? "| cudnn attention |" : "| flash attention |"), std::string::npos) << a.out;
  EXPECT_NE(a.err.find("gemm tune "), std::string::npos) << "no GEMM was timed: " << a.err;
  CliRun b = f.train("cuda", "untuned", "--quiet", "LOOM_GEMM_TUNE=0");
  ASSERT_EQ(b.code, 0) << b.err;
  expect_close(f.metrics("untuned", "loss"), f.metrics("tuned", "loss"), 1, 20, kResumeTol, "loss");
  CliRun c = f.train("cuda", "bad", "--quiet", "LOOM_GEMM_TUNE=yes");
  EXPECT_NE(c.code, 0);
  EXPECT_NE(c.err.find("LOOM_GEMM_TUNE"), std::string::npos) << c.err;
}

// Data parallelism on GPUs: two processes under mpirun, each on its share of every batch, against
// one GPU running the same micro-batches (grad_accum 2a against a), for a = 1 and 2. On a host
// with one GPU the two processes share it and their gradients are summed through host memory
// (the staged path); with two GPUs each takes its own and NCCL sums them.
TEST(CudaTrain, DataParallelProcessesMatchOneGpu) {
  LOOM_REQUIRE_GPU();
  LOOM_REQUIRE_LOOM();
  const std::string mpirun = mpirun_prefix(2);
  if (mpirun.empty()) GTEST_SKIP() << "needs loom built with MPI and mpirun on PATH";
  Fixture f("dp");
  const char* path = comm::nccl_available() && cuda_device_count() >= 2 ? "nccl" : "staged";
  for (int accum : {1, 2}) {
    SCOPED_TRACE(fmt::format("grad_accum {} on 2 processes", accum));
    const std::string one = fmt::format("one{}", accum), two = fmt::format("dp{}", accum);
    CliRun a = f.train("cuda", one, fmt::format("--quiet --train.grad_accum {}", 2 * accum));
    ASSERT_EQ(a.code, 0) << a.err;
    CliRun b = f.train("cuda", two,
                       fmt::format("--train.grad_accum {} --parallel.dp 2 --parallel.comm mpi",
                                   accum),
                       mpirun);
    ASSERT_EQ(b.code, 0) << b.out << b.err;
    EXPECT_NE(b.out.find(fmt::format("dp 2 (mpi processes, gradients reduced by {})", path)), std::string::npos)
        << b.out;
    const auto l1 = f.metrics(one, "loss"), l2 = f.metrics(two, "loss");
    ASSERT_EQ(l1.size(), 20u);
    ASSERT_EQ(l2.size(), 20u) << "one metrics line per step, from rank 0 only";
    expect_close(l2, l1, 1, 20, kDpTol, "loss");
    ASSERT_EQ(f.metrics(two, "val_loss").size(), 2u);
    expect_close(f.metrics(two, "val_loss"), f.metrics(one, "val_loss"), 10, 20, kDpTol, "val_loss");
    expect_close(f.metrics(two, "grad_norm"), f.metrics(one, "grad_norm"), 1, 20, kDpNormTol, "grad_norm");
    EXPECT_LT(l2.at(20), l2.at(1) - 0.5) << "the data-parallel run did not learn";
  }
  // It resumes from its checkpoint and goes on.
  CliRun r = f.train("cuda", "dp2",
                     "--quiet --train.grad_accum 2 --parallel.dp 2 --parallel.comm mpi "
                     "--resume --train.steps 25 --optim.decay_steps 20",
                     mpirun);
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_EQ(f.metrics("dp2", "loss").size(), 25u);
}

// The mesh engine on the GPU (train/engine.h's make_mesh_engine: tensor / sequence / context /
// pipeline parallelism, ZeRO 1-3, offload and recomputation, ranks as threads sharing the GPU,
// their collectives and the stages' transfers staged through host memory) against one GPU's replica engine on the same
// micro-batches (grad_accum 2 against dp 2 or two pipeline micro-batches).
// dp x ZeRO / offload, pp: kDpTol and kDpNormTol, the data-parallel processes' bounds (the same
// micro-batches in the same shapes, f32 gradient sums, a tied wte's two stages' gradients added
// after their backward; the norm formed in double here, in f32 there), and one rank recomputing.
// tp (+ sp) and cp: kCpuTol
// and kNormTol, the bounds of the CPU comparison: a row-parallel layer's partial products are
// rounded to bf16 on each rank before their sum, and ring attention's partial outputs and query
// gradients are rounded to bf16 before their f32 sums, one more bf16 rounding per layer than one
// GPU makes, as the CPU's f32 differs by one. Each run learns; four (ZeRO-2 + offload, tp x dp x
// ZeRO-1, tp x pp, dp x cp x ZeRO-2) stopped after step 10 and resumed give their uninterrupted
// runs' losses.
TEST(CudaTrain, MeshLayoutsOnThreadsSharingTheGpuMatchOneGpu) {
  LOOM_REQUIRE_GPU();
  LOOM_REQUIRE_LOOM();
  Fixture f("mesh");
  CliRun a = f.train("cuda", "one", "--quiet --train.grad_accum 2");
  ASSERT_EQ(a.code, 0) << a.err;
  const auto l1 = f.metrics("one", "loss"), n1 = f.metrics("one", "grad_norm");
  ASSERT_EQ(l1.size(), 20u);
  for (const MeshLayout& c : kMeshLayouts) {
    SCOPED_TRACE(c.out);
    CliRun b = f.train("cuda", c.out, fmt::format("--train.eval_batches 2 {}", c.flags));
    ASSERT_EQ(b.code, 0) << b.out << b.err;
    EXPECT_NE(b.out.find("cuda:"), std::string::npos) << b.out;
    EXPECT_NE(b.out.find(c.header), std::string::npos) << b.out;
    const auto l2 = f.metrics(c.out, "loss"), n2 = f.metrics(c.out, "grad_norm");
    ASSERT_EQ(l2.size(), 20u);
    expect_close(l2, l1, 1, 20, c.tp ? kCpuTol : kDpTol, "loss");
    expect_close(n2, n1, 1, 20, c.tp ? kNormTol : kDpNormTol, "grad_norm");
    expect_close(f.metrics(c.out, "val_loss"), f.metrics("one", "val_loss"), 10, 20, c.tp ? kCpuTol : kDpTol,
                 "val_loss");
    EXPECT_LT(l2.at(20), l2.at(1) - 0.5) << "the run did not learn";
  }
  // Stopped at the start of step 11 (after the step-10 checkpoint) and resumed: the uninterrupted
  // run's losses within kResumeTol (the master weights, both moments, offloaded or not, and the
  // step count restored exactly; see the top of the file).
  for (const MeshLayout& c : kMeshLayouts) {
    if (!c.resumed) continue;
    const std::string name = c.out;
    SCOPED_TRACE(name + " resumed");
    const std::string cut = name + "_cut", flags = fmt::format("--quiet --train.eval_batches 2 {}", c.flags);
    CliRun b = f.train("cuda", cut, flags, "LOOM_FAULT_INJECT=rank=0,step=11,kind=exit");
    ASSERT_EQ(b.code, 3) << b.err;
    EXPECT_EQ(f.metrics(cut, "loss").size(), 10u);
    CliRun r = f.train("cuda", cut, flags + " --resume");
    ASSERT_EQ(r.code, 0) << r.out << r.err;
    const auto lr = f.metrics(cut, "loss");
    ASSERT_EQ(lr.size(), 20u);
    expect_close(lr, f.metrics(name, "loss"), 1, 20, kResumeTol, "loss");
    expect_close(f.metrics(cut, "val_loss"), f.metrics(name, "val_loss"), 10, 20, kResumeTol, "val_loss");
  }
}

// `loom train --plan auto` on the GPU plans one GPU per rank (the built-in profile of this host's
// GPU, its memory): ranks that would share a GPU are refused (needs no GPU); one GPU's run takes
// the first choice that fits and trains with it, and a limit nothing fits is refused naming the
// GPU and what the least demanding layout needs.
TEST(CudaTrain, PlanAutoPlansOneGpuPerRank) {
  LOOM_REQUIRE_LOOM();
  Fixture f("plan_auto");
  CliRun shared = f.train("cuda", "shared", "--quiet --parallel.tp 2 --plan auto");
  EXPECT_NE(shared.code, 0);
  EXPECT_NE(shared.err.find("--plan auto: plans one GPU per rank, and with parallel.comm = threads the 2 ranks would "
                            "share one GPU"),
            std::string::npos)
      << shared.err;
  LOOM_REQUIRE_GPU();
  CliRun run = f.train("cuda", "auto", "--plan auto");
  ASSERT_EQ(run.code, 0) << run.out << run.err;
  EXPECT_NE(run.out.find("plan auto: "), std::string::npos) << run.out;
  EXPECT_NE(run.out.find(" layouts of 1 NVIDIA"), std::string::npos) << run.out;
  EXPECT_NE(run.out.find("; chose dp=1,"), std::string::npos) << run.out;
  const auto loss = f.metrics("auto", "loss");
  ASSERT_EQ(loss.size(), 20u);
  EXPECT_LT(loss.at(20), loss.at(1) - 0.5) << "the run did not learn";
  CliRun none = f.train("cuda", "none", "--quiet --plan auto --train.memory_limit 1000000");
  EXPECT_NE(none.code, 0);
  EXPECT_NE(none.err.find("--plan auto: no layout of 1 NVIDIA"), std::string::npos) << none.err;
  EXPECT_NE(none.err.find("the least any needs is"), std::string::npos) << none.err;
}

// fp16 over two GPU processes against one GPU (grad_accum 2 there): the replicas' scaled gradients
// are summed and unscaled by 1 / (dp x S) as the single GPU's two micro-batches are by
// 1 / (grad_accum x S), so the losses agree within kDpTol (see the top of the file). An overflow
// injected at step 5 (into every rank's step: the scale is the job's) makes both ranks skip the
// step and halve the scale together (the single run, injected at the same step, likewise), and the
// runs agree again after it; the gradient norms within kDpNormTol.
TEST(CudaTrain, Fp16DataParallelProcessesMatchOneGpu) {
  LOOM_REQUIRE_GPU();
  LOOM_REQUIRE_LOOM();
  const std::string mpirun = mpirun_prefix(2);
  if (mpirun.empty()) GTEST_SKIP() << "needs loom built with MPI and mpirun on PATH";
  Fixture f("fp16_dp");
  const std::string fp16 = "--quiet --train.precision fp16 --train.loss_scale_init 1024";
  CliRun a = f.train("cuda", "one", fp16 + " --train.grad_accum 2", "LOOM_FAULT_INJECT=rank=0,step=5,kind=overflow");
  ASSERT_EQ(a.code, 0) << a.err;
  CliRun b = f.train("cuda", "two", fp16 + " --parallel.dp 2 --parallel.comm mpi",
                     "LOOM_FAULT_INJECT=rank=1,step=5,kind=overflow " + mpirun);
  ASSERT_EQ(b.code, 0) << b.out << b.err;
  const auto l1 = f.metrics("one", "loss"), l2 = f.metrics("two", "loss");
  ASSERT_EQ(l1.size(), 19u);
  ASSERT_EQ(l2.size(), 19u) << "step 5 skipped on every rank";
  EXPECT_FALSE(l2.count(5));
  expect_close(l2, l1, 1, 20, kDpTol, "loss");
  expect_close(f.metrics("two", "grad_norm"), f.metrics("one", "grad_norm"), 1, 20, kDpNormTol, "grad_norm");
  const auto s1 = f.metrics("one", "loss_scale"), s2 = f.metrics("two", "loss_scale");
  ASSERT_EQ(s2.size(), 20u);
  for (int64_t s = 6; s <= 20; ++s) {
    EXPECT_EQ(s2.at(s), 512.0) << "step " << s;
    EXPECT_EQ(s1.at(s), 512.0) << "step " << s;
  }
  EXPECT_LT(l2.at(20), l2.at(1) - 0.5) << "the data-parallel fp16 run did not learn";
}

// parallel.comm = nccl asks for NCCL itself: taken on a host with two GPUs; refused, naming the
// ranks and the GPU they share, when the processes would share one; refused as well by a build
// without NCCL.
TEST(CudaTrain, NcclCommNeedsAGpuPerProcess) {
  LOOM_REQUIRE_GPU();
  LOOM_REQUIRE_LOOM();
  const std::string mpirun = mpirun_prefix(2);
  if (mpirun.empty()) GTEST_SKIP() << "needs loom built with MPI and mpirun on PATH";
  Fixture f("nccl");
  CliRun r = f.train("cuda", "run", "--quiet --train.steps 4 --parallel.dp 2 --parallel.comm nccl", mpirun);
  if (!comm::nccl_available()) {
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.err.find("built without NCCL"), std::string::npos) << r.err;
  } else if (cuda_device_count() >= 2) {
    ASSERT_EQ(r.code, 0) << r.out << r.err;
    EXPECT_EQ(f.metrics("run", "loss").size(), 4u);
  } else {
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.err.find("share GPU"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("of 2 failed"), std::string::npos) << r.err;
  }
}

// A rank that throws ends every process of the job with an error naming it, and the checkpoint
// written before stays.
TEST(CudaTrain, DataParallelRankThatThrowsEndsTheJobNamingIt) {
  LOOM_REQUIRE_GPU();
  LOOM_REQUIRE_LOOM();
  const std::string mpirun = mpirun_prefix(2, true);
  if (mpirun.empty()) GTEST_SKIP() << "needs loom built with MPI and mpirun on PATH";
  Fixture f("dp_throw");
  const auto t0 = std::chrono::steady_clock::now();
  CliRun r = f.train("cuda", "run",
                     "--quiet --parallel.dp 2 --parallel.comm mpi --parallel.timeout_s 60 --train.checkpoint_every 2",
                     "LOOM_FAULT_INJECT=rank=1,step=4,kind=throw " + mpirun);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(r.code != 124 && r.code != 137) << "hang: killed by the test's deadline\n" << r.err;
  EXPECT_LT(s, 45.0) << "not aborted by the failure (the communicator timeout is 60 s)";
  EXPECT_NE(r.err.find("loom: rank 1 of 2 failed"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("fails on purpose at step 4"), std::string::npos) << r.err;
  const std::string ckpt = train::latest_checkpoint((f.root / "run").string());
  ASSERT_FALSE(ckpt.empty()) << r.err;
  EXPECT_EQ(train::read_checkpoint_meta(ckpt).step, 2);
}

TEST(CudaTrain, GpuCheckpointLoadsInCpuGenerate) {
  LOOM_REQUIRE_GPU();
  LOOM_REQUIRE_LOOM();
  Fixture f("generate");
  // The run prints its final sample, drawn on the CPU model from the GPU's weights at step 20
  // (seed train.seed + 20, the first 8 validation tokens as the prompt, no tokenizer: token ids).
  // Head size 32: the GEMM attention (the other tests run flash attention).
  CliRun g = f.train("cuda", "run", "--train.sample_tokens 16 --train.sample_top_k 40 --model.n_head 4");
  ASSERT_EQ(g.code, 0) << g.err;
  const std::string mark = "--- sample ---\n";
  const size_t at = g.out.find(mark);
  ASSERT_NE(at, std::string::npos) << g.out;
  const size_t end = g.out.find("\n---", at + mark.size());
  ASSERT_NE(end, std::string::npos) << g.out;
  const std::vector<int32_t> sample = ints_of(g.out.substr(at + mark.size(), end - at - mark.size()));
  ASSERT_EQ(sample.size(), 16u) << g.out;

  data::Loader val(f.data.string(), "val", 64, 7);
  std::vector<int32_t> x(64), y(64);
  val.val_batch(0, 1, 0, 1, x.data(), y.data());
  std::string prompt;
  for (int i = 0; i < 8; ++i) prompt += fmt::format("{}{}", i ? "," : "", x[size_t(i)]);

  // `loom generate` on the CPU reads the checkpoint the GPU run wrote last: recomputing the
  // whole window as the trainer's sampler does, the same weights give the same tokens.
  const std::string run = (f.root / "run").string();
  CliRun n = loom_cli(fmt::format("generate '{}' --ids --prompt {} --tokens 16 --seed 27 --top-k 40 --temperature 1 "
                                  "--no-cache --quiet",
                                  run, prompt),
                      f.root / "logs");
  ASSERT_EQ(n.code, 0) << n.err;
  const size_t bar = n.out.find('|');
  ASSERT_NE(bar, std::string::npos) << n.out;
  EXPECT_EQ(ints_of(n.out.substr(bar + 1)), sample) << n.out << "\nvs the run's sample\n" << g.out;
  // With the KV cache (the default): 16 tokens.
  CliRun k = loom_cli(fmt::format("generate '{}' --ids --prompt {} --tokens 16 --seed 27 --quiet", run, prompt),
                      f.root / "logs");
  ASSERT_EQ(k.code, 0) << k.err;
  ASSERT_NE(k.out.find('|'), std::string::npos) << k.out;
  EXPECT_EQ(ints_of(k.out.substr(k.out.find('|') + 1)).size(), 16u) << k.out;
}

// `loom train --train.device emu` end to end: every layout of the mesh engine on the emulated
// device (kernels/emu/backend.h: a device in host memory that runs the CPU's kernels), through the
// device paths a GPU takes (compute copies, activations and the groups' collectives in device
// memory, tokens uploaded, ZeRO-3's gathered compute copies, offload to the host pool), against
// one device, ranks as threads. The layouts are the GPU test's (tests/train/mesh_layouts.h).
//
// Tolerances:
//  - f32 compute, each layout against the CPU's single-device run (not the emulated one): 1e-5
//    relative on every step's loss, validation loss and gradient norm, the bound of the CPU's own
//    layouts against one device (tests/train/trainer_parallel_test.cpp for the losses, tests/
//    parallel/tensor/layout_equivalence_test.cpp for the norms): the layouts sum the same products
//    in other orders, and twenty AdamW steps carry those last bits along (measured: at most 1.1e-7
//    on a loss, 5.5e-7 on a norm). In f32 there are no compute copies; what the device paths add
//    to the CPU's layouts is where and when data moves (tokens uploaded, the groups' collectives
//    over the device's buffers, gradients reduced from its memory, offloaded state copied back):
//    a wrong gradient scale, a missed collective or a stage's activations sent before they were
//    written move the losses by 1e-3 or more.
//  - bf16 compute, against the emulated device's single-device run: 2e-2 (loss) and 1e-1 (norm)
//    for tp and cp, 1e-3 and 1e-2 for the others, the GPU test's bounds (tests/train/
//    train_cuda_test.cu), for the same reasons: one more bf16 rounding per layer under tp and cp,
//    the same micro-batches in the same shapes otherwise (measured: at most 8.9e-5 on a loss).
//    These runs read the parameters' bf16 compute copies, refreshed after every update and, under
//    ZeRO-3, converted from each gathered block: a stale or partly refreshed copy fails them.
//  - A run stopped after step 10 and resumed gives the uninterrupted run's losses exactly: the
//    checkpoint restores the f32 master weights, both moments and the step count, the compute
//    copies are rounded from the masters again, and every kernel here sums in a fixed order.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <span>
#include <string>

#include <fmt/format.h>

#include "cli_util.h"
#include "train/mesh_layouts.h"

namespace fs = std::filesystem;
using namespace loom;
using namespace loom::test;

namespace {

constexpr double kF32Tol = 1e-5, kF32NormTol = 1e-5;
constexpr double kBf16TpTol = 2e-2, kBf16TpNormTol = 1e-1;
constexpr double kBf16Tol = 1e-3, kBf16NormTol = 1e-2;

// A 2-layer GPT of head size 32.
constexpr const char* kGpt = "--model.n_layer 2 --model.n_head 2 --model.n_embd 64";
// A 2-layer Llama (RMSNorm, rotary positions, SwiGLU, no biases) of 4 query and 2 key/value heads
// of size 16.
constexpr const char* kLlama = "--model.preset llama-tiny";

// `loom train` of `model`, 20 steps, validation at steps 10 and 20.
CliRun train(const TrainScratch& s, const std::string& device, const std::string& out, const std::string& extra,
             const std::string& env = "", const char* model = kGpt) {
  return s.train(out,
                 fmt::format("--train.device {} {} --data.seq_len 32 --train.batch_size 8 --train.steps 20 "
                             "--train.eval_every 10 --train.eval_batches 2 --train.sample_tokens 0 --train.threads 2 "
                             "--train.seed 7 --optim.lr 1e-3 --optim.warmup_steps 5 --train.checkpoint_every 5 "
                             "--train.keep_checkpoints 10 {}",
                             device, model, extra),
                 env);
}

std::map<int64_t, double> metrics(const TrainScratch& s, const std::string& out, const char* key) {
  return read_metrics(s.root / out / "metrics.jsonl", key);
}

// Every step of `want` in [first, 20] is in `got` within rel relative; returns the largest
// relative difference.
double expect_close(const std::map<int64_t, double>& got, const std::map<int64_t, double>& want, int64_t first,
                    double rel, const std::string& what) {
  double worst = 0;
  for (int64_t s = first; s <= 20; ++s) {
    if (!want.count(s)) continue;
    EXPECT_TRUE(got.count(s)) << what << ": no value at step " << s;
    if (!got.count(s)) continue;
    const double g = got.at(s), w = want.at(s);
    EXPECT_TRUE(std::isfinite(g)) << what << " at step " << s;
    const double d = std::abs(g - w) / std::abs(w);
    worst = std::max(worst, d);
    EXPECT_LE(d, rel) << what << " at step " << s << ": " << g << " vs " << w;
  }
  return worst;
}

// Runs the layouts of `model` on the emulated device in `precision` against `one`'s run,
// printing the largest differences.
void run_layouts(const TrainScratch& s, std::span<const MeshLayout> layouts, const std::string& precision,
                 const std::string& one, bool f32, const char* model = kGpt) {
  const auto l1 = metrics(s, one, "loss"), n1 = metrics(s, one, "grad_norm"), v1 = metrics(s, one, "val_loss");
  ASSERT_EQ(l1.size(), 20u);
  for (const MeshLayout& c : layouts) {
    SCOPED_TRACE(fmt::format("{} in {}", c.out, precision));
    const std::string out = precision + "_" + c.out;
    CliRun b = train(s, "emu", out, fmt::format("--train.precision {} --train.eval_batches 2 {}", precision, c.flags),
                     "", model);
    ASSERT_EQ(b.code, 0) << b.out << b.err;
    EXPECT_NE(b.out.find(fmt::format("emu ({} on an emulated device)", precision)), std::string::npos) << b.out;
    EXPECT_NE(b.out.find(c.header), std::string::npos) << b.out;
    const auto l2 = metrics(s, out, "loss");
    ASSERT_EQ(l2.size(), 20u);
    const double tol = f32 ? kF32Tol : c.tp ? kBf16TpTol : kBf16Tol;
    const double ntol = f32 ? kF32NormTol : c.tp ? kBf16TpNormTol : kBf16NormTol;
    const double dl = expect_close(l2, l1, 1, tol, "loss");
    const double dn = expect_close(metrics(s, out, "grad_norm"), n1, 1, ntol, "grad_norm");
    const double dv = expect_close(metrics(s, out, "val_loss"), v1, 10, tol, "val_loss");
    EXPECT_LT(l2.at(20), l2.at(1) - 0.5) << "the run did not learn";
    std::printf("%-5s %-9s loss %.2e  norm %.2e  val %.2e (relative, largest of 20 steps)\n", precision.c_str(), c.out,
                dl, dn, dv);
  }
}

}  // namespace

// f32 compute on the emulated device, every layout against the CPU's single-device run.
TEST(EmuTrain, F32LayoutsMatchTheCpu) {
  TrainScratch s("loom_emu_f32");
  CliRun a = train(s, "cpu", "cpu", "--quiet --train.grad_accum 2");
  ASSERT_EQ(a.code, 0) << a.err;
  // One emulated device against the CPU.
  CliRun e = train(s, "emu", "f32_one", "--quiet --train.precision f32 --train.grad_accum 2");
  ASSERT_EQ(e.code, 0) << e.err;
  expect_close(metrics(s, "f32_one", "loss"), metrics(s, "cpu", "loss"), 1, kF32Tol, "loss");
  run_layouts(s, kMeshLayouts, "f32", "cpu", true);
}

// bf16 compute on the emulated device, every layout against one emulated device; five stopped
// after step 10 and resumed give their uninterrupted runs' losses exactly.
TEST(EmuTrain, Bf16LayoutsMatchOneDeviceAndResumeExactly) {
  TrainScratch s("loom_emu_bf16");
  CliRun a = train(s, "emu", "one", "--quiet --train.grad_accum 2");
  ASSERT_EQ(a.code, 0) << a.err;
  // bf16 against the CPU's f32: the GPU test's bound for its own bf16 against the CPU.
  CliRun c = train(s, "cpu", "cpu", "--quiet --train.grad_accum 2");
  ASSERT_EQ(c.code, 0) << c.err;
  expect_close(metrics(s, "one", "loss"), metrics(s, "cpu", "loss"), 1, kBf16TpTol, "loss against the CPU");
  run_layouts(s, kMeshLayouts, "bf16", "one", false);
  for (const MeshLayout& c : kMeshLayouts) {
    if (!c.resumed) continue;
    const std::string name = std::string("bf16_") + c.out, cut = name + "_cut";
    SCOPED_TRACE(name + " resumed");
    const std::string flags = fmt::format("--quiet --train.precision bf16 --train.eval_batches 2 {}", c.flags);
    CliRun b = train(s, "emu", cut, flags, "LOOM_FAULT_INJECT=rank=0,step=11,kind=exit");
    ASSERT_EQ(b.code, 3) << b.err;
    EXPECT_EQ(metrics(s, cut, "loss").size(), 10u);
    CliRun r = train(s, "emu", cut, flags + " --resume");
    ASSERT_EQ(r.code, 0) << r.out << r.err;
    EXPECT_EQ(metrics(s, cut, "loss"), metrics(s, name, "loss"));
    EXPECT_EQ(metrics(s, cut, "val_loss"), metrics(s, name, "val_loss"));
  }
}

// The Llama family's device paths (rotary positions uploaded, SwiGLU, RMSNorm, grouped-query
// attention with 2 key/value heads for 4 query heads: split over tp 2, replicated under tp 4, also
// offloaded),
// in f32 against the CPU and in bf16 against one emulated device, at the bounds above.
TEST(EmuTrain, LlamaLayoutsMatch) {
  static constexpr MeshLayout kLlamaLayouts[] = {
      {"tp2", "--train.grad_accum 2 --parallel.tp 2", "dp 1 x tp 2 x cp 1", true, false},
      {"tp4", "--train.grad_accum 2 --parallel.tp 4", "dp 1 x tp 4 x cp 1", true, false},
      {"tp2sp", "--train.grad_accum 2 --parallel.tp 2 --parallel.sp true", "tp 2 + sp", true, false},
      {"cp2", "--train.grad_accum 2 --parallel.cp 2", "dp 1 x tp 1 x cp 2", true, false},
      {"pp2", "--train.grad_accum 2 --parallel.pp 2", "pp 2 (", false, false},
      {"dp2z3", "--parallel.dp 2 --parallel.zero 3", "dp 2 | ZeRO 3", false, false},
      {"tp2pp2", "--train.grad_accum 2 --parallel.tp 2 --parallel.pp 2", "x dp 1 x tp 2 x cp 1", true, false},
      {"cp2tp2", "--train.grad_accum 2 --parallel.cp 2 --parallel.tp 2 --parallel.sp true", "tp 2 + sp x cp 2", true,
       false},
      // (The replicated key/value heads' gradient sums over host groups: offloaded under ZeRO 2.)
      {"dp2tp4z2off", "--parallel.dp 2 --parallel.tp 4 --parallel.zero 2 --parallel.offload true",
       "dp 2 x tp 4 x cp 1 | ZeRO 2 + offload", true, false},
  };
  TrainScratch s("loom_emu_llama");
  CliRun a = train(s, "cpu", "cpu", "--quiet --train.grad_accum 2", "", kLlama);
  ASSERT_EQ(a.code, 0) << a.err;
  run_layouts(s, kLlamaLayouts, "f32", "cpu", true, kLlama);
  CliRun b = train(s, "emu", "one", "--quiet --train.grad_accum 2", "", kLlama);
  ASSERT_EQ(b.code, 0) << b.err;
  run_layouts(s, kLlamaLayouts, "bf16", "one", false, kLlama);
}

// train.memory_limit holds on the emulated device's pool, as on a GPU's: a limit below what the
// model's state needs is refused naming the field, before the first step.
TEST(EmuTrain, MemoryLimitHoldsOnTheDevice) {
  TrainScratch s("loom_emu_limit");
  CliRun r = train(s, "emu", "limit", "--quiet --train.memory_limit 200000");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("train.memory_limit"), std::string::npos) << r.err;
  EXPECT_TRUE(metrics(s, "limit", "loss").empty()) << "a step ran over the limit";
}

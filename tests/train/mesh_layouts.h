// The layouts of the mesh engine (train/engine.h's make_mesh_engine) that the device tests run
// against one device: tensor / sequence / context / pipeline parallelism, ZeRO 1-3, offload and
// recomputation, alone and composed, as flags of `loom train` (tests/train/train_cuda_test.cu on a
// GPU, train_emu_test.cpp on the emulated device).
#pragma once

namespace loom::test {

struct MeshLayout {
  const char* out;     // the run's folder
  const char* flags;   // on top of the single-device run's
  const char* header;  // in the run's header
  // Tensor or context parallel: a row-parallel layer's partial products (and ring attention's
  // partial outputs) are rounded to the compute dtype on each rank before their sum, one rounding
  // more per layer than one device makes, so these take the looser of a test's bounds.
  bool tp;
  // Stopped after step 10 and resumed in the resume checks.
  bool resumed;
};

// dp 2 cases run grad_accum 1 against the single device's 2: the same micro-batches. Validation
// takes train.eval_batches batches of train.batch_size sequences whatever grad_accum is: the same
// sequences.
inline constexpr MeshLayout kMeshLayouts[] = {
    {"tp2", "--train.grad_accum 2 --parallel.tp 2", "dp 1 x tp 2 x cp 1", true, false},
    {"tp2sp", "--train.grad_accum 2 --parallel.tp 2 --parallel.sp true", "tp 2 + sp", true, false},
    {"dp2z1", "--parallel.dp 2 --parallel.zero 1", "dp 2 | ZeRO 1", false, false},
    {"dp2z2off", "--parallel.dp 2 --parallel.zero 2 --parallel.offload true --train.sample_tokens 8",
     "ZeRO 2 + offload", false, true},
    {"dp2z3", "--parallel.dp 2 --parallel.zero 3 --train.sample_tokens 8", "dp 2 | ZeRO 3",
     false, false},
    {"dp2tp2z1", "--parallel.dp 2 --parallel.tp 2 --parallel.zero 1",
     "dp 2 x tp 2 x cp 1 | ZeRO 1", true, true},
    {"pp2", "--train.grad_accum 2 --parallel.pp 2", "pp 2 (", false, false},
    {"pp2zb", "--train.grad_accum 2 --parallel.pp 2 --parallel.schedule zb-h1", "zb-h1", false, false},
    {"tp2pp2", "--train.grad_accum 2 --parallel.tp 2 --parallel.pp 2 --train.sample_tokens 8",
     "x dp 1 x tp 2 x cp 1", true, true},
    {"dp2pp2z2", "--parallel.dp 2 --parallel.pp 2 --parallel.zero 2", "x dp 2 (ZeRO 2)", false,
     false},
    {"cp2", "--train.grad_accum 2 --parallel.cp 2", "dp 1 x tp 1 x cp 2", true, false},
    {"cp2tp2", "--train.grad_accum 2 --parallel.cp 2 --parallel.tp 2 --parallel.sp true", "tp 2 + sp x cp 2", true,
     false},
    {"dp2cp2z2", "--parallel.dp 2 --parallel.cp 2 --parallel.zero 2",
     "dp 2 x tp 1 x cp 2 | ZeRO 2", true, true},
    {"cp2pp2", "--train.grad_accum 2 --parallel.cp 2 --parallel.pp 2", "x dp 1 x tp 1 x cp 2", true, false},
    // Offload composed: under ZeRO 2/3 a device keeps neither the f32 master weights nor the
    // reduced gradients' shard (the host's: tp's partial sums over host groups, a pipeline's tied
    // wte exchanged from them, zero bubble's input-pass gradients added into them).
    {"dp2tp2z3off",
     "--parallel.dp 2 --parallel.tp 2 --parallel.sp true --parallel.zero 3 --parallel.offload true",
     "dp 2 x tp 2 + sp x cp 1 | ZeRO 3 + offload", true, false},
    {"dp2pp2zboff",
     "--parallel.dp 2 --parallel.pp 2 --parallel.schedule zb-h1 --parallel.zero 2 --parallel.offload true",
     "x dp 2 (ZeRO 2 + offload)", false, true},
    // Recomputation runs the same kernels again: one rank on the mesh engine, and under tp.
    {"rcfull", "--train.grad_accum 2 --memory.recompute full", "recompute full:", false, false},
    {"tp2rcsel", "--train.grad_accum 2 --parallel.tp 2 --memory.recompute selective", "recompute selective:", true,
     false},
};

}  // namespace loom::test

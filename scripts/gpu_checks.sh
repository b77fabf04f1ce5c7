#!/usr/bin/env bash
# The checks and benchmarks that need a GPU host, in one go, from a bundle made by
# scripts/pack_gpu_bundle.sh (built on a machine with the CUDA toolkit):
#   scripts/gpu_checks.sh BUNDLE_DIR OUT_DIR [STEP...]
# Steps (default: all, in this order):
#   device    nvidia-smi's view of the GPU
#   cuda      every test of test_cuda (kernels against the CPU ops, cuDNN attention, the model, NCCL);
#             when cuDNN's tests fail, they run again with cuDNN's own log (why an engine was refused)
#   memcheck  compute-sanitizer's memcheck over the CUDA backend's op-parity suite, small attention
#             cases of both paths and a graphed training step (writes past a buffer that the
#             NaN-poisoned outputs cannot show)
#   pipeline  bench_pipeline at p = 4 and p = 2 (CPU threads: the host's cores, one rank per core)
#   flash     bench_flash: loom's flash attention and loom's cuDNN path, same inputs
#   mesh      the GPU mesh layouts' tests alone (tp, sp, cp, pp, ZeRO 1-3, offload, recompute; also
#             part of cuda)
#   train     train_gpt2_cuda GPT-2 124M, B = 16, T = 1024, with flash (and the time of each part of
#             the step) and with cuDNN attention
#   torch     GPT-2 124M, B = 16, T = 1024 on one GPU: loom (cuDNN and flash attention) beside
#             torch.compile in one run (bench/nanogpt_torch.py: tokens/s, MFU and the ratio to
#             torch.compile; the bar is 1.2x)
#   loom      `loom train --train.device cuda` on a small corpus made from the repository's text,
#             `loom generate` on its checkpoint, the same run as dp 2 x tp 2 with ZeRO-1 and as
#             tp 2 x pp 2, cp 2 x dp 2 (the mesh engine, threads sharing the GPU) and as two data-parallel
#             processes
#   plantruth `loom plan --precision device` against the CUDA pools of 19 layouts of GPT-2 and of
#             Llama, tag by tag (bench/plan_device_truth.sh with DEVICE=cuda; the emulated device's
#             figures are checked in the default suite), on the small corpus of `loom`
#   llama     the Llama family on the GPU: train_gpt2_cuda at SmolLM-135M's shapes against GPT-2
#             124M (B = 16, T = 1024, cuDNN attention for both, grouped-query for SmolLM; two
#             alternating rounds, then one with loom's flash attention for both), and
#             the quickstart's Llama sibling (configs/kjv-llama-10m.toml) trained with
#             `loom train --train.device cuda`, sampled, resumed, and evaluated with `loom eval` on
#             both devices
#   kernels   the memory-bound kernels: the tests that hold RoPE's and SwiGLU's vector kernels to the
#             element kernels' bits and AdamW's aligned path to its element path, the LayerNorm
#             tests, the backend parity suite and the step runner's graph tests,
#             then SmolLM-135M and GPT-2 124M (B = 16, T = 1024, cuDNN attention) profiled kernel by
#             kernel inside the step's CUDA graph (--profile-graph: events captured between the ops,
#             so no launch gaps) and op by op
#   fp16      train.precision fp16 (f16 compute, dynamic loss scaling) against bf16: GPT-2 124M's
#             step time in each (train_gpt2_cuda, B = 16, T = 1024, two alternating rounds); the quickstart's
#             model (configs/kjv-10m.toml) on data/kjv (or the small corpus) for 200 steps in bf16,
#             in fp16, and in fp16 with an overflow injected at step 100 (LOOM_FAULT_INJECT
#             kind=overflow); fp16 must track bf16 within 2% relative at every step and 0.5% over
#             the mean of the last 50 steps with no step overflowing at the default scale, and
#             the injected run must skip step 100 alone, halve its scale and end within 2% of the
#             uninterrupted fp16 run
#   offload   what optimizer offload costs a step on one GPU against the planner's model of it:
#             GPT-2 124M's shapes (the small corpus's vocabulary), B = 16, T = 1024, `loom train`
#             without and with parallel.offload (and with grad_accum 4) beside `loom plan`'s step and
#             optimizer times (bench/offload_time.sh; the host link and host memory figures of the
#             planner's clusters are specifications, never measured before)
#   gap       GPT-2 124M (the vocabulary of data/kjv, or of the small corpus) trained 30 steps from the
#             same seed on the same batches on the GPU (bf16) and on the host's CPU (f32): the two
#             loss curves side by side, and their largest relative difference; then one repeated
#             random batch memorised by loom and by PyTorch eager at B x T = 4 x 256 and 16 x 1024
# Each step writes OUT_DIR/<step>.log and its exit status to OUT_DIR/status; a failing step does
# not stop the others, and the script exits non-zero if any failed.
set -uo pipefail
[[ $# -ge 2 ]] || { echo "usage: scripts/gpu_checks.sh BUNDLE_DIR OUT_DIR [STEP...]" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
bundle=$1
out=$2
shift 2
steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=(device cuda memcheck pipeline flash train torch loom plantruth llama kernels fp16 offload)
env_run() { "$root/scripts/gpu_env.sh" "$bundle" "$@"; }
step_device() {
  nvidia-smi
  # Where the bundle's executables find the CUDA libraries (a missing one stops every step).
  env_run bash -c 'echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; ldd "$(command -v test_cuda)" | grep -E "cudnn|nccl|cublas|cudart|mpi|not found"'
  ! env_run bash -c 'ldd "$(command -v test_cuda)"' | grep -q "not found"
}
step_cuda() {
  env_run test_cuda && return 0
  echo "== cuDNN attention again, with cuDNN's log"
  CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG=stderr env_run test_cuda --gtest_filter='CudnnAttention.*' 2>&1 | tail -400
  return 1
}
step_memcheck() {
  local cs=compute-sanitizer
  command -v "$cs" >/dev/null || cs=/usr/local/cuda/bin/compute-sanitizer
  [[ -x "$(command -v "$cs")" ]] || { echo "compute-sanitizer not found"; return 1; }
  env_run "$cs" --tool memcheck --leak-check no --error-exitcode 3 test_cuda \
    --gtest_filter='Cuda/BackendParity.*:CudaAttention.CausalHs64OddLength:CudaAttention.ExplicitScaleAndShortSequence:CudaAttention.GroupedQueryHeads:CudnnAttention.CausalHs64OddLength:CudnnAttention.ExplicitScaleAndShortSequences:StepRunnerGraph.RecapturesWhenTheCountedTargetsChange'
}
# One thread per rank first: wall clock and CPU-time replay side by side at p = 4 on free cores.
step_pipeline() {
  env_run bench_pipeline 4 8 8 11 --threads-per-rank 1 && env_run bench_pipeline 4 8 8 11 &&
    env_run bench_pipeline 2 8 8 11
}
step_flash() { env_run bench_flash; }
# The layouts of the mesh engine on the GPU alone (also in `cuda`): the parity of the ops they add
# (vocabulary-parallel loss and embedding, ring attention's strided copies and merge), tensor- and
# context-parallel ranks sharing the GPU against the CPU model, and `loom train` of every mesh
# layout against one GPU, with resumes.
step_mesh() {
  env_run test_cuda --gtest_filter='Cuda/BackendParity.VocabCrossEntropy/*:Cuda/BackendParity.EmbeddingVocabularyShardAtPositions/*:Cuda/BackendParity.StridedCopy/*:Cuda/BackendParity.AttentionMerge/*:*.TensorParallelRanksSharingTheGpuMatchTheCpuModel:*.ContextParallelRanksSharingTheGpuMatchTheCpuModel:GPTOnCuda.LayoutsWithoutDeviceCollectivesAreRefusedByName:CudaTrain.MeshLayoutsOnThreadsSharingTheGpuMatchOneGpu'
}
step_train() {
  env_run train_gpt2_cuda -B 16 -T 1024 --steps 20 --warmup 5 --attention flash --profile 5 || return 1
  env_run train_gpt2_cuda -B 16 -T 1024 --steps 20 --warmup 5 --attention cudnn
}
step_torch() {
  python3 "$root/bench/nanogpt_torch.py" --loom-bin "$root/scripts/gpu_env.sh $bundle train_gpt2_cuda" -B 16 -T 1024 \
    --modes loom-cudnn,loom-flash,compile
}
# A small corpus from the repository's text, prepared with a 512-token vocabulary into DIR/data.
make_corpus() {
  local corpus=$1
  mkdir -p "$corpus"
  cat "$root"/README.md "$root"/bench/README.md "$root"/src/*/*.h "$root"/src/*/*/*.h > "$corpus/text.txt"
  env_run loom prepare "$corpus/text.txt" --out "$corpus/data" --vocab-size 512 --overwrite
}
step_loom() {
  local corpus="$out/corpus"
  make_corpus "$corpus" &&
    env_run loom train "$root/configs/kjv-10m.toml" --data.dir "$corpus/data" --train.device cuda \
      --train.steps 40 --train.eval_every 20 --train.checkpoint_every 20 --train.out_dir "$out/run" &&
    env_run loom generate "$out/run" --prompt "The " --tokens 20 || return 1
  # The mesh engine: dp 2 x tp 2 with ZeRO-1, and tp 2 x pp 2 (four threads sharing the GPU,
  # collectives and the stages' transfers staged through host memory; samples drawn on the mesh),
  # and their checkpoints generating on the CPU.
  env_run loom train "$root/configs/kjv-10m.toml" --data.dir "$corpus/data" --train.device cuda --parallel.dp 2 \
    --parallel.tp 2 --parallel.zero 1 --train.steps 40 --train.eval_every 20 --train.checkpoint_every 20 \
    --train.out_dir "$out/run_mesh" &&
    env_run loom generate "$out/run_mesh" --prompt "The " --tokens 20 || return 1
  env_run loom train "$root/configs/kjv-10m.toml" --data.dir "$corpus/data" --train.device cuda --parallel.tp 2 \
    --parallel.pp 2 --train.grad_accum 2 --train.steps 40 --train.eval_every 20 --train.checkpoint_every 20 \
    --train.out_dir "$out/run_tp2pp2" &&
    env_run loom generate "$out/run_tp2pp2" --prompt "The " --tokens 20 || return 1
  # Context parallelism (ring attention) with dp and selective recomputation.
  env_run loom train "$root/configs/kjv-10m.toml" --data.dir "$corpus/data" --train.device cuda --parallel.cp 2 \
    --parallel.dp 2 --parallel.zero 2 --memory.recompute selective --train.steps 40 --train.eval_every 20 \
    --train.checkpoint_every 20 --train.out_dir "$out/run_cp2" &&
    env_run loom generate "$out/run_cp2" --prompt "The " --tokens 20 || return 1
  # Data parallelism: two processes (sharing the GPU on a one-GPU host: gradients staged through
  # host memory; one GPU each elsewhere: NCCL).
  command -v mpirun >/dev/null || { echo "mpirun not found: data-parallel run skipped"; return 0; }
  local root_flag=""
  [[ $(id -u) -eq 0 ]] && root_flag=--allow-run-as-root
  OMPI_MCA_btl_vader_single_copy_mechanism=none env_run mpirun $root_flag --oversubscribe --bind-to none -n 2 \
    loom train "$root/configs/kjv-10m.toml" --data.dir "$corpus/data" --train.device cuda --parallel.dp 2 \
    --parallel.comm mpi --train.steps 40 --train.eval_every 20 --train.checkpoint_every 20 --train.out_dir "$out/run_dp2"
}
step_llama() {
  local r
  for r in cudnn cudnn flash; do
    env_run train_gpt2_cuda --model gpt2-124m -B 16 -T 1024 --steps 20 --warmup 5 --attention $r || return 1
    env_run train_gpt2_cuda --model smollm-135m -B 16 -T 1024 --steps 20 --warmup 5 --attention $r || return 1
  done
  local corpus="$out/corpus_llama"
  make_corpus "$corpus" &&
    env_run loom train "$root/configs/kjv-llama-10m.toml" --data.dir "$corpus/data" --train.device cuda \
      --train.steps 40 --optim.decay_steps 60 --train.eval_every 20 --train.checkpoint_every 20 \
      --train.out_dir "$out/run_llama" &&
    env_run loom generate "$out/run_llama" --prompt "The " --tokens 20 || return 1
  # Resumed on the GPU, and the checkpoint's loss on the validation shard on both devices (bf16
  # against f32: within 1e-2 relative).
  env_run loom train "$root/configs/kjv-llama-10m.toml" --data.dir "$corpus/data" --train.device cuda \
    --train.steps 60 --optim.decay_steps 60 --train.eval_every 20 --train.checkpoint_every 20 \
    --train.out_dir "$out/run_llama" --resume || return 1
  local gpu cpu
  gpu=$(env_run loom eval "$out/run_llama" --tokens "$corpus/data/val_000.bin" --seq 128 --device cuda --json) || return 1
  cpu=$(env_run loom eval "$out/run_llama" --tokens "$corpus/data/val_000.bin" --seq 128 --device cpu --json) || return 1
  echo "$gpu"
  echo "$cpu"
  python3 -c "import json,sys; g=json.loads(sys.argv[1])['loss']; c=json.loads(sys.argv[2])['loss']; print(f'eval loss cuda {g:.5f} cpu {c:.5f} rel {abs(g-c)/c:.2e}'); sys.exit(abs(g-c)/c > 1e-2)" "$gpu" "$cpu"
}
step_kernels() {
  env_run test_cuda --gtest_filter='*LayerNorm*:CudaRope.*:CudaSwiglu.*:AdamW.*:Cuda/BackendParity.*:StepRunnerGraph.*' || return 1
  local m
  for m in smollm-135m gpt2-124m; do
    env_run train_gpt2_cuda --model $m -B 16 -T 1024 --steps 20 --warmup 5 --attention cudnn --profile-graph 5 \
      --profile 5 || return 1
  done
}
step_fp16() {
  # Speed: GPT-2 124M, B = 16, T = 1024, cuDNN attention, bf16 and fp16 alternating, two rounds.
  local r p
  for r in 1 2; do
    for p in bf16 fp16; do
      env_run train_gpt2_cuda -B 16 -T 1024 --steps 20 --warmup 5 --attention cudnn --precision $p || return 1
    done
  done
  local d="$root/data/kjv"
  if [[ ! -f "$d/train_000.bin" ]]; then
    make_corpus "$out/corpus_fp16" || return 1
    d="$out/corpus_fp16/data"
  fi
  local name precision fault
  for name in bf16 fp16 fp16_overflow; do
    precision=${name%%_*}
    fault=""
    [[ $name == fp16_overflow ]] && fault="rank=0,step=100,kind=overflow"
    LOOM_FAULT_INJECT=$fault env_run loom train "$root/configs/kjv-10m.toml" --data.dir "$d" --train.device cuda \
      --train.precision "$precision" --train.steps 200 --train.eval_every 50 --train.checkpoint_every 0 \
      --train.sample_tokens 0 --train.out_dir "$out/run_$name" || return 1
  done
  python3 - "$out/run_bf16/metrics.jsonl" "$out/run_fp16/metrics.jsonl" "$out/run_fp16_overflow/metrics.jsonl" <<'PY'
import json, sys
def load(f):
    rows = [json.loads(l) for l in open(f)]
    return ({r["step"]: r["loss"] for r in rows if "loss" in r}, {r["step"]: r.get("loss_scale") for r in rows if "step" in r and ("loss" in r or r.get("skipped"))},
            [r["step"] for r in rows if r.get("skipped")])
(b, _, _), (h, hs, hskip), (o, os_, oskip) = load(sys.argv[1]), load(sys.argv[2]), load(sys.argv[3])
ok = True
rel = {s: abs(h[s] - b[s]) / b[s] for s in b if s in h}
worst = max(rel.values())
last = range(151, 201)
last = [s for s in last if s in h]
mean_b, mean_h = sum(b[s] for s in last) / len(last), sum(h[s] for s in last) / len(last)
mean_rel = abs(mean_h - mean_b) / mean_b
for s in (1, 2, 5, 10, 20, 50, 100, 150, 200):
    print(f"step {s:3d}  bf16 {b[s]:.5f}  fp16 {h.get(s, float('nan')):.5f}  rel {rel.get(s, float('nan')):.2e}  "
          f"scale {hs[s]:g}  fp16+overflow {o.get(s, float('nan')):.5f}  scale {os_[s]:g}")
print(f"fp16 against bf16: largest relative loss difference {worst:.2e} (bound 2e-2), mean of steps 151-200 "
      f"{mean_h:.5f} against {mean_b:.5f}: {mean_rel:.2e} (bound 5e-3); fp16 skipped steps {hskip}")
ok &= worst <= 2e-2 and mean_rel <= 5e-3 and not hskip
print(f"fp16 with an overflow injected at step 100: skipped {oskip}, scale {os_[99]:g} -> {os_[100]:g} (injected) -> "
      f"{os_[101]:g}; step 200's loss {o[200]:.5f} against {h[200]:.5f} ({abs(o[200] - h[200]) / h[200]:.2e}, bound 2e-2)")
ok &= oskip == [100] and os_[100] == os_[99] * 65536 and os_[101] == os_[99] / 2 and abs(o[200] - h[200]) / h[200] <= 2e-2
sys.exit(0 if ok else 1)
PY
}

step_gap() {
  local d="$root/data/kjv"
  if [[ ! -f "$d/train_000.bin" ]]; then
    make_corpus "$out/corpus_gap" || return 1
    d="$out/corpus_gap/data"
  fi
  local dev
  for dev in cuda cpu; do
    env_run loom train --data.dir "$d" --model.preset gpt2-124m --data.seq_len 256 --train.batch_size 8 \
      --train.steps 30 --train.eval_every 0 --train.sample_tokens 0 --train.device $dev \
      --train.threads "$(nproc)" --train.out_dir "/tmp/loom_gap_$dev" || return 1
  done
  python3 - /tmp/loom_gap_cuda/metrics.jsonl /tmp/loom_gap_cpu/metrics.jsonl <<'PY'
import json, sys
rows = [[json.loads(l) for l in open(f) if '"loss"' in l] for f in sys.argv[1:]]
worst = 0.0
for g, c in zip(*rows):
    rel = abs(g["loss"] - c["loss"]) / c["loss"]
    worst = max(worst, rel)
    print(f'step {g["step"]:3d}  cuda {g["loss"]:.5f}  cpu {c["loss"]:.5f}  rel {rel:.2e}  grad_norm {g["grad_norm"]:.4f} / {c["grad_norm"]:.4f}')
print(f"largest relative loss difference {worst:.2e}")
PY
  # One repeated random batch memorised by loom's GPU step and by nanoGPT in PyTorch eager (bf16
  # autocast), at a small and at the benchmark's size: the loss columns first -> last. On the CPU the
  # two curves agree, in f32 and with PyTorch in bf16 (bench/nanogpt_torch.py --cpu-memorize); at
  # B = 16, T = 1024 on the GPU loom ended higher (9.0 against 7.5 after 35 steps): this says whether
  # the GPU's gap shows at every size (its kernels) or needs the large batch.
  local bt
  for bt in "4 256" "16 1024"; do
    set -- $bt
    python3 "$root/bench/nanogpt_torch.py" --loom-bin "$root/scripts/gpu_env.sh $bundle train_gpt2_cuda" -B "$1" -T "$2" \
      --steps 30 --warmup 5 --modes loom-cudnn,eager || return 1
  done
}
step_plantruth() {
  local corpus="$out/corpus" family
  [[ -s "$corpus/data/train_000.bin" ]] || make_corpus "$corpus" || return 1
  for family in gpt llama; do
    env_run bash -c 'DEVICE=cuda FAMILY="$2" LOOM="$(command -v loom)" "$0/bench/plan_device_truth.sh" "$1"' \
      "$root" "$corpus/data" "$family" || return 1
  done
}
step_offload() {
  local corpus="$out/corpus" cluster=h100-sxm
  [[ -s "$corpus/data/train_000.bin" ]] || make_corpus "$corpus" || return 1
  case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
    *H200*) cluster=h200 ;;
    *A100*) cluster=a100-80gb ;;
  esac
  env_run bash -c 'DEVICE=cuda CLUSTER="$2" LOOM="$(command -v loom)" "$0/bench/offload_time.sh" "$1"' \
    "$root" "$corpus/data" "$cluster"
}
failed=0
run_step() {
  local name=$1
  local t0=$SECONDS
  echo "== $name" | tee -a "$out/status"
  "step_$name" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/status"
  [[ $rc -eq 0 ]] || failed=1
}
# Every step named must exist before any runs (a step is a step_<name> function above).
for s in "${steps[@]}"; do
  declare -F "step_$s" >/dev/null || {
    echo "gpu_checks: unknown step '$s' (the steps: $(declare -F | sed -n 's/^declare -f step_//p' | tr '\n' ' '))" >&2
    exit 2
  }
done
mkdir -p "$out"
{
  date -u +"gpu_checks %Y-%m-%d %H:%M UTC"
  [[ -f "$bundle/COMMIT" ]] && sed 's/^/bundle: /' "$bundle/COMMIT"
} | tee -a "$out/status"
for s in "${steps[@]}"; do run_step "$s"; done
exit $failed

#!/usr/bin/env bash
# The planner against measured runs ("local truth", issue "How to choose"): for each layout, `loom
# train` on the threads backend (every rank's pool peaks by tag from OUT/memory.json; the step time
# as the median of its timed steps from metrics.jsonl) beside `loom plan --layout ... --json` for
# the same model, global batch and sequence on the `cpu` cluster (this host, calibrated first with
# `loom calibrate`; its ranks share the cores); the error of the predicted peak memory of the
# fullest rank and of the step time, then their median and worst.
#
#   bench/plan_truth.sh [DATA_DIR] [LAYOUT ...]
#
# LAYOUTs are "plan_layout|train_flags" (default: the table below). Environment: CORES (default 2:
# a layout of R ranks gets CORES / R threads per rank, at least 1), STEPS (default 30), WARMUP
# (default 10: the first steps run slower while the allocator's caches and oneDNN's kernels warm),
# ROUNDS (default 3), LAYERS / HEADS / EMBD (default 4 / 4 / 128), BATCH (default 16), SEQ (default 64).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/layout_util.sh
source "$root/bench/layout_util.sh"
shift || true
cores=${CORES:-2}
steps=${STEPS:-30}
warmup=${WARMUP:-10}
rounds=${ROUNDS:-3}
layers=${LAYERS:-4}
heads=${HEADS:-4}
embd=${EMBD:-128}
batch=${BATCH:-16}
seq=${SEQ:-64}
vocab=$(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))))" "$data/encoder.json" 2>/dev/null || echo 4096)
layouts=("$@")
if [[ ${#layouts[@]} -eq 0 ]]; then
  layouts=(
    "dp=1|"
    "dp=2,zero=0|--parallel.dp 2"
    "dp=2,zero=1|--parallel.dp 2 --parallel.zero 1"
    "dp=2,zero=2|--parallel.dp 2 --parallel.zero 2"
    "dp=2,zero=3|--parallel.dp 2 --parallel.zero 3"
    "dp=4,zero=3|--parallel.dp 4 --parallel.zero 3"
    "tp=2|--parallel.tp 2"
    "tp=2,sp=1|--parallel.tp 2 --parallel.sp true"
    "tp=4,sp=1|--parallel.tp 4 --parallel.sp true"
    "cp=2|--parallel.cp 2"
    "cp=2,tp=2,sp=1|--parallel.cp 2 --parallel.tp 2 --parallel.sp true"
    "pp=2,schedule=1f1b|--parallel.pp 2 --train.grad_accum 4 --parallel.schedule 1f1b"
    "pp=2,schedule=gpipe|--parallel.pp 2 --train.grad_accum 4 --parallel.schedule gpipe"
    "pp=2,v=2,schedule=interleaved|--parallel.pp 2 --train.grad_accum 4 --parallel.schedule interleaved --parallel.virtual_stages 2"
    "pp=2,schedule=zb-h1|--parallel.pp 2 --train.grad_accum 4 --parallel.schedule zb-h1"
    "pp=4,schedule=1f1b|--parallel.pp 4 --train.grad_accum 4 --parallel.schedule 1f1b"
    "dp=2,tp=2,zero=1|--parallel.dp 2 --parallel.tp 2 --parallel.zero 1"
    "dp=2,pp=2,zero=1|--parallel.dp 2 --parallel.pp 2 --train.grad_accum 4 --parallel.zero 1"
    "dp=2,pp=2,zero=2|--parallel.dp 2 --parallel.pp 2 --train.grad_accum 4 --parallel.zero 2"
    "dp=2,pp=2,zero=3|--parallel.dp 2 --parallel.pp 2 --train.grad_accum 4 --parallel.zero 3"
    "tp=2,pp=2|--parallel.tp 2 --parallel.pp 2 --train.grad_accum 4"
    "dp=1,recompute=full|--memory.recompute full"
    "tp=2,sp=1,recompute=selective|--parallel.tp 2 --parallel.sp true --memory.recompute selective"
    "dp=2,zero=3,recompute=full|--parallel.dp 2 --parallel.zero 3 --memory.recompute full"
  )
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/model.toml" <<TOML
[model]
name = "plan-truth"
layers = $layers
hidden = $embd
heads = $heads
vocab = $vocab
seq = $seq
TOML
# The planner's `cpu` cluster is this host as `loom calibrate` measured it (cached per CPU and thread
# count): measure it now, with every core.
"$loom" calibrate --threads "$cores" > "$work/calibrate.log" 2>&1 || { cat "$work/calibrate.log" >&2; exit 1; }
echo "model: L=$layers, H=$heads, C=$embd, V=$vocab, T=$seq, global batch $batch; $cores cores; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo
echo "| layout | ranks | measured peak (fullest rank) | predicted | error | measured step | predicted | error |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|"
# Each layout runs ROUNDS times, the rounds one after the other over the whole list (a slow spell
# of the host falls on one run of a layout, not on all of them): the step time is the least of the
# runs' medians, the memory peak the largest.
declare -A best_t best_m failed
for ((round = 1; round <= rounds; ++round)); do
  for entry in "${layouts[@]}"; do
    plan_layout=${entry%%|*}
    flags=${entry#*|}
    ranks=$(ranks_of "$flags")
    threads=$((cores / ranks)); [[ $threads -ge 1 ]] || threads=1
    out="$work/run"
    rm -rf "$out"
    if ! "$loom" train --data.dir "$data" --model.n_layer "$layers" --model.n_head "$heads" --model.n_embd "$embd" \
        --model.vocab_size "$vocab" --data.seq_len "$seq" --train.batch_size "$batch" --train.steps "$steps" \
        --train.eval_every 0 --train.sample_tokens 0 --train.checkpoint_every 0 --train.threads "$threads" \
        --train.out_dir "$out" --overwrite $flags > "$work/train.log" 2>&1; then
      failed[$entry]="run failed: $(tail -1 "$work/train.log")"
      continue
    fi
    read -r mem t < <(python3 - "$out/memory.json" "$out/metrics.jsonl" "$warmup" <<'PY'
import json, statistics, sys
mem = json.load(open(sys.argv[1]))
steps = [json.loads(l) for l in open(sys.argv[2]) if '"loss"' in l and "val_loss" not in l]
times = [b["time_s"] - a["time_s"] for a, b in zip(steps, steps[1:])][int(sys.argv[3]) - 1:]
print(max(r["all_tags_peak_bytes"] for r in mem["ranks"]), statistics.median(times))
PY
)
    if [[ -z ${best_t[$entry]:-} ]] || python3 -c "import sys; sys.exit(not float(sys.argv[1]) < float(sys.argv[2]))" "$t" "${best_t[$entry]}"; then
      best_t[$entry]=$t
    fi
    [[ -n ${best_m[$entry]:-} && ${best_m[$entry]} -ge $mem ]] || best_m[$entry]=$mem
  done
done
mem_err=() time_err=()
for entry in "${layouts[@]}"; do
  plan_layout=${entry%%|*}
  flags=${entry#*|}
  ranks=$(ranks_of "$flags")
  # The micro-batch the run uses: batch / (dp x grad_accum), unless the layout names one.
  if [[ $plan_layout != *mbs=* ]]; then
    dp=$(sed -nE 's/.*--parallel\.dp ([0-9]+).*/\1/p' <<<"$flags")
    ga=$(sed -nE 's/.*--train\.grad_accum ([0-9]+).*/\1/p' <<<"$flags")
    plan_layout="$plan_layout,mbs=$((batch / ${dp:-1} / ${ga:-1}))"
  fi
  if [[ -z ${best_t[$entry]:-} ]]; then
    echo "| $plan_layout | $ranks | ${failed[$entry]:-no run} | | | | | |"
    continue
  fi
  pred=$("$loom" plan --model "$work/model.toml" --cluster cpu --gpus "$ranks" --global-batch "$batch" --seq "$seq" \
    --precision f32 --layout "$plan_layout" --json 2>&1) || { echo "| $plan_layout | $ranks | plan failed: $pred | | | | | |"; continue; }
  row=$(python3 - "${best_m[$entry]}" "${best_t[$entry]}" "$pred" <<'PY'
import json, sys
measured_mem, measured_t = float(sys.argv[1]), float(sys.argv[2])
p = json.loads(sys.argv[3])
pred_mem = sum(p["memory_bytes_per_gpu"].values())
pred_t = p["step_time_s"]
em, et = (pred_mem - measured_mem) / measured_mem, (pred_t - measured_t) / measured_t
print(f"{measured_mem / 2**20:.2f} MiB|{pred_mem / 2**20:.2f} MiB|{100 * em:+.1f}%|{1e3 * measured_t:.1f} ms|{1e3 * pred_t:.1f} ms|{100 * et:+.1f}%|{em}|{et}")
PY
)
  IFS='|' read -r mm pm em mt pt et emr etr <<<"$row"
  echo "| $plan_layout | $ranks | $mm | $pm | $em | $mt | $pt | $et |"
  mem_err+=("$emr") time_err+=("$etr")
done
python3 - "${mem_err[*]}" "${time_err[*]}" <<'PY'
import statistics, sys
for name, s in (("peak memory", sys.argv[1]), ("step time", sys.argv[2])):
    v = [abs(float(x)) for x in s.split()]
    if v:
        print(f"\n{name}: median error {100 * statistics.median(v):.1f}%, worst {100 * max(v):.1f}% over {len(v)} layouts")
PY

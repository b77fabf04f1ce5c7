#!/usr/bin/env bash
# The planner against measured runs ("local truth", issue "How to choose"): for each layout, `loom
# train` on the threads backend (every rank's pool peaks by tag from OUT/memory.json; the step time
# as the median of its timed steps from metrics.jsonl) beside `loom plan --layout ... --json` for
# the same model, global batch and sequence on the `cpu` cluster (this host, calibrated with `loom
# calibrate` before each round; its ranks share the cores); the error of the predicted peak memory
# of the fullest rank and of the step time, then their median and worst.
#
#   bench/plan_truth.sh [DATA_DIR] [LAYOUT ...]
#
# LAYOUTs are "plan_layout|train_flags" (default: the table below). Environment: CORES (default 2:
# a layout of R ranks gets CORES / R threads per rank, at least 1), STEPS (default 30), WARMUP
# (default 10: the first steps run slower while the allocator's caches and oneDNN's kernels warm),
# ROUNDS (default 3), LAYERS / HEADS / EMBD (default 4 / 4 / 128), BATCH (default 16), SEQ (default 64),
# RAW (a file to append each round's measured and predicted step of each layout to, as JSON lines).
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
# The layout as `loom plan --layout` reads it: the micro-batch the run uses, batch / (dp x grad_accum),
# unless the layout names one.
plan_of() {
  local plan_layout=${1%%|*} flags=${1#*|} dp ga
  if [[ $plan_layout != *mbs=* ]]; then
    dp=$(sed -nE 's/.*--parallel\.dp ([0-9]+).*/\1/p' <<<"$flags")
    ga=$(sed -nE 's/.*--train\.grad_accum ([0-9]+).*/\1/p' <<<"$flags")
    plan_layout="$plan_layout,mbs=$((batch / ${dp:-1} / ${ga:-1}))"
  fi
  echo "$plan_layout"
}
less_than() { python3 -c "import sys; sys.exit(not float(sys.argv[1]) < float(sys.argv[2]))" "$1" "$2"; }
echo "model: L=$layers, H=$heads, C=$embd, V=$vocab, T=$seq, global batch $batch; $cores cores; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo
# Each layout runs ROUNDS times, the rounds one after the other over the whole list (a slow spell
# of the host falls on one run of a layout, not on all of them). The planner's `cpu` cluster is this
# host as `loom calibrate` measured it: every round calibrates first, with every core, into its own
# cache (LOOM_CACHE_DIR; the user's cache is left alone), and predicts its layouts from that
# calibration, so the calibration samples the host's speed as often as the runs do. The measured
# step time is the least of the rounds' medians and the predicted one the least of the rounds'
# predictions (the same statistic on both sides); the memory peak the largest.
declare -A best_t best_p best_m pred_m round_err round_ratio failed
for ((round = 1; round <= rounds; ++round)); do
  cache="$work/calibration.$round"
  LOOM_CACHE_DIR=$cache "$loom" calibrate --threads "$cores" > "$work/calibrate.log" 2>&1 ||
    { cat "$work/calibrate.log" >&2; exit 1; }
  # Every other round runs the list backwards: each layout's runs then lie, on average, as far from
  # their rounds' calibrations as every other layout's.
  order=("${layouts[@]}")
  if ((round % 2 == 0)); then
    order=()
    for ((i = ${#layouts[@]} - 1; i >= 0; --i)); do order+=("${layouts[$i]}"); done
  fi
  for entry in "${order[@]}"; do
    [[ -z ${failed[$entry]:-} ]] || continue
    plan_layout=$(plan_of "$entry")
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
    if ! pred=$(LOOM_CACHE_DIR=$cache "$loom" plan --model "$work/model.toml" --cluster cpu --gpus "$ranks" \
        --global-batch "$batch" --seq "$seq" --precision f32 --layout "$plan_layout" --json 2>&1); then
      failed[$entry]="plan failed: $pred"
      continue
    fi
    read -r mem t pmem pt < <(python3 - "$out/memory.json" "$out/metrics.jsonl" "$warmup" "$pred" <<'PY'
import json, statistics, sys
mem = json.load(open(sys.argv[1]))
steps = [json.loads(l) for l in open(sys.argv[2]) if '"loss"' in l and "val_loss" not in l]
times = [b["time_s"] - a["time_s"] for a, b in zip(steps, steps[1:])][int(sys.argv[3]) - 1:]
p = json.loads(sys.argv[4])
print(max(r["all_tags_peak_bytes"] for r in mem["ranks"]), statistics.median(times),
      sum(p["memory_bytes_per_gpu"].values()), p["step_time_s"])
PY
)
    [[ -n ${best_t[$entry]:-} ]] && ! less_than "$t" "${best_t[$entry]}" || best_t[$entry]=$t
    [[ -n ${best_p[$entry]:-} ]] && ! less_than "$pt" "${best_p[$entry]}" || best_p[$entry]=$pt
    [[ -n ${best_m[$entry]:-} && ${best_m[$entry]} -ge $mem ]] || best_m[$entry]=$mem
    pred_m[$entry]=$pmem
    [[ -z ${RAW:-} ]] || python3 -c "import json, sys; p = json.loads(sys.argv[4]); print(json.dumps({'round': int(sys.argv[1]), 'layout': sys.argv[2], 'measured_s': float(sys.argv[3]), 'predicted_s': p['step_time_s'], 'predicted_split_s': p['time_s']}))" \
      "$round" "$plan_layout" "$t" "$pred" >> "$RAW"
    round_err[$entry]+="$(python3 -c "import sys; print(f'{100 * (float(sys.argv[1]) / float(sys.argv[2]) - 1):+.0f}%')" "$pt" "$t") "
    round_ratio[$entry]+="$pt/$t,"
  done
done
echo "| layout | ranks | measured peak (fullest rank) | predicted | error | measured step | predicted | error | each round |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
mem_err=() time_err=() paired_err=()
for entry in "${layouts[@]}"; do
  plan_layout=$(plan_of "$entry")
  ranks=$(ranks_of "${entry#*|}")
  if [[ -n ${failed[$entry]:-} || -z ${best_t[$entry]:-} ]]; then
    echo "| $plan_layout | $ranks | ${failed[$entry]:-no run} | | | | | | |"
    continue
  fi
  row=$(python3 - "${best_m[$entry]}" "${pred_m[$entry]}" "${best_t[$entry]}" "${best_p[$entry]}" <<'PY'
import sys
measured_mem, pred_mem, measured_t, pred_t = map(float, sys.argv[1:5])
em, et = (pred_mem - measured_mem) / measured_mem, (pred_t - measured_t) / measured_t
print(f"{measured_mem / 2**20:.2f} MiB|{pred_mem / 2**20:.2f} MiB|{100 * em:+.1f}%|{1e3 * measured_t:.1f} ms|{1e3 * pred_t:.1f} ms|{100 * et:+.1f}%|{em}|{et}")
PY
)
  IFS='|' read -r mm pm em mt pt et emr etr <<<"$row"
  echo "| $plan_layout | $ranks | $mm | $pm | $em | $mt | $pt | $et | ${round_err[$entry]% } |"
  mem_err+=("$emr") time_err+=("$etr") paired_err+=("${round_ratio[$entry]%,}")
done
# Also each round against its own calibration: per layout the median over the rounds of that
# round's error (the pairing the least of each side does not keep).
python3 - "${mem_err[*]}" "${time_err[*]}" "${paired_err[*]}" <<'PY'
import statistics, sys
paired = [statistics.median(float(a) / float(b) - 1 for a, b in (r.split("/") for r in layout.split(",")))
          for layout in sys.argv[3].split()]
for name, v in (("peak memory", [float(x) for x in sys.argv[1].split()]),
                ("step time", [float(x) for x in sys.argv[2].split()]),
                ("step time, each round against its own calibration (the median over the rounds)", paired)):
    v = [abs(x) for x in v]
    if v:
        within = f", {sum(x <= 0.15 for x in v)} within 15%" if name.startswith("step") else ""
        print(f"\n{name}: median error {100 * statistics.median(v):.1f}%, worst {100 * max(v):.1f}% over {len(v)} layouts{within}")
PY

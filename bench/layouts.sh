#!/usr/bin/env bash
# Tokens/s of each parallel layout against the single device on the same cores, in one run, on
# the threads backend and under MPI (issue "Parallel efficiency"): `loom train` on the same data,
# model and global batch for every layout; a layout of R ranks gets CORES / R threads per rank, the
# single device all CORES. Beside each figure, what the layout spends per step outside compute:
# exposed gradient reduction and parameter gathers (data parallelism), and for a pipeline its
# idle time against the schedule's own bubble.
#
#   bench/layouts.sh [DATA_DIR] [LAYOUT ...]
#
# DATA_DIR holds token shards (scripts/quickstart.sh makes data/kjv, vocabulary 4096). LAYOUTs are
# "name:flags" (default: the issue's table). Environment: CORES (default 2), STEPS (default 6),
# WARMUP (steps not timed, default 2), MODEL_FLAGS (default GPT-2 124M shapes over the data's
# vocabulary), BATCH (default 8), SEQ (default 128), BACKENDS (default "threads mpi").
# REPEAT (default 2). Prints a markdown table; a run's tokens/s is the mean over its timed steps
# (metrics.jsonl).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/layout_util.sh
source "$root/bench/layout_util.sh"
shift || true
cores=${CORES:-2}
steps=${STEPS:-6}
warmup=${WARMUP:-2}
batch=${BATCH:-8}
seq=${SEQ:-128}
backends=(${BACKENDS:-threads mpi})
model_flags=${MODEL_FLAGS:---model.n_layer 12 --model.n_head 12 --model.n_embd 768 --model.vocab_size 4096}
for b in "${backends[@]}"; do
  [[ $b == threads || $b == mpi ]] || { echo "BACKENDS: '$b' is not threads or mpi" >&2; exit 1; }
  [[ $b == mpi ]] && ! command -v mpirun >/dev/null && { echo "mpirun not found (apt-get install openmpi-bin)" >&2; exit 1; }
done
(( warmup < steps )) || { echo "WARMUP ($warmup) must be below STEPS ($steps)" >&2; exit 1; }

layouts=("$@")
if [[ ${#layouts[@]} -eq 0 ]]; then
  layouts=("single:" "dp2:--parallel.dp 2" "dp2-zero3:--parallel.dp 2 --parallel.zero 3" "tp2:--parallel.tp 2"
           "tp2-sp:--parallel.tp 2 --parallel.sp true" "cp2:--parallel.cp 2"
           "pp2:--parallel.pp 2 --train.grad_accum 4")
fi
declare -A shape_of
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck disable=SC2206
common=(--data.dir "$data" $model_flags --data.seq_len "$seq" --train.batch_size "$batch" --train.steps "$steps"
        --train.eval_every 0 --train.sample_tokens 0 --train.checkpoint_every 0)

# mean tokens/s over the steps after the warm-up, from a run's metrics.jsonl
tokens_per_s() {
  python3 -c 'import json,sys
w=int(sys.argv[2]); v=[json.loads(l)["tokens_per_s"] for l in open(sys.argv[1])][w:]
print("%.1f" % (sum(v)/len(v)))' "$1" "$warmup"
}
# what the run's memory line says about communication, per step
comm_cost() {
  local log=$1
  python3 - "$log" "$steps" <<'EOF'
import re, sys
text = open(sys.argv[1]).read(); steps = int(sys.argv[2])
out = []
m = re.search(r"gradient reduction ([0-9.]+) s, ([0-9.]+) s exposed", text)
if m: out.append("reduction exposed %.0f ms" % (1e3 * float(m.group(2)) / steps))
m = re.search(r"parameter gathers ([0-9.]+) s", text)
if m and float(m.group(1)) > 0: out.append("gathers %.0f ms" % (1e3 * float(m.group(1)) / steps))
m = re.search(r"pipeline idle ([0-9.]+) s \(([0-9.]+)% of the steps; the schedule's bubble ([0-9.]+)%\)", text)
if m: out.append("idle %s%% (bubble %s%%)" % (m.group(2), m.group(3)))
print(", ".join(out) if out else "-")
EOF
}

# Every (layout, backend) run REPEAT times, round robin (so a slow spell of the host spreads over
# all layouts); each figure is the mean of its runs, with their spread. The single device has no
# communication, so its runs under both backends form one baseline.
repeat=${REPEAT:-2}
declare -A tps_runs cost
names=()
for spec in "${layouts[@]}"; do names+=("${spec%%:*}"); done
for ((k = 1; k <= repeat; ++k)); do
  for spec in "${layouts[@]}"; do
    name=${spec%%:*}
    flags=${spec#*:}
    ranks=$(ranks_of "$flags")
    threads=$((cores / ranks))
    (( threads >= 1 )) || threads=1
    shape_of[$name]="$ranks x $threads"
    for b in "${backends[@]}"; do
      out=$work/$name-$b-$k
      mkdir -p "$out"
      # shellcheck disable=SC2086
      if [[ $b == threads ]]; then
        cmd=("$loom" train "${common[@]}" --train.out_dir "$out/run" --train.threads "$threads" --parallel.comm threads $flags)
      else
        cmd=(mpirun "${as_root[@]}" --oversubscribe --bind-to none -n "$ranks" "$loom" train "${common[@]}" --train.out_dir "$out/run"
             --train.threads "$threads" --parallel.comm mpi $flags)
      fi
      if ! "${cmd[@]}" >"$out/log" 2>&1; then
        echo "$name ($b): failed" >&2
        cat "$out/log" >&2
        exit 1
      fi
      tps_runs[$name,$b]+="$(tokens_per_s "$out/run/metrics.jsonl") "
      cost[$name,$b]=$(comm_cost "$out/log")
    done
  done
done

mean() { awk '{s = 0; for (i = 1; i <= NF; ++i) s += $i; printf "%.1f", s / NF}' <<<"$1"; }
spread() { awk '{lo = $1; hi = $1; for (i = 2; i <= NF; ++i) { if ($i < lo) lo = $i; if ($i > hi) hi = $i }; printf "%.0f-%.0f", lo, hi}' <<<"$1"; }
single_all=
for b in "${backends[@]}"; do single_all+="${tps_runs[${names[0]},$b]}"; done
base=$(mean "$single_all")
echo "Baseline: ${names[0]}, $(mean "$single_all") tokens/s (runs: $single_all)"
echo
header="| layout | ranks x threads |"
rule="|---|---|"
for b in "${backends[@]}"; do header+=" $b tokens/s (runs) | $b vs single | $b per step outside compute |"; rule+="---|---|---|"; done
both=0
[[ " ${backends[*]} " == *" threads "* && " ${backends[*]} " == *" mpi "* ]] && both=1
(( both )) && { header+=" mpi / threads |"; rule+="---|"; }
echo "$header"
echo "$rule"
for spec in "${layouts[@]}"; do
  name=${spec%%:*}
  flags=${spec#*:}
  row="| $name ${flags:+(\`$flags\`)} | ${shape_of[$name]} |"
  for b in "${backends[@]}"; do
    m=$(mean "${tps_runs[$name,$b]}")
    row+=" $m ($(spread "${tps_runs[$name,$b]}")) | $(awk -v a="$m" -v s="$base" 'BEGIN {printf "%.2f", a / s}') | ${cost[$name,$b]} |"
  done
  (( both )) && row+=" $(awk -v m="$(mean "${tps_runs[$name,mpi]}")" -v t="$(mean "${tps_runs[$name,threads]}")" 'BEGIN {printf "%.2f", m / t}') |"
  echo "$row"
done

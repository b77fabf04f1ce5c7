#!/usr/bin/env bash
# Peak resident set of every process of a layout, against the single-device run (issue "Model
# parallelism that splits memory", acceptance 1): GPT-2 124M shapes (12 layers, 768 wide, 12 heads)
# over a vocabulary of 4096, B=4, T=128, a few steps with a validation pass and a checkpoint at the
# end (the sample is off: samples of a model-parallel run still assemble the weights on rank 0).
# One process per rank under mpirun, each measured by GNU time -v; beside it, the seconds the
# run's last checkpoint took (every rank writing its part, read back, committed).
#
#   bench/rss_layouts.sh [DATA_DIR] [LAYOUT ...]
#
# DATA_DIR holds token shards with a vocabulary of at most 4096 (scripts/quickstart.sh makes
# data/kjv). LAYOUTs are "name:flags" (default: the acceptance's layouts). Prints a markdown table.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/layout_util.sh
source "$root/bench/layout_util.sh"
shift || true
command -v mpirun >/dev/null || { echo "mpirun not found (apt-get install openmpi-bin)" >&2; exit 1; }
[[ -x /usr/bin/time ]] || { echo "/usr/bin/time not found (apt-get install time)" >&2; exit 1; }

layouts=("$@")
if [[ ${#layouts[@]} -eq 0 ]]; then
  layouts=("single:" "tp2:--parallel.tp 2" "pp2:--parallel.pp 2 --train.grad_accum 2"
           "dp2-zero3:--parallel.dp 2 --parallel.zero 3"
           "tp4:--parallel.tp 4" "pp4:--parallel.pp 4 --train.grad_accum 4"
           "dp4-zero3:--parallel.dp 4 --parallel.zero 3")
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--data.dir "$data" --model.n_layer 12 --model.n_head 12 --model.n_embd 768 --model.vocab_size 4096
        --data.seq_len 128 --train.batch_size 4 --train.steps 2 --train.eval_every 2 --train.eval_batches 1
        --train.sample_tokens 0 --train.checkpoint_every 2 --train.threads 1 --parallel.comm mpi)
single_kb=
echo "| layout | ranks | peak RSS per process (MiB) | largest / single device | checkpoint write (s) |"
echo "|---|---|---|---|---|"
for spec in "${layouts[@]}"; do
  name=${spec%%:*}
  flags=${spec#*:}
  ranks=$(ranks_of "$flags")
  out=$work/$name
  mkdir -p "$out"
  # shellcheck disable=SC2086
  if ! mpirun "${as_root[@]}" --oversubscribe -n "$ranks" sh -c \
      '/usr/bin/time -v -o "$0/rss_${OMPI_COMM_WORLD_RANK}" "$@"' "$out" \
      "$loom" train "${common[@]}" --train.out_dir "$out/run" $flags >"$out/log" 2>&1; then
    echo "$name: failed" >&2
    cat "$out/log" >&2
    exit 1
  fi
  kbs=()
  for ((r = 0; r < ranks; r++)); do
    kbs+=("$(awk -F': ' '/Maximum resident set size/ {print $2}' "$out/rss_$r")")
  done
  max=$(printf '%s\n' "${kbs[@]}" | sort -n | tail -1)
  [[ -z $single_kb ]] && single_kb=$max
  mbs=$(printf '%s\n' "${kbs[@]}" | awk '{printf "%s%.0f", (NR > 1 ? " / " : ""), $1 / 1024}')
  ratio=$(awk -v a="$max" -v b="$single_kb" 'BEGIN {printf "%.2f", a / b}')
  ckpt=$(sed -nE 's/^checkpoints: .* in ([0-9.]+) s$/\1/p' "$out/log")
  echo "| $name ${flags:+(\`$flags\`)} | $ranks | $mbs | $ratio | ${ckpt:-?} |"
done

#!/usr/bin/env bash
# What optimizer offload costs a step, measured against the planner's model of it: one device
# trains a model with and without `parallel.offload` (and offloaded with gradient accumulation,
# where the device's whole gradients go down once a step), and the median step time of the last
# steps (metrics.jsonl's time_s) is printed beside `loom plan`'s prediction for the same model,
# layout and batch (--precision device). What to compare is the difference: offload's measured
# extra seconds against the planner's extra optimizer seconds (the f32 gradients down and the bf16
# weights up over the host link, the host's AdamW over 16 bytes a parameter read and written).
#
#   bench/offload_time.sh [DATA_DIR]
#
# Environment: DEVICE (cuda, the default, or emu to try the script), CLUSTER (the planner's
# cluster: h100-sxm, the default, h200, a100-80gb or a TOML file), MODEL_FLAGS and MODEL_TOML (the
# model in `loom train` flags and in the planner's TOML fields; default GPT-2 124M's shapes on the
# data's vocabulary), BATCH (default 16), SEQ (default 1024), STEPS (default 12; the median is over
# the steps after the fourth).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/layout_util.sh
source "$root/bench/layout_util.sh"
device=${DEVICE:-cuda}
cluster=${CLUSTER:-h100-sxm}
batch=${BATCH:-16} seq=${SEQ:-1024} steps=${STEPS:-12}
vocab=$(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))))" "$data/encoder.json")
model_flags=${MODEL_FLAGS:-"--model.n_layer 12 --model.n_head 12 --model.n_embd 768"}
model_toml=${MODEL_TOML:-$'layers = 12\nhidden = 768\nheads = 12'}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '[model]\nname = "offload"\n%s\nvocab = %s\nseq = %s\n' "$model_toml" "$vocab" "$seq" > "$work/model.toml"
echo "offload on $device: $model_flags, V=$vocab, B=$batch, T=$seq, $steps steps; planner cluster $cluster;" \
  "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(nproc) cores"
[[ $device == cuda ]] && nvidia-smi --query-gpu=name --format=csv,noheader | head -1
echo
echo "| layout | measured s/step (median) | predicted s/step | predicted optimizer s | offload's extra, measured | predicted |"
echo "|---|---:|---:|---:|---:|---:|"
base_measured="" base_opt=""
for entry in "dp=1|" "dp=1,offload=1|--parallel.offload true" \
    "dp=1,offload=1 (grad_accum 4)|--parallel.offload true --train.grad_accum 4"; do
  name=${entry%%|*} flags=${entry#*|}
  ga=$(sed -nE 's/.*--train\.grad_accum ([0-9]+).*/\1/p' <<<"$flags")
  plan_layout="${name%% *},mbs=$((batch / ${ga:-1}))"
  rm -rf "$work/run"
  # shellcheck disable=SC2086
  if ! "$loom" train --data.dir "$data" $model_flags --data.seq_len "$seq" --train.batch_size "$batch" \
      --train.steps "$steps" --train.eval_every 0 --train.sample_tokens 0 --train.checkpoint_every 0 \
      --train.device "$device" --train.out_dir "$work/run" --overwrite --quiet $flags > "$work/train.log" 2>&1; then
    echo "| $name | run failed: $(tail -1 "$work/train.log") | | | | |"
    continue
  fi
  pred=$("$loom" plan --model "$work/model.toml" --cluster "$cluster" --gpus 1 --global-batch "$batch" --seq "$seq" \
    --precision device --layout "$plan_layout" --json)
  python3 - "$work/run/metrics.jsonl" "$pred" "$name" "$base_measured" "$base_opt" > "$work/row" 2> "$work/base" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
times = [r["time_s"] for r in rows if "time_s" in r and r.get("step", 0) > 4]
p = json.loads(sys.argv[2])
m, s, o = statistics.median(times), p["step_time_s"], p["time_s"]["optimizer"]
extra = (f"{m - float(sys.argv[4]):.4g} | {o - float(sys.argv[5]):.4g}" if sys.argv[4] else " | ")
print(f"| {sys.argv[3]} | {m:.4g} | {s:.4g} | {o:.4g} | {extra} |")
print(f"{m} {o}", file=sys.stderr)
PY
  cat "$work/row"
  [[ -z $base_measured ]] && read -r base_measured base_opt < "$work/base"
done
echo

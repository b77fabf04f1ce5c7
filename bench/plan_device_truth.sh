#!/usr/bin/env bash
# The planner's memory model of loom's device runs (`loom plan --precision device`) against the
# pools of real runs, tag by tag: each layout trains a few steps with `loom train --train.device
# DEVICE` (bf16), and the fullest rank's peaks from OUT/memory.json (all tags at once, and each
# tag's own peak; under offload the host pool's) are printed beside the prediction for the same
# model, layout, micro-batch and sequence.
#
#   bench/plan_device_truth.sh [DATA_DIR] [LAYOUT ...]
#
# Environment: DEVICE (emu, the default, or cuda: ranks as threads sharing the GPU), FAMILY (gpt,
# the default, or llama), STEPS (default 2). LAYOUTs are "plan_layout|train_flags" (default: the
# list of tests/cli/plan_device_truth_cli_test.cpp, which checks the emulated device's figures in
# the default suite). On CUDA the backend's own scratch (its BLAS handles' workspaces, cuDNN's)
# is in the device pool and not in the prediction: the workspace column shows it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=bench/layout_util.sh
source "$root/bench/layout_util.sh"
shift || true
device=${DEVICE:-emu}
family=${FAMILY:-gpt}
steps=${STEPS:-2}
batch=16 seq=64 vocab=4096
case "$family" in
  gpt)
    model_flags="--model.n_layer 4 --model.n_head 4 --model.n_embd 128"
    model_toml=$'layers = 4\nhidden = 128\nheads = 4' ;;
  llama)
    model_flags="--model.preset llama-tiny --model.n_layer 4 --model.n_head 4 --model.n_embd 128 --model.n_kv_head 2 --model.ffn_hidden 352"
    model_toml=$'layers = 4\nhidden = 128\nheads = 4\nkv_heads = 2\nffn = 352\nswiglu = true\ntied = false\nbias = false\nlearned_positions = false' ;;
  *) echo "FAMILY must be gpt or llama, got '$family'" >&2; exit 2 ;;
esac
layouts=("$@")
if [[ ${#layouts[@]} -eq 0 ]]; then
  layouts=(
    "dp=1|"
    "dp=2,zero=2|--parallel.dp 2 --parallel.zero 2"
    "dp=4,zero=3|--parallel.dp 4 --parallel.zero 3"
    "tp=2|--parallel.tp 2"
    "tp=2,zero=3|--parallel.tp 2 --parallel.zero 3"
    "tp=4,sp=1|--parallel.tp 4 --parallel.sp true"
    "cp=2,tp=2,sp=1|--parallel.cp 2 --parallel.tp 2 --parallel.sp true"
    "dp=2,cp=2,zero=1|--parallel.dp 2 --parallel.cp 2 --parallel.zero 1"
    "pp=2,schedule=gpipe|--parallel.pp 2 --train.grad_accum 4 --parallel.schedule gpipe"
    "pp=2,v=2,schedule=interleaved|--parallel.pp 2 --train.grad_accum 4 --parallel.schedule interleaved --parallel.virtual_stages 2"
    "pp=2,schedule=zb-h1|--parallel.pp 2 --train.grad_accum 4 --parallel.schedule zb-h1"
    "dp=2,pp=2,zero=3|--parallel.dp 2 --parallel.pp 2 --train.grad_accum 4 --parallel.zero 3"
    "tp=2,pp=2|--parallel.tp 2 --parallel.pp 2 --train.grad_accum 4"
    "dp=2,zero=3,recompute=full|--parallel.dp 2 --parallel.zero 3 --memory.recompute full"
    "tp=2,sp=1,recompute=selective|--parallel.tp 2 --parallel.sp true --memory.recompute selective"
    "dp=2,zero=1,offload=1|--parallel.dp 2 --parallel.zero 1 --parallel.offload true"
    "tp=2,pp=2,offload=1|--parallel.tp 2 --parallel.pp 2 --train.grad_accum 4 --parallel.offload true"
    "dp=4,zero=3,offload=1|--parallel.dp 4 --parallel.zero 3 --parallel.offload true"
    "dp=2,pp=2,zero=2,offload=1|--parallel.dp 2 --parallel.pp 2 --train.grad_accum 4 --parallel.zero 2 --parallel.offload true"
  )
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '[model]\nname = "%s"\n%s\nvocab = %s\nseq = %s\n' "$family" "$model_toml" "$vocab" "$seq" > "$work/model.toml"
echo "$family: L=4, C=128, 4 heads, V=$vocab, T=$seq, global batch $batch; train.device $device, bf16;" \
  "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')"
echo
echo "| layout | ranks | measured peak (fullest rank) | predicted | error | params | grads | optimizer | activations | workspace | comm | host (offload) |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for entry in "${layouts[@]}"; do
  plan_layout=${entry%%|*} flags=${entry#*|}
  ranks=$(ranks_of "$flags")
  dp=$(sed -nE 's/.*--parallel\.dp ([0-9]+).*/\1/p' <<<"$flags")
  ga=$(sed -nE 's/.*--train\.grad_accum ([0-9]+).*/\1/p' <<<"$flags")
  plan_layout="$plan_layout,mbs=$((batch / ${dp:-1} / ${ga:-1}))"
  rm -rf "$work/run"
  # shellcheck disable=SC2086
  if ! "$loom" train --data.dir "$data" $model_flags --model.vocab_size "$vocab" --data.seq_len "$seq" \
      --train.batch_size "$batch" --train.steps "$steps" --train.eval_every 0 --train.sample_tokens 0 \
      --train.checkpoint_every 0 --train.threads 1 --train.device "$device" --train.out_dir "$work/run" \
      --overwrite $flags > "$work/train.log" 2>&1; then
    echo "| $plan_layout | $ranks | run failed: $(tail -1 "$work/train.log") | | | | | | | | | |"
    continue
  fi
  if ! pred=$("$loom" plan --model "$work/model.toml" --cluster h100-sxm --gpus "$ranks" --global-batch "$batch" \
      --seq "$seq" --precision device --layout "$plan_layout" --json 2>&1); then
    echo "| $plan_layout | $ranks | plan failed: $pred | | | | | | | | | |"
    continue
  fi
  python3 - "$work/run/memory.json" "$pred" "$plan_layout" "$ranks" <<'PY'
import json, sys
ranks = json.load(open(sys.argv[1]))["ranks"]
p = json.loads(sys.argv[2])
mem, host_p = p["memory_bytes_per_gpu"], p.get("host_memory_bytes_per_gpu", {})
r = max(ranks, key=lambda r: r["all_tags_peak_bytes"])
mib = lambda b: f"{b / 2**20:.2f}"
measured, predicted = r["all_tags_peak_bytes"], sum(mem.values())
tags = [f"{mib(r['peak_bytes'].get(t, 0))} / {mib(mem.get(t, 0))}"
        for t in ("params", "grads", "optimizer", "activations", "workspace", "comm")]
host = " ".join(f"{t} {mib(max(q['host_peak_bytes'].get(t, 0) for q in ranks))} / {mib(b)}" for t, b in host_p.items())
print(f"| {sys.argv[3]} | {sys.argv[4]} | {mib(measured)} MiB | {mib(predicted)} MiB | "
      f"{100 * (predicted / measured - 1):+.1f}% | " + " | ".join(tags) + f" | {host} |")
PY
done
echo
echo "Tags: measured / predicted MiB, each tag's own peak on the fullest rank (they need not coincide:"
echo "the peak sums them at one moment); host: the most any rank keeps in the host pool."

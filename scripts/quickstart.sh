#!/usr/bin/env bash
# The main job: install dependencies, build loom, install a public-domain corpus from Debian (the
# King James Bible, package bible-kjv), train a byte-level BPE vocabulary and token shards
# from it, then train a ~10M-parameter GPT on the CPU for a few minutes and print a sample.
# Extra arguments are passed to `loom train` (e.g. --train.steps 50).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/install_deps.sh
build=${LOOM_BUILD_DIR:-$root/build}
cmake -G Ninja -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
ninja -C "$build" -j"${JOBS:-$(nproc)}" loom
mkdir -p data/kjv
if [[ ! -s data/kjv/kjv.txt ]]; then
  # Every verse of the Authorized Version, without the "Ge1:1" references.
  bible -f "Genesis 1:1-Revelation 22:21" | sed -E 's/^[0-9]?[A-Za-z]+[0-9]+:[0-9]+ //' > data/kjv/kjv.txt.tmp
  mv data/kjv/kjv.txt.tmp data/kjv/kjv.txt
fi
if [[ ! -s data/kjv/train_000.bin ]]; then
  "$build/loom" prepare data/kjv/kjv.txt --out data/kjv --vocab-size 4096 --val-fraction 0.05
fi
# Each run of this script starts the run over (--overwrite), unless it is asked to --resume.
fresh=(--overwrite)
for arg in "$@"; do [[ $arg == --resume || $arg == --overwrite ]] && fresh=(); done
"$build/loom" train configs/kjv-10m.toml "${fresh[@]}" "$@"
echo "loss curve: runs/kjv-10m/loss.png   metrics: runs/kjv-10m/metrics.jsonl"

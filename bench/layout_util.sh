# Helpers the layout benchmarks share (sourced by bench/layouts.sh and bench/rss_layouts.sh).
# Sourcing it sets loom (LOOM, default the build's) and data (the script's first argument, default
# data/kjv) and checks both, then the caller shifts its arguments past DATA_DIR.
loom=${LOOM:-$root/build/loom}
data=${1:-$root/data/kjv}
[[ -x $loom ]] || { echo "$loom: not built (ninja -C build loom)" >&2; exit 1; }
[[ -s $data/train_000.bin ]] || { echo "$data: no token shards (run scripts/quickstart.sh first)" >&2; exit 1; }

# The ranks a layout runs on: the product of dp, tp, pp and cp in `loom train` flags.
ranks_of() {
  local ranks=1 axis n
  for axis in dp tp pp cp; do
    n=$(sed -nE "s/.*--parallel\.$axis ([0-9]+).*/\1/p" <<<"$1")
    ranks=$((ranks * ${n:-1}))
  done
  echo "$ranks"
}

# mpirun's flag to run as root where the benchmark does (containers).
as_root=()
[[ $(id -u) == 0 ]] && as_root=(--allow-run-as-root)

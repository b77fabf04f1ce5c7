# Helpers the layout benchmarks share (sourced by bench/layouts.sh and bench/rss_layouts.sh).

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

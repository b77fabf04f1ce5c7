#!/usr/bin/env bash
# Install dependencies, build loom (Release, CUDA targets too when nvcc is found) and run the default
# test suite. Extra arguments go to ctest (e.g. -L long for the long tests).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install_deps.sh"
build=${LOOM_BUILD_DIR:-$root/build}
jobs=${JOBS:-$(nproc)}
cmake -G Ninja -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release
ninja -C "$build" -j"$jobs"
cd "$build"
args=("$@")
((${#args[@]})) || args=(-LE "long|torch")
if ! ctest --output-on-failure -j"$jobs" "${args[@]}"; then
  # The failures' output is buried among hundreds of lines above: run the failed tests once more,
  # one at a time, so their output ends the log. The suite has failed either way.
  echo "=== failed tests, run again one at a time for their output ==="
  ctest --rerun-failed --output-on-failure -j1 || true
  exit 8
fi

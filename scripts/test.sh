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
  # The failures' output is buried among hundreds of lines above. Keep it, run the failed tests
  # once more one at a time (does a failure repeat alone?), then end the log with what failed.
  # The suite has failed either way.
  log=Testing/Temporary/LastTest.log
  failed=$(awk '/^[0-9]+\/[0-9]+ Testing: /{b=""} {b=b $0 "\n"} /^Test Failed/{f=1} / time elapsed: /{if (f) printf "%s", b; f=0}' "$log")
  echo "=== the failed tests, run again one at a time ==="
  ctest --rerun-failed --output-on-failure -j1 || true
  echo "=== the failed tests' output from the suite's run ==="
  printf '%s\n' "$failed"
  exit 8
fi

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
if (($#)); then
  ctest --output-on-failure -j"$jobs" "$@"
else
  ctest --output-on-failure -j"$jobs" -LE "long|torch"
fi

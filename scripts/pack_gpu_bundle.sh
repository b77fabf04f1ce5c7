#!/usr/bin/env bash
# Build loom's CUDA targets on this (build) machine and pack what a GPU host without loom's
# build dependencies needs to run them: the executables plus the non-CUDA shared libraries they
# load that a stock CUDA image may lack (oneDNN, Google Benchmark, toml++, cairo and the font and X
# libraries it pulls in), compressed.
#   scripts/pack_gpu_bundle.sh [BUILD_DIR] [BUNDLE_DIR]   (defaults: build-cuda, .devbundle)
# On the GPU host: scripts/gpu_env.sh BUNDLE_DIR <command...> runs a command with the bundle's
# executables on PATH and its libraries on LD_LIBRARY_PATH.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build-cuda}
bundle=${2:-$root/.devbundle}
cmake -G Ninja -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DLOOM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a >/dev/null
targets=${LOOM_GPU_TARGETS:-}
if [[ -z "$targets" ]]; then
  ninja -C "$build" -j"${JOBS:-2}"
else
  ninja -C "$build" -j"${JOBS:-2}" $targets
fi
rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib"
for exe in "$build"/loom "$build"/tests/test_cuda "$build"/bench_* "$build"/train_*; do
  [[ -x "$exe" && -f "$exe" ]] && cp "$exe" "$bundle/bin/"
done
# loom loads its CUDA code from the plugin beside it (core/backend.h: load_cuda_plugin).
cp "$build"/libloom_cuda.so "$bundle/bin/"
for lib in $(ldd "$bundle"/bin/* 2>/dev/null | awk '/=>/ {print $3}' | sort -u); do
  case "$(basename "$lib")" in
    libdnnl.so*|libbenchmark.so*|libtomlplusplus.so*|libcairo.so*|libpixman-1.so*|libfontconfig.so*|\
    libfreetype.so*|libxcb*.so*|libX*.so*|libbrotli*.so*|libbsd.so*|libmd.so*|libOpenCL.so*) xz -T2 -1 -c "$lib" > "$bundle/lib/$(basename "$lib").xz" ;;
  esac
done
# Provenance for the results: the commit the bundle was built from (and whether the tree had changes).
{
  git -C "$root" rev-parse HEAD 2>/dev/null || echo "unknown commit"
  [[ -z "$(git -C "$root" status --porcelain 2>/dev/null)" ]] || echo "with uncommitted changes"
  date -u +"built %Y-%m-%d %H:%M UTC"
} > "$bundle/COMMIT"
du -sh "$bundle"

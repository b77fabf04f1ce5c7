#!/usr/bin/env bash
# Run a command with a bundle made by scripts/pack_gpu_bundle.sh: unpacks its libraries once and
# puts its executables and libraries first on PATH and LD_LIBRARY_PATH.
#   scripts/gpu_env.sh BUNDLE_DIR command [args...]
set -euo pipefail
bundle=$(cd "$1" && pwd); shift
libdir=${TMPDIR:-/tmp}/loom-bundle-lib
mkdir -p "$libdir"
for f in "$bundle"/lib/*.xz; do
  [[ -e "$f" ]] || continue
  out="$libdir/$(basename "${f%.xz}")"
  [[ -e "$out" ]] || xz -dc "$f" > "$out"
done
export PATH="$bundle/bin:$PATH"
export LD_LIBRARY_PATH="$libdir:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$@"

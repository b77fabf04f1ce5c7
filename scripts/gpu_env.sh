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
# cuDNN and NCCL may be installed only inside Python wheels (PyTorch's nvidia-cudnn, nvidia-nccl):
# their folders go last, so they serve only what the system's folders lack.
wheel_libs=""
if command -v python3 >/dev/null; then
  for sp in $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null); do
    for f in "$sp"/nvidia/*/lib/libcudnn.so.9 "$sp"/nvidia/*/lib/libnccl.so.2; do
      if [[ -e "$f" ]]; then wheel_libs="$wheel_libs:$(dirname "$f")"; fi
    done
  done
fi
export PATH="$bundle/bin:$PATH"
export LD_LIBRARY_PATH="$libdir:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}$wheel_libs"
exec "$@"

#!/usr/bin/env bash
# Install loom's build and test dependencies from Debian's packages (idempotent; root or sudo).
# bible-kjv is the `bible` program over the King James text (bible-kjv-text, its dependency): the
# main job's corpus and the 4D training test's. ocl-icd-opencl-dev (libOpenCL and the OpenCL
# headers) is only recommended by libdnnl-dev, but oneDNN's CMake package requires it. Packages
# are installed without their recommendations, so everything used is named here. time is GNU time,
# whose -v measures a run's peak resident set (the per-rank memory checks of bench/README.md).
set -euo pipefail
pkgs=(build-essential cmake ninja-build pkg-config libdnnl-dev libopenblas-dev libopenmpi-dev openmpi-bin
      libcli11-dev libtomlplusplus-dev libfmt-dev nlohmann-json3-dev libgtest-dev libgmock-dev
      libbenchmark-dev libpng-dev libcairo2-dev clang libclang-rt-14-dev bible-kjv xz-utils ocl-icd-opencl-dev time)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""; [[ $(id -u) -ne 0 ]] && sudo="sudo"
  echo "installing: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

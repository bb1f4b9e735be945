#!/usr/bin/env bash
# Installs every Debian package laga needs to build, test, benchmark and plot,
# then the torch 2 venv (scripts/setup_torch2.sh).
# Idempotent: packages already present are skipped, and `apt-get update` runs
# at most once per invocation (and only when something is missing).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config clang-format
  clang libclang-rt-dev      # scripts/fuzz.sh: libFuzzer, ASan, UBSan (the runtimes are
                             # only recommended by clang, and recommends are not installed)
  libdnnl-dev                # oneDNN: dnnl_sgemm, laga's float GEMMs (docs/performance.md)
  ocl-icd-opencl-dev         # oneDNN's CMake config requires OpenCL (its GPU runtime); Debian
                             # only recommends it, and recommends are not installed
  libopenblas-dev            # CBLAS dgemm (double: tests, finite differences)
  libomp-dev                 # OpenMP runtime headers (g++ uses libgomp)
  libopenmpi-dev openmpi-bin # MPI backend and mpirun
  libgtest-dev libgmock-dev  # unit tests
  libcli11-dev               # command-line parsing
  nlohmann-json3-dev         # JSON configs and reports
  python3 python3-numpy python3-matplotlib python3-torch  # reference tests, plots
  fortunes                   # real English text for the training run (python/train_text.sh)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
else
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# PyPI's torch 2 and triton in build/torch2-venv, for the package suite's
# torch 2 run and the Triton kernel's tests (downloaded once, then reused).
bash "$(dirname "$0")/setup_torch2.sh" build

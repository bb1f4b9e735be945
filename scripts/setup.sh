#!/usr/bin/env bash
# Installs every Debian package laga needs to build, test, benchmark and plot,
# then the torch 2 venv (scripts/setup_torch2.sh).
# Idempotent: packages already present are skipped, and `apt-get update` runs
# at most once per invocation (and only when something is missing).
#
#   scripts/setup.sh                    the Debian packages
#   scripts/setup.sh --cuda BUILD_DIR   and cudnn-frontend's C++ headers for the
#                                       CUDA backend (docs/build.md, "The CUDA backend")
#
# --cuda: PyPI's nvidia-cudnn-frontend wheel (pinned below) is downloaded with
# pip into BUILD_DIR/_deps/cudnn_frontend/ and its include/ unpacked there,
# where CMake looks (LAGA_CUDNN_FRONTEND_INCLUDE). A second run finds the
# headers and downloads nothing. Without network or pip the step says so and
# exits 0: the build then has no cuDNN SDPA path (CMake says so), not a
# failure.
set -euo pipefail

cudnn_frontend_version=1.32.0
if [ "${1:-}" = "--cuda" ]; then
  build_dir=${2:?"usage: scripts/setup.sh --cuda BUILD_DIR"}
  deps="$build_dir/_deps/cudnn_frontend"
  if [ -f "$deps/include/cudnn_frontend.h" ]; then
    echo "setup: cudnn-frontend headers present in $deps/include"
  else
    mkdir -p "$deps/wheel"
    wheel=$(ls "$deps"/wheel/nvidia_cudnn_frontend-"$cudnn_frontend_version"-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$wheel" ]; then
      echo "setup: downloading nvidia-cudnn-frontend==$cudnn_frontend_version (its C++ headers)"
      if ! python3 -m pip download --no-deps --only-binary=:all: -q -d "$deps/wheel" \
          "nvidia-cudnn-frontend==$cudnn_frontend_version"; then
        echo "setup: nvidia-cudnn-frontend could not be downloaded; the CUDA backend builds" \
             "without its cuDNN SDPA path (run this again where PyPI is reachable)"
        exit 0
      fi
      wheel=$(ls "$deps"/wheel/nvidia_cudnn_frontend-*.whl | head -1)
    fi
    rm -rf "$deps/include.tmp" && mkdir -p "$deps/include.tmp"
    python3 - "$wheel" "$deps/include.tmp" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    names = [n for n in z.namelist() if n.startswith("include/")]
    z.extractall(sys.argv[2], names)
PY
    rm -rf "$deps/include" && mv "$deps/include.tmp/include" "$deps/include" && rmdir "$deps/include.tmp"
    echo "setup: cudnn-frontend headers in $deps/include"
  fi
  shift 2
fi

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
# LAGA_SETUP_TORCH2=0: not here (scripts/test.sh makes it in the background,
# beside the main build).
if [ "${LAGA_SETUP_TORCH2:-1}" != 0 ]; then
  bash "$(dirname "$0")/setup_torch2.sh" build
fi

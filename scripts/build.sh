#!/usr/bin/env bash
# Configures and builds laga into build/ (Release, warnings as errors).
# Usage: scripts/build.sh [extra cmake -D options]
set -euo pipefail
cd "$(dirname "$0")/.."
# The torch 2 venv (scripts/setup_torch2.sh) when it is there: the package
# tests run again under it (tests/CMakeLists.txt laga_add_torch_test); empty
# otherwise, so a removed venv leaves no stale interpreter in the cache.
torch2=""
if [ -x build/torch2-venv/bin/python ]; then torch2=$PWD/build/torch2-venv/bin/python; fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLAGA_WERROR=ON \
  "-DLAGA_TORCH2_PYTHON=$torch2" "$@" >/dev/null
cmake --build build -j "$(nproc)"

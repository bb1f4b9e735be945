#!/usr/bin/env bash
# Configures and builds laga into build/ (Release, warnings as errors).
# Usage: scripts/build.sh [extra cmake -D options]
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLAGA_WERROR=ON "$@" >/dev/null
cmake --build build -j "$(nproc)"

#!/usr/bin/env bash
# The main job: set up, build, and compare the three forms side by side on the
# small default config (wire bytes, peak activation memory, throughput,
# agreement). Extra arguments go to `laga compare`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
./build/laga compare "$@"

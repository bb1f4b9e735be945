#!/usr/bin/env bash
# The whole test suite, as CI runs it: set up, build with warnings as errors,
# run every test (unit, PyTorch reference, MPI under mpirun, the laga tool),
# then the unit tests again under AddressSanitizer + UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
bash scripts/setup.sh
bash scripts/build.sh
ctest --test-dir build --output-on-failure -j 2

# Sanitizers: unit tests only (the MPI launcher and Python are not ours to
# instrument); leak checking is off because OpenMPI's and OpenBLAS' one-time
# allocations are reported as leaks.
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLAGA_WERROR=ON \
  -DLAGA_SANITIZE=ON >/dev/null
cmake --build build-asan -j "$(nproc)"
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j 2 -L 'core|kernels|comm|io|mla|model' -LE mpi
echo "test.sh: done in $(( $(date +%s) - start )) s"

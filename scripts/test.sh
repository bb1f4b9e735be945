#!/usr/bin/env bash
# The whole test suite, as CI runs it: set up, check formatting, build with
# warnings as errors, run every test (unit, PyTorch reference, MPI under
# mpirun, the laga tool), then the unit tests again under AddressSanitizer +
# UndefinedBehaviorSanitizer, then each fuzz target for 20 s.
#
# A run proves only what ran, so each ctest invocation must run every test it
# registered: --no-tests=error fails an empty selection, and the count of tests
# run is compared with `ctest -N` for the same selection. Skipped tests are
# listed at the end of each run; under CI=true a GoogleTest skip not listed in
# tests/allowed_skips.txt already fails its test (tests/common/gtest_main.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# Where nvcc is present (every machine here) the CUDA backend is built, and
# its cuDNN SDPA path needs cudnn-frontend's C++ headers from PyPI: fetched
# into build/ once (docs/build.md, "The CUDA backend"), so CI compiles it.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  bash scripts/setup.sh --cuda build
else
  bash scripts/setup.sh
fi

# Formatting: every C++ file under src, tests and bench, by the repository's
# .clang-format. Fix with: clang-format -i FILE
mapfile -t sources < <(find src tests bench -type f \( -name '*.cpp' -o -name '*.hpp' \
  -o -name '*.inc' \) | sort)
if ! clang-format --dry-run --Werror "${sources[@]}"; then
  echo "test.sh: the files above are not clang-formatted; run clang-format -i on them" >&2
  exit 1
fi

bash scripts/build.sh

# ctest -j 2 runs two test binaries at once, each with OMP_NUM_THREADS=2: four
# OpenMP threads on two cores. With OpenMP's default (active) waiting, an idle
# thread spins on a core the other binary needs, which made the sanitizer
# pass's mla tests 3.2x slower (66 s vs 20.6 s wall for `ctest -L mla -LE mpi
# -j 2` under ASan). Passive waiting changes no result.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

# run_ctest BUILD_DIR [selection args...]: runs ctest on the selection and fails
# unless every test `ctest -N` lists for it ran.
run_ctest() {
  local dir=$1
  shift
  local registered log ran
  registered=$(ctest --test-dir "$dir" -N "$@" | sed -n 's/^Total Tests: //p')
  log="$dir/ctest_run.log"
  ctest --test-dir "$dir" --output-on-failure --no-tests=error -j 2 "$@" 2>&1 | tee "$log"
  ran=$(sed -n 's/.*tests failed out of \([0-9][0-9]*\)$/\1/p' "$log" | tail -n 1)
  if [ -z "$registered" ] || [ "$registered" -eq 0 ] || [ "${ran:-0}" -ne "$registered" ]; then
    echo "test.sh: ctest in $dir ($*) registered ${registered:-no} tests but ran ${ran:-none}" >&2
    exit 1
  fi
  if grep -q '(Skipped)' "$log"; then
    echo "test.sh: skipped in $dir (each test's laga-skip: lines give the reason):"
    grep '(Skipped)' "$log" | sed 's/^/  /'
  fi
}

run_ctest build

# Sanitizers: unit tests only (the MPI launcher and Python are not ours to
# instrument), so only their binaries are built (target unit_tests); -g1 (line
# tables) is all a sanitizer report's stack needs and compiles much faster
# than -g. Leak checking is off because OpenMPI's and OpenBLAS' one-time
# allocations are reported as leaks. -O1, AddressSanitizer's own advice: its
# compile is the suite's largest cost, and -O1 compiles a heavy test file in
# about 0.6-0.75 of -O2's time (test_comm_local.cpp under ASan, 52 s against
# 68-90 s, one core each, 2026-12-02, Intel Xeon, shared).
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLAGA_WERROR=ON \
  -DLAGA_SANITIZE=ON "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" >/dev/null
cmake --build build-asan -j "$(nproc)" --target unit_tests
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  run_ctest build-asan -L 'core|kernels|comm|io|mla|model' -LE mpi

# Coverage-guided fuzzing of every reader (docs/reliability.md, "Fuzzing"):
# each libFuzzer target for 20 s on its committed seed corpus; a crash fails
# the suite and leaves its input in build-fuzz/artifacts/.
bash scripts/fuzz.sh 20
echo "test.sh: done in $(( $(date +%s) - start )) s"

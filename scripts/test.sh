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
# One line per phase, "test.sh: <phase> took N s", so a run's log says where
# its time went (docs/testing.md, "Suite time").
phase_start=$start
# Each line also gives the disk space left where the builds are: a suite
# holds up to 10.9 GB (the torch 2 venv 5.9 GB, the ASan build 3.4 GB, the
# main build about 1 GB; docs/testing.md, "Suite disk"), and a CI run that
# once failed with "No space left on device" could not say how close it was.
phase_done() {
  local now free
  now=$(date +%s)
  free=$(df -Pk . | awk 'NR == 2 { printf "%.1f GB", $4 / 1048576 }')
  echo "test.sh: $1 took $(( now - phase_start )) s (disk: $free free)"
  phase_start=$now
}
# Where nvcc is present (every machine here) the CUDA backend is built, and
# its cuDNN SDPA path needs cudnn-frontend's C++ headers from PyPI: fetched
# into build/ once (docs/build.md, "The CUDA backend"), so CI compiles it.
# The torch 2 venv (scripts/setup_torch2.sh: a multi-GB download, then pip)
# is made in the background while the main build compiles, and waited for
# before the first ctest; LAGA_SETUP_TORCH2=0 keeps setup.sh from making it.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  LAGA_SETUP_TORCH2=0 bash scripts/setup.sh --cuda build
else
  LAGA_SETUP_TORCH2=0 bash scripts/setup.sh
fi
mkdir -p build
# A clean clone (CI) never reuses the wheelhouse: dropped once the venv is made.
if [ "${CI:-}" = true ]; then export LAGA_TORCH2_WHEELS=${LAGA_TORCH2_WHEELS:-drop}; fi
bash scripts/setup_torch2.sh build >build/setup_torch2.log 2>&1 &
torch2_setup=$!
# A failure before the wait below leaves no download running behind it.
trap 'kill "$torch2_setup" 2>/dev/null || true' EXIT
# The *_torch2 tests are registered at configure time, before the venv may
# exist: name its interpreter now unless LAGA_TORCH2=off (then none).
torch2_python=""
if [ "${LAGA_TORCH2:-on}" != off ]; then torch2_python=$PWD/build/torch2-venv/bin/python; fi
phase_done "setup (apt, cudnn-frontend; torch 2 venv in the background)"

# Formatting: every C++ file under src, tests and bench, by the repository's
# .clang-format. Fix with: clang-format -i FILE
mapfile -t sources < <(find src tests bench -type f \( -name '*.cpp' -o -name '*.hpp' \
  -o -name '*.inc' \) | sort)
if ! clang-format --dry-run --Werror "${sources[@]}"; then
  echo "test.sh: the files above are not clang-formatted; run clang-format -i on them" >&2
  exit 1
fi

phase_done "clang-format"

bash scripts/build.sh "-DLAGA_TORCH2_PYTHON=$torch2_python"
phase_done "main build"
if ! wait "$torch2_setup"; then
  cat build/setup_torch2.log >&2
  echo "test.sh: scripts/setup_torch2.sh failed (its log is above)" >&2
  exit 1
fi
trap - EXIT
cat build/setup_torch2.log
phase_done "waiting for the torch 2 venv"

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

# Sanitizers: unit tests only (the MPI launcher and Python are not ours to
# instrument), so only their binaries are built (target unit_tests); -g1 (line
# tables) is all a sanitizer report's stack needs and compiles much faster
# than -g. Leak checking is off because OpenMPI's and OpenBLAS' one-time
# allocations are reported as leaks. -O1 (the libraries; test code compiles
# at -O0 there, tests/CMakeLists.txt), AddressSanitizer's own advice: its
# compile is the suite's largest cost, and -O1 compiles a heavy test file in
# about 0.6-0.75 of -O2's time (test_comm_local.cpp under ASan, 52 s against
# 68-90 s, one core each, 2026-12-02, Intel Xeon, shared).
# -gz keeps those line tables zlib-compressed in the objects and the test
# binaries (llvm-symbolizer reads them: a report still names file:line):
# the build is 3.4 GB on disk, not about 3.9 (a test binary 55.5 MB against
# 64.4 MB decompressed; 2026-12-07). With it the whole ASan build took 791
# user + 56 sys s on the shared Xeon; its cost alone was not measured.
configure_asan() {
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DLAGA_WERROR=ON \
    -DLAGA_SANITIZE=ON "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -gz -DNDEBUG" \
    -DCMAKE_EXE_LINKER_FLAGS=-gz >/dev/null
}

# The ASan build starts now, at the lowest CPU priority, beside the main
# ctest: that pass leaves cores idle (an mpirun launch or a rank waiting on
# another, a PROCESSORS 2 test whose ranks take turns), and the build takes
# only what the tests leave (nice 19 against the tests' 0; docs/testing.md,
# "Suite time"). It is a process group of its own, so a failure here stops
# it whole.
configure_asan
setsid nice -n 19 cmake --build build-asan -j "$(nproc)" --target unit_tests \
  >build-asan/build.log 2>&1 &
asan_build=$!
trap 'kill -- "-$asan_build" 2>/dev/null || true' EXIT
run_ctest build
phase_done "main ctest"

if ! wait "$asan_build"; then
  cat build-asan/build.log >&2
  echo "test.sh: the ASan build failed (its log is above)" >&2
  exit 1
fi
trap - EXIT
tail -n 1 build-asan/build.log
phase_done "ASan build (what was left of it after the main ctest)"
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  run_ctest build-asan -L 'core|kernels|comm|io|mla|model' -LE mpi
phase_done "ASan ctest"

# Coverage-guided fuzzing of every reader (docs/reliability.md, "Fuzzing"):
# each libFuzzer target for 20 s on its committed seed corpus; a crash fails
# the suite and leaves its input in build-fuzz/artifacts/.
bash scripts/fuzz.sh 20
phase_done "fuzz (build and 5 x 20 s)"
echo "test.sh: done in $(( $(date +%s) - start )) s"

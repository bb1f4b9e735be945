#!/usr/bin/env bash
# Runs the MPI backend's tests under mpirun at several sizes.
#
#   scripts/run_mpi_tests.sh [BUILD_DIR] [NP...]
#
# BUILD_DIR defaults to build (configured and the test built if needed); NP
# defaults to 2 3 4 8. Ranks are oversubscribed, so 8 ranks run on 2 cores.
# Each run is capped at 60 s by `timeout`, so a hang can never block CI.
# Extra mpirun options can come from MPIRUN_FLAGS, e.g. MPIRUN_FLAGS="--mca
# btl_vader_single_copy_mechanism none" in containers without ptrace.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
shift || true
sizes=("$@")
if [ ${#sizes[@]} -eq 0 ]; then sizes=(2 3 4 8); fi

if [ ! -f "$build/CMakeCache.txt" ]; then
  cmake -S "$root" -B "$build" -G Ninja
fi
cmake --build "$build" --target test_comm_mpi

as_root=()
if [ "$(id -u)" -eq 0 ]; then as_root=(--allow-run-as-root); fi

status=0
for np in "${sizes[@]}"; do
  echo "== mpirun -np $np test_comm_mpi"
  # One OpenMP/BLAS thread per rank: the ranks already share the cores.
  if OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout 60 \
      mpirun "${as_root[@]}" --oversubscribe ${MPIRUN_FLAGS:-} -np "$np" \
      "$build/tests/comm/test_comm_mpi"; then
    echo "== np $np: passed"
  else
    echo "== np $np: FAILED (exit $?)"
    status=1
  fi
done
exit $status

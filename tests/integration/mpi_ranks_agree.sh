#!/usr/bin/env bash
# MPI ranks launched with different options refuse to run (issue 10 item 8):
# every rank names the option and the ranks that differ, and the job exits
# non-zero; the same options run. Usage: mpi_ranks_agree.sh LAGA MPIEXEC
set -uo pipefail
laga=$1 mpiexec=$2
A="--d-model 64 --heads 4 --layers 1 --vocab 256 --seq 32 --steps 2 --sp 2 --comm mpi --quiet"
run() { timeout 60 "$mpiexec" --allow-run-as-root --oversubscribe "$@" 2>&1; }
fail=0
for opt in "--seed 1:--seed 2" "--lr 0.001:--lr 0.002" "--form laga:--form explicit"; do
  a=${opt%%:*} b=${opt##*:}
  out=$(run -np 1 "$laga" train $A $a : -np 1 "$laga" train $A $b)
  rc=$?
  name=${a%% *}
  if [ $rc -eq 0 ] || ! grep -q "disagree on option $name" <<<"$out"; then
    echo "FAILED: ranks with $a and $b: rc $rc, output: $out"
    fail=1
  fi
done
out=$(run -np 2 "$laga" train $A --seed 1) || { echo "FAILED: equal options: $out"; fail=1; }
exit $fail

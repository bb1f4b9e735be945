#!/usr/bin/env bash
# The same P on the in-process and MPI backends must give bit-identical
# outputs and gradients: run `laga forward --backward` both ways for each form
# and compare the safetensors files byte for byte (their metadata is equal too).
set -euo pipefail
laga=$1 mpiexec=$2 tmp=$3
mkdir -p "$tmp"
for form in explicit absorbed laga; do
  # P 3 again with packed documents (issue 15): one crosses every rank
  # boundary, one is a single token.
  for P in 2 3 3packed; do
    docs=()
    [ "$P" = 3packed ] && P=3 docs=(--doc-lens 1,20,2/23)
    common=(forward --preset tiny --batch 2 --seq 23 --backward --form "$form" --sp "$P" --attention flash "${docs[@]}")
    "$laga" "${common[@]}" --comm local --output "$tmp/local_$form$P.st" >/dev/null 2>&1
    timeout 120 "$mpiexec" --allow-run-as-root --oversubscribe -np "$P" \
      "$laga" "${common[@]}" --comm mpi --output "$tmp/mpi_$form$P.st" >/dev/null 2>&1
    if ! cmp -s "$tmp/local_$form$P.st" "$tmp/mpi_$form$P.st"; then
      echo "FAIL: $form P=$P ${docs[*]}: local and MPI outputs differ"; exit 1
    fi
    echo "ok: $form P=$P ${docs[*]} local == mpi (bit-identical out, dx, grads)"
  done
done

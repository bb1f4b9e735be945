#!/usr/bin/env bash
# The invariant mode through the tool (docs/invariance.md): for every form
# `laga forms` lists as offering it, `laga forward --backward --invariant`
# writes the same bytes (out, dx, every gradient, and metadata) at --sp 1
# through 8, in-process and under mpirun, uneven (S 23 and H 5 split by no P
# > 1 evenly; ranks without heads at P 6..8), packed, fp32 and bf16. And a
# form that does not offer it is refused naming it.
set -euo pipefail
laga=$1 mpiexec=$2 tmp=$3
mkdir -p "$tmp"
mapfile -t forms < <("$laga" forms --json - | /usr/bin/python3 -c '
import json, sys
for f in json.load(sys.stdin)["forms"]:
    if f["traits"]["invariant"]:
        print(f["name"])')
[ "${#forms[@]}" -ge 1 ] || { echo "FAIL: no form offers --invariant"; exit 1; }
for form in "${forms[@]}"; do
  for run in fp32 bf16packed; do
    extra=()
    [ "$run" = bf16packed ] && extra=(--dtype bf16 --doc-lens 1,14,8)
    common=(forward --preset tiny --batch 2 --seq 23 --backward --form "$form" --invariant
            --attention flash "${extra[@]}")
    "$laga" "${common[@]}" --sp 1 --output "$tmp/$form$run-1.st" >/dev/null
    for P in 2 3 4 5 6 7 8; do
      "$laga" "${common[@]}" --sp "$P" --output "$tmp/$form$run-$P.st" >/dev/null
      cmp -s "$tmp/$form$run-1.st" "$tmp/$form$run-$P.st" ||
        { echo "FAIL: $form $run: --sp $P's output differs from --sp 1's"; exit 1; }
    done
    for P in 2 3; do
      timeout 120 "$mpiexec" --allow-run-as-root --oversubscribe -np "$P" \
        "$laga" "${common[@]}" --sp "$P" --comm mpi --output "$tmp/$form$run-mpi$P.st" >/dev/null
      cmp -s "$tmp/$form$run-1.st" "$tmp/$form$run-mpi$P.st" ||
        { echo "FAIL: $form $run: mpirun -np $P's output differs from --sp 1's"; exit 1; }
    done
  done
done
# Refused for a form without the mode, naming it.
if msg=$("$laga" forward --preset tiny --seq 16 --sp 2 --form ring_kv --invariant 2>&1); then
  echo "FAIL: ring_kv ran with --invariant"; exit 1
fi
grep -q "form ring_kv does not offer the invariant mode" <<<"$msg" ||
  { echo "FAIL: the refusal does not name the form: $msg"; exit 1; }
echo "OK: ${forms[*]} byte-identical at --sp 1..8 (local) and 2, 3 (mpirun), fp32 and bf16 packed"

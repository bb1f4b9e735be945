#!/usr/bin/env bash
# The same P on the in-process and MPI backends must give bit-identical
# outputs and gradients: run `laga forward --backward` for each form both ways
# and compare the safetensors files byte for byte (their metadata is equal
# too), for every form `laga forms` lists. laga --q-latent needs q_lora_rank > 0, which preset tiny lacks: it
# runs on tiny_q_latent.json (tiny's dims with q_lora_rank 20 and 5 heads, so
# P 3 splits them unevenly). NAME-overlap runs a form with an overlapped path
# with --overlap on, whose tensors must also equal the plain form's bit for
# bit (docs/forms.md, "Overlap").
# laga2d runs with its default head groups (gcd(4, P): laga's split at P 2,
# one head group of 3 context groups at P 3) and as laga2d-g1 with
# --head-groups 1 (mirrored query chunks at every P), with the query latent
# sent to those chunks (laga2d-g1-q-latent) and overlapped
# (laga2d-g1-overlap, equal to laga2d-g1 bit for bit).
# The cases run LAGA_LVM_JOBS (default 4) at a time, then are compared in
# order: an mpirun launch here mostly waits (0.75 s wall for 0.35 CPU s,
# OpenMPI's start-up and wire-up; 95 launches took 56 s one after another in
# a 2-core CI run), so four at once keep the test's two cores busy. Each
# case writes its own files; every case still runs both ways and is compared
# bit for bit.
set -euo pipefail
laga=$1 mpiexec=$2 tmp=$3
here=$(cd "$(dirname "$0")" && pwd)
jobs=${LAGA_LVM_JOBS:-4}
rm -rf "$tmp"
mkdir -p "$tmp"
# Every registered form (`laga forms`), each with an overlapped path also as
# NAME-overlap, then the variants above.
forms_with() {
  "$laga" forms --json - | /usr/bin/python3 -c '
import json, sys
for f in json.load(sys.stdin)["forms"]:
    if sys.argv[1] == "all" or f["traits"][sys.argv[1]]:
        print(f["name"] + sys.argv[2])' "$@"
}
mapfile -t names < <(forms_with all "" && forms_with overlap -overlap)
[ "${#names[@]}" -ge 5 ] || { echo "FAIL: laga forms listed ${#names[@]} forms"; exit 1; }
names+=(laga-q-latent laga2d-g1 laga2d-g1-q-latent laga2d-g1-overlap)
# P 3 again with packed documents (issue 15): one crosses every rank
# boundary, one is a single token; and P 4 on zigzag shards with them
# (docs/forms.md, "The zigzag layout").
# And P 3 in bf16 mixed precision, its activations on the wire as bf16
# (mla/wire.hpp), whose reductions must agree bit for bit too.
runs=(2 3 3packed 4zigzag 3bf16)

# run_case NAME RUN: laga forward --backward locally and under mpirun into
# $tmp/{local,mpi}_NAMERUN.st; its log in $tmp/NAMERUN.log, and
# $tmp/NAMERUN.ok only if both ran.
run_case() {
  local name=$1 run=$2 form=$1 P docs=() layout=() model=(--preset tiny) queries=()
  [ "${name%-overlap}" != "$name" ] && form=${name%-overlap} queries=(--overlap on)
  [ "$name" = laga-q-latent ] && form=laga model=(--config "$here/tiny_q_latent.json") queries=(--q-latent)
  [ "$name" = laga2d-g1 ] && form=laga2d queries=(--head-groups 1)
  [ "$name" = laga2d-g1-q-latent ] && form=laga2d model=(--config "$here/tiny_q_latent.json") \
    queries=(--head-groups 1 --q-latent)
  [ "$name" = laga2d-g1-overlap ] && form=laga2d queries=(--head-groups 1 --overlap on)
  P=${run%packed}
  P=${P%zigzag}
  P=${P%bf16}
  [ "$run" = 3packed ] || [ "$run" = 4zigzag ] && docs=(--doc-lens 1,20,2/23)
  [ "$run" = 4zigzag ] && layout=(--seq-layout zigzag)
  [ "$run" = 3bf16 ] && layout=(--dtype bf16)
  local common=(forward "${model[@]}" --batch 2 --seq 23 --backward --form "$form" "${queries[@]}"
                --sp "$P" --attention flash "${docs[@]}" "${layout[@]}")
  echo "$name P=$P ${docs[*]} ${layout[*]}" >"$tmp/$name$run.what"
  "$laga" "${common[@]}" --comm local --output "$tmp/local_$name$run.st" >"$tmp/$name$run.log" 2>&1 &&
    timeout 120 "$mpiexec" --allow-run-as-root --oversubscribe -np "$P" \
      "$laga" "${common[@]}" --comm mpi --output "$tmp/mpi_$name$run.st" >>"$tmp/$name$run.log" 2>&1 &&
    touch "$tmp/$name$run.ok"
}
for name in "${names[@]}"; do
  for run in "${runs[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
    run_case "$name" "$run" &
  done
done
wait

# NAME-overlap against NAME, every run: the files' metadata name the variant
# (laga+overlap); the tensors must equal those of the same variant without
# overlap. One interpreter for all the pairs.
pairs=()
for name in "${names[@]}"; do
  for run in "${runs[@]}"; do
    what=$(cat "$tmp/$name$run.what")
    if [ ! -f "$tmp/$name$run.ok" ]; then
      cat "$tmp/$name$run.log"
      echo "FAIL: $what: laga forward failed (its output is above)"; exit 1
    fi
    if ! cmp -s "$tmp/local_$name$run.st" "$tmp/mpi_$name$run.st"; then
      echo "FAIL: $what: local and MPI outputs differ"; exit 1
    fi
    echo "ok: $what local == mpi (bit-identical out, dx, grads)"
    [ "${name%-overlap}" != "$name" ] &&
      pairs+=("$tmp/local_$name$run.st" "$tmp/local_${name%-overlap}$run.st" "$what")
  done
done
/usr/bin/python3 - "$here/../../python" "${pairs[@]}" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import safetensors_io
args = sys.argv[2:]
for i in range(0, len(args), 3):
    a, _ = safetensors_io.load_file(args[i])
    b, _ = safetensors_io.load_file(args[i + 1])
    if not (set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)):
        print(f"FAIL: {args[i + 2]}: --overlap on and off give different tensors")
        sys.exit(1)
    print(f"ok: {args[i + 2]}: --overlap on == off (every tensor)")
print(f"local_vs_mpi: {len(args) // 3} overlapped runs equal their plain forms")
PY

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
set -euo pipefail
laga=$1 mpiexec=$2 tmp=$3
here=$(cd "$(dirname "$0")" && pwd)
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
for name in "${names[@]}" laga-q-latent laga2d-g1 laga2d-g1-q-latent laga2d-g1-overlap; do
  form=$name model=(--preset tiny) queries=()
  [ "${name%-overlap}" != "$name" ] && form=${name%-overlap} queries=(--overlap on)
  [ "$name" = laga-q-latent ] && form=laga model=(--config "$here/tiny_q_latent.json") queries=(--q-latent)
  [ "$name" = laga2d-g1 ] && form=laga2d queries=(--head-groups 1)
  [ "$name" = laga2d-g1-q-latent ] && form=laga2d model=(--config "$here/tiny_q_latent.json") \
    queries=(--head-groups 1 --q-latent)
  [ "$name" = laga2d-g1-overlap ] && form=laga2d queries=(--head-groups 1 --overlap on)
  # P 3 again with packed documents (issue 15): one crosses every rank
  # boundary, one is a single token; and P 4 on zigzag shards with them
  # (docs/forms.md, "The zigzag layout").
  # And P 3 in bf16 mixed precision, its activations on the wire as bf16
  # (mla/wire.hpp), whose reductions must agree bit for bit too.
  for run in 2 3 3packed 4zigzag 3bf16; do
    P=${run%packed} docs=() layout=()
    P=${P%zigzag}
    P=${P%bf16}
    [ "$run" = 3packed ] || [ "$run" = 4zigzag ] && docs=(--doc-lens 1,20,2/23)
    [ "$run" = 4zigzag ] && layout=(--seq-layout zigzag)
    [ "$run" = 3bf16 ] && layout=(--dtype bf16)
    common=(forward "${model[@]}" --batch 2 --seq 23 --backward --form "$form" "${queries[@]}"
            --sp "$P" --attention flash "${docs[@]}" "${layout[@]}")
    "$laga" "${common[@]}" --comm local --output "$tmp/local_$name$run.st" >/dev/null 2>&1
    timeout 120 "$mpiexec" --allow-run-as-root --oversubscribe -np "$P" \
      "$laga" "${common[@]}" --comm mpi --output "$tmp/mpi_$name$run.st" >/dev/null 2>&1
    if ! cmp -s "$tmp/local_$name$run.st" "$tmp/mpi_$name$run.st"; then
      echo "FAIL: $name P=$P ${docs[*]} ${layout[*]}: local and MPI outputs differ"; exit 1
    fi
    # The files' metadata name the variant (laga+overlap); the tensors must
    # equal those of the same variant without overlap.
    if [ "${name%-overlap}" != "$name" ] && ! /usr/bin/python3 - "$here/../../python" \
        "$tmp/local_$name$run.st" "$tmp/local_${name%-overlap}$run.st" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import numpy as np
import safetensors_io
a, _ = safetensors_io.load_file(sys.argv[2])
b, _ = safetensors_io.load_file(sys.argv[3])
sys.exit(0 if set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a) else 1)
PY
    then
      echo "FAIL: ${name%-overlap} P=$P ${docs[*]}: --overlap on and off give different tensors"; exit 1
    fi
    echo "ok: $name P=$P ${docs[*]} ${layout[*]} local == mpi (bit-identical out, dx, grads)"
  done
done

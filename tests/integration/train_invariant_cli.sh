#!/usr/bin/env bash
# laga train --invariant through the tool (docs/invariance.md, "In
# training"): 20 steps whose --log losses and gradient norms and whose final
# checkpoint (weights, AdamW moments) are the same bytes at --sp 1, 2, 4
# in-process, dense (two rows, uneven shards; fp32, and bf16 on packed
# documents; and at 2 ranks under mpirun, and at --sp 3 with
# --perturb-reductions) and MoE with --expert-parallel, for
# every form `laga forms` lists as offering the mode. And what the mode does
# not cover is refused by name.
set -euo pipefail
laga=$1 mpiexec=$2 tmp=$3
rm -rf "$tmp" && mkdir -p "$tmp"
mapfile -t forms < <("$laga" forms --json - | /usr/bin/python3 -c '
import json, sys
for f in json.load(sys.stdin)["forms"]:
    if f["traits"]["invariant"]:
        print(f["name"])')
[ "${#forms[@]}" -ge 1 ] || { echo "FAIL: no form offers --invariant"; exit 1; }
moe=$(dirname "$0")/../../docs/assets/moe_tiny.json
# Packed documents: a token file of documents each ending with id 0.
/usr/bin/python3 -c '
import array, sys
ids, d = [], 0
while len(ids) < 3000:
    n = 1 + (7 * d) % 13
    ids += [1 + (d + 3 * i) % 60 for i in range(n - 1)] + [0]
    d += 1
array.array("H", ids).tofile(open(sys.argv[1], "wb"))' "$tmp/docs.bin"
# The log's lines without their timings (tokens_per_s differs run to run).
numbers() {
  /usr/bin/python3 -c '
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    print(d["step"], repr(d["loss"]), repr(d["grad_norm"]), d.get("expert_load"))' "$1"
}
for form in "${forms[@]}"; do
  for model in dense packed moe; do
    if [ "$model" = dense ]; then
      m=(--layers 2 --d-model 32 --heads 4 --vocab 64 --seq 30 --batch 2 --clip 1)
    elif [ "$model" = packed ]; then
      m=(--layers 2 --d-model 32 --heads 4 --vocab 64 --seq 30 --batch 2 --data "$tmp/docs.bin"
         --pack-eos 0 --dtype bf16)
    else
      m=(--config "$moe" --seq 31 --batch 2 --expert-parallel --log-expert-load)
    fi
    common=(train "${m[@]}" --steps 20 --form "$form" --attention flash --invariant --quiet)
    run() {  # NAME, then the launcher and the rank options
      local name=$1; shift
      "$@" --log "$tmp/$name.jsonl" --checkpoint "$tmp/$name" 2>"$tmp/$name.err" ||
        { echo "FAIL: $name:"; cat "$tmp/$name.err"; exit 1; }
      numbers "$tmp/$name.jsonl" >"$tmp/$name.txt"
    }
    base=$form-$model
    run "$base-1" "$laga" "${common[@]}" --sp 1
    [ "$(wc -l <"$tmp/$base-1.txt")" = 20 ] || { echo "FAIL: $base: not 20 steps logged"; exit 1; }
    ranks=(2 4)
    # mpirun's start is the slow part: once a form. And at --sp 3 with the
    # all-reduces' order permuted: the mode's sums do not depend on it.
    [ "$model" = dense ] && ranks+=(mpi2 3perturbed)
    for P in "${ranks[@]}"; do
      if [ "$P" = mpi2 ]; then
        run "$base-$P" timeout 120 "$mpiexec" --allow-run-as-root --oversubscribe -np 2 \
          "$laga" "${common[@]}" --sp 2 --comm mpi
      elif [ "$P" = 3perturbed ]; then
        run "$base-$P" "$laga" "${common[@]}" --sp 3 --perturb-reductions 5
      else
        run "$base-$P" "$laga" "${common[@]}" --sp "$P"
      fi
      cmp -s "$tmp/$base-1.txt" "$tmp/$base-$P.txt" ||
        { echo "FAIL: $base: the losses at $P differ from --sp 1's"; diff "$tmp/$base-1.txt" "$tmp/$base-$P.txt" | head; exit 1; }
      cmp -s "$tmp/$base-1/step-00000020.safetensors" "$tmp/$base-$P/step-00000020.safetensors" ||
        { echo "FAIL: $base: the final checkpoint at $P differs from --sp 1's"; exit 1; }
    done
  done
done
# Refused by name: a form without the mode, and an MoE model without expert
# parallelism over every rank.
refused() {  # EXPECTED-TEXT, then the options
  local want=$1; shift
  if msg=$("$laga" train --steps 1 --attention flash --invariant --quiet "$@" 2>&1); then
    echo "FAIL: ran: $*"; exit 1
  fi
  grep -qF -- "$want" <<<"$msg" || { echo "FAIL: '$*' not refused naming '$want': $msg"; exit 1; }
}
refused "form ring_kv does not offer the invariant mode" --form ring_kv --sp 2
refused "needs --expert-parallel over every rank" --config "$moe" --batch 1 --sp 2
refused "drop --seq-layout zigzag" --seq-layout zigzag --sp 2
echo "OK: ${forms[*]}, dense, packed bf16 and MoE EP: 20 steps' losses and final checkpoints byte-identical at --sp 1, 2, 4 (dense: and mpirun -np 2, and --sp 3 perturbed)"

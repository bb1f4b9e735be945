#!/bin/sh
# The LAGA paper's §4.5 convergence run (4-layer MLA LM, d 512, 16 heads,
# seq 512, Adam lr 1e-3, 60 steps, random-data memorisation) under the three
# forms and laga2d, from one seed, then the plot. laga2d runs with
# HEAD_GROUPS head groups (default 1: every rank attends all 16 heads for its
# mirrored query chunks; its default rule, gcd(16, SP), would be laga's split
# at SP 2). Usage:
#   python/train_paper.sh [LAGA_BINARY] [OUT_DIR] [extra laga train args...]
# e.g. python/train_paper.sh build/laga runs/paper --sp 4
set -eu
LAGA=${1:-build/laga}
OUT=${2:-runs/paper}
[ $# -ge 2 ] && shift 2 || shift $#
SP=${SP:-2}
ATTENTION=${ATTENTION:-flash}
mkdir -p "$OUT"
for form in explicit absorbed laga laga2d; do
  echo "== $form" >&2
  groups=""
  [ "$form" = laga2d ] && groups="--head-groups ${HEAD_GROUPS:-1}"
  # shellcheck disable=SC2086  # $groups: empty or two words
  "$LAGA" train --form "$form" $groups --sp "$SP" --attention "$ATTENTION" --layers 4 \
    --d-model 512 --heads 16 --seq 512 --steps 60 --lr 1e-3 --seed 0 --data random \
    --log "$OUT/$form.jsonl" "$@"
done
DIR=$(dirname "$0")
/usr/bin/python3 "$DIR/plot_loss.py" --out "$OUT/loss.png" \
  "explicit=$OUT/explicit.jsonl" "absorbed=$OUT/absorbed.jsonl" "laga=$OUT/laga.jsonl" \
  "laga2d=$OUT/laga2d.jsonl"

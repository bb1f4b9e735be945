#!/bin/sh
# The LAGA paper's §4.5 convergence run (4-layer MLA LM, d 512, 16 heads,
# seq 512, Adam lr 1e-3, 60 steps, random-data memorisation) under the three
# forms, from one seed, then the plot. Usage:
#   python/train_paper.sh [LAGA_BINARY] [OUT_DIR] [extra laga train args...]
# e.g. python/train_paper.sh build/laga runs/paper --sp 4
set -eu
LAGA=${1:-build/laga}
OUT=${2:-runs/paper}
[ $# -ge 2 ] && shift 2 || shift $#
SP=${SP:-2}
ATTENTION=${ATTENTION:-flash}
mkdir -p "$OUT"
for form in explicit absorbed laga; do
  echo "== $form" >&2
  "$LAGA" train --form "$form" --sp "$SP" --attention "$ATTENTION" --layers 4 --d-model 512 \
    --heads 16 --seq 512 --steps 60 --lr 1e-3 --seed 0 --data random \
    --log "$OUT/$form.jsonl" "$@"
done
DIR=$(dirname "$0")
/usr/bin/python3 "$DIR/plot_loss.py" --out "$OUT/loss.png" \
  "explicit=$OUT/explicit.jsonl" "absorbed=$OUT/absorbed.jsonl" "laga=$OUT/laga.jsonl"

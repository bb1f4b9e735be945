#!/bin/sh
# The real-text run (python/train_text.sh) with DeepSeek-V3's MoE in the
# second layer (docs/assets/moe_text.json: 8 routed experts of width 88, 2
# per token, 1 shared, bias balancing at 0.001): laga at SP 1, at SP 2 with
# every expert on every rank, and at SP 2 and 4 with the experts folded onto
# the ranks (--expert-parallel); then the curves beside the unigram baseline.
# Usage:
#   python/train_text_moe.sh [LAGA_BINARY] [OUT_DIR] [extra laga train args...]
set -eu
LAGA=${1:-build/laga}
OUT=${2:-runs/text_moe}
[ $# -ge 2 ] && shift 2 || shift $#
STEPS=${STEPS:-300}
VAL_EVERY=${VAL_EVERY:-25}
EXTRA="$*"  # extra laga train args (split on spaces)
DIR=$(dirname "$0")
mkdir -p "$OUT"
/usr/bin/python3 "$DIR/../scripts/text_data.py" "$OUT/data"
# shellcheck disable=SC2086  # $EXTRA: split on purpose
run() {  # run NAME SP [laga train args...]
  name=$1 sp=$2
  shift 2
  echo "== $name" >&2
  "$LAGA" train --form laga --sp "$sp" --attention flash --config "$DIR/../docs/assets/moe_text.json" \
    --seq 128 --batch 8 --steps "$STEPS" --lr 3e-3 --warmup 20 --schedule cosine \
    --min-lr 2e-4 --clip 1 --seed 0 --data "$OUT/data/train.u16" \
    --val-data "$OUT/data/val.u16" --val-every "$VAL_EVERY" --val-batches 8 --quiet \
    --log "$OUT/$name.jsonl" "$@" $EXTRA
}
run moe-sp1 1
run moe-sp2 2
run moe-ep2 2 --expert-parallel
run moe-ep4 4 --expert-parallel
/usr/bin/python3 "$DIR/plot_text.py" --out "$OUT/text_moe.png" --data "$OUT/data/text_data.json" \
  "MoE SP 1=$OUT/moe-sp1.jsonl" "MoE SP 2=$OUT/moe-sp2.jsonl" \
  "MoE SP 2, EP 2=$OUT/moe-ep2.jsonl" "MoE SP 4, EP 4=$OUT/moe-ep4.jsonl"

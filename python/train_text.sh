#!/bin/sh
# Training on real text (issue 28 item 5): Debian's fortunes (about 2.6 MB of
# English) as bytes (vocab 256), the last 5% held out; explicit at SP 1 and
# every form at SP 2 from one seed, validated every VAL_EVERY steps on 8
# fixed held-out batches; then the curves in bits per byte beside the
# unigram baseline. Usage:
#   python/train_text.sh [LAGA_BINARY] [OUT_DIR] [extra laga train args...]
set -eu
LAGA=${1:-build/laga}
OUT=${2:-runs/text}
[ $# -ge 2 ] && shift 2 || shift $#
STEPS=${STEPS:-300}
VAL_EVERY=${VAL_EVERY:-25}
EXTRA="$*"  # extra laga train args (split on spaces)
DIR=$(dirname "$0")
mkdir -p "$OUT"
/usr/bin/python3 "$DIR/../scripts/text_data.py" "$OUT/data"
# shellcheck disable=SC2086  # $EXTRA: split on purpose
run() {  # run NAME SP FORM
  echo "== $1" >&2
  "$LAGA" train --form "$3" --sp "$2" --attention flash --vocab 256 --layers 2 --d-model 128 \
    --heads 4 --seq 128 --batch 8 --steps "$STEPS" --lr 3e-3 --warmup 20 --schedule cosine \
    --min-lr 2e-4 --clip 1 --seed 0 --data "$OUT/data/train.u16" \
    --val-data "$OUT/data/val.u16" --val-every "$VAL_EVERY" --val-batches 8 --quiet \
    --log "$OUT/$1.jsonl" $EXTRA
}
run explicit-sp1 1 explicit
for form in explicit absorbed laga laga2d; do run "$form" 2 "$form"; done
/usr/bin/python3 "$DIR/plot_text.py" --out "$OUT/text.png" --data "$OUT/data/text_data.json" \
  "explicit SP 1=$OUT/explicit-sp1.jsonl" "explicit=$OUT/explicit.jsonl" \
  "absorbed=$OUT/absorbed.jsonl" "laga=$OUT/laga.jsonl" "laga2d=$OUT/laga2d.jsonl"

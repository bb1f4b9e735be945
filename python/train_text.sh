#!/bin/sh
# Training on real text (issue 28 item 5): Debian's fortunes (about 2.6 MB of
# English) as bytes (vocab 256), the last 5% held out, validated every
# VAL_EVERY steps on 8 fixed held-out batches; then the curves in bits per
# byte beside the unigram baseline (docs/convergence.md, "Real text").
#   dense (default): explicit at SP 1 and every form at SP 2 from one seed;
#   MODEL=moe: docs/assets/moe_text.json (DeepSeek-V3's MoE in the second
#     layer), laga at SP 1, SP 2, and SP 2 and 4 with --expert-parallel;
#   MODEL=bf16: the dense model under --dtype bf16 (explicit at SP 1, laga at
#     SP 2) beside explicit fp32 at SP 1 (docs/convergence.md, "bf16").
# Usage:
#   [MODEL=moe] python/train_text.sh [LAGA_BINARY] [OUT_DIR] [extra laga train args...]
set -eu
LAGA=${1:-build/laga}
MODEL=${MODEL:-dense}
OUT=${2:-runs/text}
[ $# -ge 2 ] && shift 2 || shift $#
STEPS=${STEPS:-300}
VAL_EVERY=${VAL_EVERY:-25}
EXTRA="$*"  # extra laga train args (split on spaces)
DIR=$(dirname "$0")
mkdir -p "$OUT"
/usr/bin/python3 "$DIR/../scripts/text_data.py" "$OUT/data"
# shellcheck disable=SC2086  # $EXTRA: split on purpose
run() {  # run NAME SP FORM [laga train args...]: the model's own args first
  name=$1 sp=$2 form=$3
  shift 3
  echo "== $name" >&2
  "$LAGA" train --form "$form" --sp "$sp" --attention flash "$@" \
    --seq 128 --batch 8 --steps "$STEPS" --lr 3e-3 --warmup 20 --schedule cosine \
    --min-lr 2e-4 --clip 1 --seed 0 --data "$OUT/data/train.u16" \
    --val-data "$OUT/data/val.u16" --val-every "$VAL_EVERY" --val-batches 8 --quiet \
    --log "$OUT/$name.jsonl" $EXTRA
}
if [ "$MODEL" = moe ]; then
  MOE="--config $DIR/../docs/assets/moe_text.json"
  # shellcheck disable=SC2086
  run moe-sp1 1 laga $MOE
  run moe-sp2 2 laga $MOE
  run moe-ep2 2 laga $MOE --expert-parallel
  run moe-ep4 4 laga $MOE --expert-parallel
  /usr/bin/python3 "$DIR/plot_text.py" --out "$OUT/text_moe.png" --data "$OUT/data/text_data.json" \
    "MoE SP 1=$OUT/moe-sp1.jsonl" "MoE SP 2=$OUT/moe-sp2.jsonl" \
    "MoE SP 2, EP 2=$OUT/moe-ep2.jsonl" "MoE SP 4, EP 4=$OUT/moe-ep4.jsonl"
  exit 0
fi
DENSE="--vocab 256 --layers 2 --d-model 128 --heads 4"
if [ "$MODEL" = bf16 ]; then
  # shellcheck disable=SC2086
  run explicit-sp1 1 explicit $DENSE
  run bf16-explicit-sp1 1 explicit $DENSE --dtype bf16
  run bf16-laga-sp2 2 laga $DENSE --dtype bf16
  /usr/bin/python3 "$DIR/plot_text.py" --out "$OUT/text_bf16.png" \
    --data "$OUT/data/text_data.json" "explicit fp32 SP 1=$OUT/explicit-sp1.jsonl" \
    "explicit bf16 SP 1=$OUT/bf16-explicit-sp1.jsonl" "laga bf16 SP 2=$OUT/bf16-laga-sp2.jsonl"
  exit 0
fi
# shellcheck disable=SC2086
run explicit-sp1 1 explicit $DENSE
for form in explicit absorbed laga laga2d; do run "$form" 2 "$form" $DENSE; done
/usr/bin/python3 "$DIR/plot_text.py" --out "$OUT/text.png" --data "$OUT/data/text_data.json" \
  "explicit SP 1=$OUT/explicit-sp1.jsonl" "explicit=$OUT/explicit.jsonl" \
  "absorbed=$OUT/absorbed.jsonl" "laga=$OUT/laga.jsonl" "laga2d=$OUT/laga2d.jsonl"

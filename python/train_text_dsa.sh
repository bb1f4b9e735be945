#!/bin/sh
# DeepSeek Sparse Attention on real text (issue 55; docs/convergence.md, "The
# same text with DeepSeek Sparse Attention"): the fortunes bytes
# (scripts/text_data.py), one small model trained twice from one seed on the
# same batches and schedule: dense MLA, and DSA (the lightning indexer,
# --index-warmup dense steps, then each query attends its top-k keys). The
# two runs go side by side (one thread each); then the summary table
# (python/dsa_text_summary.py).
# Usage:
#   python/train_text_dsa.sh [LAGA_BINARY] [OUT_DIR]
set -eu
LAGA=${1:-build/laga}
OUT=${2:-runs/text-dsa}
STEPS=${STEPS:-200}
DIR=$(dirname "$0")
mkdir -p "$OUT"
/usr/bin/python3 "$DIR/../scripts/text_data.py" "$OUT/data" > /dev/null
COMMON="--vocab 256 --layers 2 --d-model 128 --heads 4 --q-lora-rank 64 --seq 256 --batch 2
  --steps $STEPS --lr 3e-3 --warmup 20 --schedule cosine --min-lr 2e-4 --clip 1 --seed 0
  --data $OUT/data/train.u16 --val-data $OUT/data/val.u16 --val-every 50 --val-batches 4 --quiet"
# shellcheck disable=SC2086  # $COMMON: split on purpose
OMP_NUM_THREADS=1 "$LAGA" train $COMMON --log "$OUT/dense.jsonl" &
# shellcheck disable=SC2086
OMP_NUM_THREADS=1 "$LAGA" train $COMMON --index-heads 4 --index-head-dim 32 --index-topk 32 \
  --index-warmup 40 --log "$OUT/dsa.jsonl" &
wait
/usr/bin/python3 "$DIR/dsa_text_summary.py" "$OUT/dense.jsonl" "$OUT/dsa.jsonl"

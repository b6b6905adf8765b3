#!/usr/bin/env bash
# Trains the demo DSpark block draft (demo/dspark) for the demo target (demo/target) with
# `jaxspec train-draft --method dspark` on the training split of the Python stdlib, starting from
# the demo DFlash draft's backbone (demo/dflash: same layers, taps and mask token). Every slot of a
# block of 8 drafts (sample_from_anchor), a vanilla Markov head of rank 64 and a confidence head.
#
#   scripts/train_demo_dspark.sh                   # as recorded in benchmarks/RESULTS.md
#   scripts/train_demo_dspark.sh --minutes 60      # any other budget / extra train-draft flags
#
# Checkpoints go to runs/demo_dspark (gitignored); rerunning resumes from there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
budget=("--minutes" "150")
for a in "$@"; do
  case "$a" in --steps|--minutes) budget=() ;; esac
done
exec "$PY" -m jaxspec train-draft --method dspark --target demo/target --corpus stdlib --out demo/dspark \
  --run-dir runs/demo_dspark --init-from demo/dflash --block-size 8 --draft-layers 3 --mask-token-id 116 \
  --markov-rank 64 --markov-head vanilla --num-anchors 16 --batch 8 --seq-len 256 --lr 2e-3 --warmup 30 \
  --eval-every 100 --eval-prompts 4 --self-distill 512 --dtype bfloat16 "${budget[@]}" "$@"

#!/usr/bin/env bash
# Trains the demo DFlash block draft (demo/dflash) for the demo target (demo/target) with
# `jaxspec train-draft --method dflash` on the training split of the Python stdlib (held-out
# files, chosen by a hash of their path, are never trained on; they give the reports' prompts).
#
#   scripts/train_demo_dflash.sh                 # as recorded in benchmarks/RESULTS.md
#   scripts/train_demo_dflash.sh --steps 20      # any other budget / extra train-draft flags
#
# Checkpoints go to runs/demo_dflash (gitignored); rerunning resumes from there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
budget=("--steps" "1200")
for a in "$@"; do
  case "$a" in --steps|--minutes) budget=() ;; esac
done
exec "$PY" -m jaxspec train-draft --method dflash --target demo/target --corpus stdlib --out demo/dflash \
  --run-dir runs/demo_dflash --block-size 8 --draft-layers 3 --num-anchors 16 --batch 8 --seq-len 256 \
  --lr 2e-3 --warmup 30 --eval-every 100 --eval-prompts 4 --self-distill 512 --dtype bfloat16 "${budget[@]}" "$@"

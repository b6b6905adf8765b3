#!/usr/bin/env bash
# Trains the demo EAGLE-3 head (demo/eagle3) for the demo target (demo/target) with
# `jaxspec train-draft` on the training split of the Python stdlib (held-out files, chosen by
# a hash of their path, are never trained on; they give the periodic reports' prompts).
#
#   scripts/train_demo_draft.sh                  # as recorded in benchmarks/RESULTS.md (45 min budget)
#   scripts/train_demo_draft.sh --steps 20       # any other budget / extra train-draft flags
#
# Checkpoints go to runs/demo_eagle3 (gitignored); rerunning resumes from there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
budget=("--minutes" "45")
for a in "$@"; do
  case "$a" in --steps|--minutes) budget=() ;; esac
done
exec "$PY" -m jaxspec train-draft --target demo/target --corpus stdlib --out demo/eagle3 \
  --run-dir runs/demo_eagle3 --draft-vocab-size 2048 --ttt-steps 5 --batch 8 --seq-len 256 \
  --lr 2e-3 --warmup 30 --eval-every 50 --eval-prompts 4 --self-distill 512 --dtype bfloat16 "${budget[@]}" "$@"

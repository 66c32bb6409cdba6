#!/usr/bin/env bash
# Trains a tiny preset on the standard-library corpus in three stages (ess_jax.train):
#   dense  -- language model, dense attention, 512-token examples (the indexers do not learn);
#   warmup -- the indexers alone, KL to the dense attention, 4096-token examples;
#   sparse -- language model with top-k attention + the indexers' KL on their selection, 4096 tokens.
# Usage: tools/train_tiny.sh PRESET CORPUS_DIR OUT_DIR [DENSE_STEPS]   (e.g. tiny-v32 data/corpus runs/v32)
# Every stage resumes from its own state in OUT_DIR/<stage>, so rerunning the script continues a killed run;
# the final checkpoint is OUT_DIR/sparse.
set -euo pipefail
preset=$1 corpus=$2 out=$3 dense_steps=${4:-600}
py=${PYTHON:-.venv/bin/python}
"$py" -m ess_jax.train --model "$preset" --data "$corpus" --out "$out/dense" --stage dense \
  --steps "$dense_steps" --context 512 --batch 8 --lr 3e-3 --warmup-steps 30 --eval-every 100 --no-progress
"$py" -m ess_jax.train --model "$out/dense" --data "$corpus" --out "$out/warmup" --stage warmup \
  --steps 20 --context 4096 --batch 1 --lr 3e-3 --warmup-steps 2 --eval-every 10 --eval-batches 2 \
  --checkpoint-every 5 --no-progress
"$py" -m ess_jax.train --model "$out/warmup" --data "$corpus" --out "$out/sparse" --stage sparse \
  --steps 40 --context 4096 --batch 1 --lr 1e-3 --warmup-steps 4 --eval-every 20 --eval-batches 2 \
  --checkpoint-every 5 --no-progress

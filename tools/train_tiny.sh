#!/usr/bin/env bash
# Trains a tiny preset on the standard-library corpus in three stages (ess_jax.train), then its MTP module:
#   dense  -- language model, dense attention, 512-token examples (the indexers do not learn);
#   warmup -- the indexers alone, KL to the dense attention, 4096-token examples;
#   sparse -- language model with top-k attention + the indexers' KL on their selection, 4096 tokens;
#   mtp-dense, mtp-warmup, mtp-sparse -- the MTP module alone (--train mtp, the main weights frozen), the same
#     three stages at 512 tokens; the warmup and sparse ones only for an MTP block with an indexer (V3.2's; V4's
#     is a sliding-window layer, as in both releases).
# Usage: tools/train_tiny.sh PRESET CORPUS_DIR OUT_DIR [DENSE_STEPS]   (e.g. tiny-v32 data/corpus runs/v32)
#        tools/train_tiny.sh --mtp MODEL CORPUS_DIR OUT_DIR            (the MTP stages alone, on a trained model,
#                                                                        e.g. tiny-v32-code data/corpus runs/v32)
# Every stage resumes from its own state in OUT_DIR/<stage>, so rerunning the script continues a killed run;
# the final checkpoint is OUT_DIR/mtp-sparse (OUT_DIR/mtp-dense without an MTP indexer).
set -euo pipefail
py=${PYTHON:-.venv/bin/python}

mtp_stages() {  # MODEL CORPUS OUT
  local model=$1 corpus=$2 out=$3 indexed
  indexed=$("$py" -c 'import sys; from ess_jax.config import resolve_model; from ess_jax.families import source_config
c = source_config(resolve_model(sys.argv[1]))
print(int(c.family == "deepseek_v32" or "compressed_sparse_attention" in c.mtp_layer_types))' "$model")
  "$py" -m ess_jax.train --model "$model" --data "$corpus" --out "$out/mtp-dense" --stage dense --train mtp \
    --mtp-weight 0.3 --steps 250 --context 512 --batch 8 --lr 3e-3 --warmup-steps 20 --eval-every 50 \
    --checkpoint-every 25 --no-progress
  if [ "$indexed" = 1 ]; then
    "$py" -m ess_jax.train --model "$out/mtp-dense" --data "$corpus" --out "$out/mtp-warmup" --stage warmup \
      --train mtp --mtp-weight 0.3 --steps 20 --context 512 --batch 8 --lr 3e-3 --warmup-steps 2 --eval-every 10 \
      --checkpoint-every 5 --no-progress
    "$py" -m ess_jax.train --model "$out/mtp-warmup" --data "$corpus" --out "$out/mtp-sparse" --stage sparse \
      --train mtp --mtp-weight 0.3 --steps 40 --context 512 --batch 8 --lr 1e-3 --warmup-steps 4 --eval-every 20 \
      --checkpoint-every 5 --no-progress
  fi
}

if [ "$1" = --mtp ]; then
  mtp_stages "$2" "$3" "$4"
  exit 0
fi
preset=$1 corpus=$2 out=$3 dense_steps=${4:-600}
"$py" -m ess_jax.train --model "$preset" --data "$corpus" --out "$out/dense" --stage dense \
  --steps "$dense_steps" --context 512 --batch 8 --lr 3e-3 --warmup-steps 30 --eval-every 100 --no-progress
"$py" -m ess_jax.train --model "$out/dense" --data "$corpus" --out "$out/warmup" --stage warmup \
  --steps 20 --context 4096 --batch 1 --lr 3e-3 --warmup-steps 2 --eval-every 10 --eval-batches 2 \
  --checkpoint-every 5 --no-progress
"$py" -m ess_jax.train --model "$out/warmup" --data "$corpus" --out "$out/sparse" --stage sparse \
  --steps 40 --context 4096 --batch 1 --lr 1e-3 --warmup-steps 4 --eval-every 20 --eval-batches 2 \
  --checkpoint-every 5 --no-progress
mtp_stages "$out/sparse" "$corpus" "$out"

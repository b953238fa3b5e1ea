#!/usr/bin/env bash
# GaLore's single-GPU LLaMA-7B setting, simulated (fake tensors, nothing allocated): rank 1024,
# projector refresh every 500 steps, per-layer updates, 8-bit Adam states, one sequence of 256
# tokens, bfloat16; beside per-layer GaLore with 16-bit states (same rank), 8-bit GaLore
# without per-layer updates, and AdamW. Run from anywhere; writes into this folder.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=results/reference/galore-7b-24gb
PY=${PYTHON:-.venv/bin/python}
G=rank=1024,update_proj_gap=500
METHODS=("galore_layerwise_8bit@$G" "galore_layerwise@$G" "galore_8bit@$G" adamw)

# One memory job each: the measured (second) step's peak by category, the first step's peak
# (the projector's SVD runs there), and the GPU memory predicted (allocator model + context).
for m in "${METHODS[@]}"; do
  "$PY" -m bench run --kind memory --method "$m" --model llama-7b --dtype bfloat16 \
      --batch-size 1 --seq-len 256 --simulate --out "$OUT/memory-${m%%@*}.json"
done

# Does it fit in 24 GiB, and the largest batch of 256-token sequences that does.
"$PY" -m bench fit --model llama-7b --methods "${METHODS[@]}" --batch-size 1 --seq-len 256 \
    --dtype bfloat16 --memory-gb 24 --json "$OUT/fit.json" > "$OUT/fit.txt"

# The authors' single-GPU recipe (galore-torch's README): the same optimizer with activation
# checkpointing at batch 16; 256-token sequences as above (the notes give no length for it).
"$PY" -m bench run --kind memory --method "checkpointing+galore_layerwise_8bit@$G" --model llama-7b \
    --dtype bfloat16 --batch-size 16 --seq-len 256 --simulate --out "$OUT/memory-checkpointing+galore_layerwise_8bit-batch16.json"

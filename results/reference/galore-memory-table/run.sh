#!/usr/bin/env bash
# Simulated memory of LLaMA 60M-1B with AdamW and with GaLore at the paper's ranks.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=results/reference/galore-memory-table
for pair in llama-60m:128 llama-130m:256 llama-350m:256 llama-1b:512; do
  model=${pair%%:*}; rank=${pair##*:}
  python -m bench --kind memory --method adamw --model "$model" --dtype bfloat16 \
      --batch-size 1 --seq-len 256 --simulate --out "$OUT/$model-adamw.json"
  python -m bench --kind memory --method galore --model "$model" --dtype bfloat16 \
      --batch-size 1 --seq-len 256 --simulate --hparam rank="$rank" --out "$OUT/$model-galore-rank$rank.json"
done

#!/usr/bin/env bash
# The loss at a 128k vocabulary: a full fine-tune of Llama-3.2-3B (examples/llama-3.2-3b,
# vocabulary 128,256, tied embeddings) at batch 2 x 4096 tokens in bfloat16 with AdamW, the
# loss computed whole (Hugging Face's: logits, their float32 copy) or in chunks (chunked_ce),
# without checkpointing, with full and with selective checkpointing. Simulated (fake tensors,
# nothing allocated). Run from anywhere; writes into this folder.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=results/reference/recipes
PY=${PYTHON:-.venv/bin/python}
MODEL=examples/llama-3.2-3b/config.json
for m in adamw chunked_ce checkpointing checkpointing+chunked_ce \
         "checkpointing@policy=selective" "checkpointing@policy=selective+chunked_ce"; do
  "$PY" -m bench run --kind memory --method "$m" --model "$MODEL" --dtype bfloat16 \
      --batch-size 2 --seq-len 4096 --simulate --out "$OUT/llama-3.2-3b/memory-${m//@policy=/-}.json"
done

#!/usr/bin/env bash
# LOMO's single-GPU claim ("full parameter fine-tuning of a 7B model on a single RTX 3090",
# 24 GB) in membench's terms: LLaMA-7B in pure float16 (LOMO keeps float16 weights and no
# master copy), activation checkpointing, the authors' batch of 16 (lomo/config/args_lomo.yaml:
# per_device_train_batch_size 16, data_max_length 1024, gradient_checkpointing true, fp16),
# sequences of 512 and 1024 tokens; beside AdamW the way the authors' baseline ran it
# (mixed precision: float16 compute over float32 master weights and state, checkpointing).
# Simulated (fake tensors, nothing allocated). Run from anywhere; writes into this folder.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=results/reference/recipes/lomo-7b-fp16
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
for seq in 512 1024; do
  "$PY" -m bench fit --model llama-7b --methods checkpointing+lomo lomo --dtype float16 \
      --batch-size 16 --seq-len $seq --memory-gb 24 --json "$OUT/fit-lomo-seq$seq.json" > "$OUT/fit-lomo-seq$seq.txt"
done
"$PY" -m bench fit --model llama-7b --methods checkpointing --dtype float16 --precision mixed \
    --batch-size 16 --seq-len 512 --memory-gb 24 80 --json "$OUT/fit-adamw-mixed.json" > "$OUT/fit-adamw-mixed.txt"

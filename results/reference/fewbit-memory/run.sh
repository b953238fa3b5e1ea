#!/bin/bash
# Memory of fewbit and approx_bp beside adamw (this folder's JSON files); from the repo root.
set -e
for model in gpt2-tiny bert-tiny llama-tiny; do
  for m in adamw fewbit approx_bp@norms=false approx_bp; do
    python -m bench --kind memory --method $m --model $model --batch-size 16 --seq-len 128 \
      --out results/reference/fewbit-memory/tracked_${model}_${m}.json
  done
done
for model in gpt2-xl bert-large llama-7b; do
  for m in adamw fewbit approx_bp@norms=false approx_bp; do
    python -m bench --kind memory --method $m --model $model --dtype bfloat16 --batch-size 8 \
      --seq-len 512 --simulate --out results/reference/fewbit-memory/sim_${model}_${m}.json
  done
done
for m in adamw fewbit; do  # nearest to Few-Bit's README table (RoBERTa-base MRPC, batch 128)
  python -m bench --kind memory --method $m --model bert-base --batch-size 128 --seq-len 128 \
    --simulate --out results/reference/fewbit-memory/mrpc_bert-base_${m}.json
done
python results/reference/fewbit-memory/summarize.py
python results/reference/fewbit-memory/per_layer.py

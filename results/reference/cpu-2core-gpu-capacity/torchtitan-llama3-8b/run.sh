#!/bin/bash
# torchtitan's Llama 3.1 8B FSDP runs (benchmarks/llama3_h100_202412_torchtitan.md, tables 1 and 3:
# local batch 2 x 8192, selective activation checkpointing, bf16 compute / fp32 shards), rank 0 of
# 8 and of 128 simulated. Run from the repository root; about 6 minutes each on 2 busy cores.
OUT=results/reference/cpu-2core-gpu-capacity/torchtitan-llama3-8b
for w in 8 128; do
  .venv/bin/python -m bench run --out $OUT/llama-3-8b-ws$w-fsdp-mixed.json --kind memory \
    --method checkpointing@policy=selective --model examples/llama-3-8b/config.json --batch-size 2 --seq-len 8192 \
    --dtype bfloat16 --precision mixed --simulate --world-size $w --sharding fsdp --attn-implementation sdpa
done

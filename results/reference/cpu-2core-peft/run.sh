#!/bin/sh
# The fits behind this folder's README (membench fit: a training step on fake tensors, the
# caching-allocator model, bfloat16); about 50 minutes on 2 CPU cores.
set -e
membench fit --model llama-7b --methods adamw lora qlora dora velora lora+velora wta_crs lora+wta_crs \
    --json fit-llama-7b.json > fit-llama-7b.txt
membench fit --model llama-7b --methods lora lora+velora checkpointing+lora qlora checkpointing+qlora \
    --batch-size 1 --max-batch 1 --memory-gb 16 24 --json fit-llama-7b-bs1.json > fit-llama-7b-bs1.txt
membench fit --model llama-65b --methods qlora checkpointing+qlora --batch-size 1 --max-batch 1 \
    --memory-gb 24 48 80 --json fit-llama-65b.json > fit-llama-65b.txt
membench fit --model llama-65b --methods checkpointing+qlora@rank=64 --batch-size 1 --max-batch 1 \
    --memory-gb 48 --json fit-llama-65b-r64.json > fit-llama-65b-r64.txt

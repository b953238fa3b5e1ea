"""torchtitan's Llama-3-8B setting where chunked cross-entropy was measured (pytorch/torchtitan
pull request 996): 8 GPUs under FSDP, one sequence of 8192 tokens, selective activation
checkpointing, the loss whole or in chunks. Rank 0's step simulated under FSDP2 at world
size 8 (fake tensors, fake process group: bench/measure/sharded.py), in pure bfloat16 (the
sharded tier has no mixed-precision policy yet: torchtitan keeps float32 shards and gathers
bfloat16). Run from the repository root: .venv/bin/python results/reference/recipes/run-chunked-ce-fsdp8.py"""
import json
import sys
import time

from bench.job import Job
from bench.measure import sharded

OUT = "results/reference/recipes/llama-3-8b-fsdp8"
for method in ("checkpointing@policy=selective", "checkpointing@policy=selective+chunked_ce"):
    job = Job(kind="memory", method=method, model="examples/llama-3-8b/config.json", batch_size=1,
              seq_len=8192, dtype="bfloat16", simulate=True)
    started = time.time()
    result = sharded.simulate_ranks(job, 8, [0])[0]
    result = {k: v for k, v in result.items() if k not in ("events", "shards", "before_update", "after_step")}
    result["job"] = job.to_dict()
    result["world_size"], result["rank"], result["wall_time_s"] = 8, 0, round(time.time() - started, 1)
    name = method.replace("@policy=", "-")
    with open(f"{OUT}/memory-{name}.json", "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(method, {k: v for k, v in result["memory"].items()}, file=sys.stderr)

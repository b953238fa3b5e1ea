"""Rank 0 of 8 under FSDP2, simulated at full depth: the sharded memory job's trace replayed on an
80 GiB GPU (fits or not), at fit's new boundary and one sequence above it."""
import sys, json, time
import torch
torch.set_num_threads(1)
from bench.job import Job
from bench.method import load
from bench.measure import sharded, allocator
out = {}
for spec in sys.argv[1].split(","):
    m, b = spec.split(":")
    t = time.perf_counter()
    j = Job(kind="memory", method=m, model="examples/mistral-7b/config.json", batch_size=int(b), seq_len=512,
            dtype="bfloat16", simulate=True, world_size=8, sharding="fsdp")
    r = sharded.measure_rank(j, load(m), 8, 0)
    out[spec] = {"fits_80gib": allocator.replay_on_gpu(r["events"], 80 * 2**30).fits,
                 "predicted_gpu_bytes": r["memory"]["predicted_gpu_bytes"], "seconds": round(time.perf_counter() - t, 1)}
    print(spec, out[spec], flush=True)
json.dump(out, open(sys.argv[2], "w"), indent=1)

"""Simulated memory jobs at full depth capped at 80 GiB (fits, or a predicted out-of-memory): the
new answers' boundaries checked without the search or the shallow copies."""
import sys, json, time
import torch
torch.set_num_threads(1)
from bench.job import Job
from bench.measure import runner
out = {}
for spec in sys.argv[1].split(","):
    m, b = spec.split(":")
    t = time.perf_counter()
    j = Job(kind="memory", method=m, model="examples/mistral-7b/config.json", batch_size=int(b), seq_len=512,
            dtype="bfloat16", simulate=True, capacity_gb=80)
    r = runner.run(j)
    out[spec] = {"status": r["status"], "message": (r.get("message") or "")[:160],
                 "predicted_gpu_bytes": r.get("memory", {}).get("predicted_gpu_bytes"), "seconds": round(time.perf_counter() - t, 1)}
    print(spec, out[spec], flush=True)
json.dump(out, open(sys.argv[2], "w"), indent=1)

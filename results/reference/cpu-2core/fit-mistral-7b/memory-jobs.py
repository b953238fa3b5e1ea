"""membench's simulated memory job at --batch-size (warm-up and step at that batch) for each method,
beside fit's row at the same batch (warm-up at one micro-batch)."""
import sys, json, time
import torch
torch.set_num_threads(1)
from bench.job import Job
from bench.measure import runner
methods, out, ws, sh = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3]), sys.argv[4]
rows = {}
for m in methods:
    t = time.perf_counter()
    j = Job(kind="memory", method=m, model="examples/mistral-7b/config.json", batch_size=8, seq_len=512,
            dtype="bfloat16", simulate=True, world_size=ws, sharding=sh)
    r = runner.run(j)
    rows[m] = {"status": r["status"], "message": r.get("message"),
               **({k: r["memory"].get(k) for k in ("peak_bytes", "predicted_gpu_bytes", "reserved_peak_bytes",
                                                    "predicted_allocated_peak_bytes")} if r["status"] == "ok" else {}),
               "seconds": round(time.perf_counter() - t, 1), "provenance": r.get("provenance")}
    print(m, rows[m]["status"], rows[m].get("predicted_gpu_bytes"), rows[m]["seconds"], flush=True)
    json.dump(rows, open(out, "w"), indent=1)

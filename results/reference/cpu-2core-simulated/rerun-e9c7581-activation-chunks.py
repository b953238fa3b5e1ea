"""Rerun the simulated fewbit/approx_bp/mesa8bit reference rows with this checkout; print the differences."""
import glob, json, sys, time, dataclasses
from bench.job import Job
from bench.measure.runner import run
import torch
torch.set_num_threads(1)
files = sorted(f for d in sys.argv[1:] for f in glob.glob(f"{d}/**/*.json", recursive=True)
               if any(f"/{m}/" in f for m in ("fewbit", "approx_bp", "mesa8bit")) and "-sim" in f)
fields = {f.name for f in dataclasses.fields(Job)}
keys = ["peak_bytes", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "other_bytes",
        "predicted_allocated_peak_bytes", "reserved_peak_bytes", "predicted_gpu_bytes"]
rows = []
for f in files:
    old = json.load(open(f))
    job = Job(**{k: v for k, v in old["job"].items() if k in fields})
    t = time.perf_counter(); new = run(job); dt = time.perf_counter() - t
    diff = {k: (old["memory"].get(k), new["memory"].get(k)) for k in keys if old["memory"].get(k) != new["memory"].get(k)}
    for k in ("ops", "flops", "bytes_moved"):
        a, b = (old.get("cost") or {}).get(k), (new.get("cost") or {}).get(k)
        if a != b: diff[k] = (a, b)
    rows.append(dict(file=f, status=(old["status"], new["status"]), seconds=round(dt, 1), old_wall=old.get("wall_time_s"), diff=diff))
    print(json.dumps(rows[-1]), flush=True)

"""Interleaved step times on the CPU: adamw vs fewbit vs approx_bp@norms=false, gpt2-tiny and
llama-tiny, batch 16, sequence 128, float32, 1 thread; 3 warm-up steps, then 15 rounds, one
step of each method per round; median of per-round ratios to adamw."""
import time, statistics, sys
import torch
from bench import models
from bench.method import load
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3] / "tests"))
from conftest import lm_batch
torch.set_num_threads(1)
METHODS = ["adamw", "fewbit", "approx_bp@norms=false"]
for name in ["gpt2-tiny", "llama-tiny"]:
    runs = {}
    for m in METHODS:
        torch.manual_seed(0)
        method = load(m)
        model = method.transform_model(models.build(name)).train()
        runs[m] = (method, model, method.make_optimizer(model))
    batch = lm_batch(16, 128)
    for _ in range(3):
        for m, (method, model, opt) in runs.items():
            method.train_step(model, opt, batch)
    times = {m: [] for m in METHODS}
    for _ in range(15):
        for m, (method, model, opt) in runs.items():
            t = time.perf_counter(); method.train_step(model, opt, batch); times[m].append(time.perf_counter() - t)
    for m in METHODS[1:]:
        ratios = [a / b for a, b in zip(times["adamw"], times[m])]
        q = statistics.quantiles(ratios, n=4)
        print(f"{name} {m}: throughput ratio to adamw median {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}); step {statistics.median(times[m])*1e3:.1f} ms vs {statistics.median(times['adamw'])*1e3:.1f} ms")

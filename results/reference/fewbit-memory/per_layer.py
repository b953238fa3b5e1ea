"""Activation bytes alive after the forward pass (all that is saved for backward), batch 16,
sequence 128, float32, tracked, plain CPU kernels: adamw against fewbit (3 bits) and
approx_bp@norms=false (2 bits), beside the formula layers x n x (copies x 4 - bits/8)."""
import torch
from bench import models
from bench.measure.tracker import MemoryTracker
from bench.method import load, lm_loss
import sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3] / "tests"))
from conftest import lm_batch

def fwd(name, method, b=16, t=128):
    torch.manual_seed(0)
    model = models.build(name)
    m = load(method); m.transform_model(model)
    tr = MemoryTracker(); tr.register_model(model)
    with tr:
        loss = lm_loss(model, lm_batch(b, t))
        a = tr.live_split().activation
    return a

torch.set_num_threads(1)
WIDTH = {"gpt2-tiny": [(2, 512, 4)], "bert-tiny": [(2, 512, 1), (1, 128, 1)], "llama-tiny": [(2, 344, 1)]}
print("| model | method | adamw: activation bytes | method: activation bytes | saved | formula | equal |")
print("|---|---|---|---|---|---|---|")
for name, parts in WIDTH.items():
    base = fwd(name, "adamw")
    for method, bits in (("fewbit", 3), ("approx_bp@norms=false", 2)):
        got = base - fwd(name, method)
        tokens = 16 * 128
        formula = sum(l * (c * tokens * w * 4 - tokens * w * bits // 8) for l, w, c in parts)
        print(f"| {name} | {method} | {base:,} | {base-got:,} | {got:,} | {formula:,} | {'yes' if got == formula else 'NO'} |")

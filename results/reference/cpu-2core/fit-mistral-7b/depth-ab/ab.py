"""fit's rows for five methods on the Mistral-7B example at the default memory sizes, with
a deep model's other batches read from shallow copies (`on`) or every batch run at full
depth (`off`: `_Deep.FROM_DEPTH` above any depth), as JSON: the rows, seconds per method
and in all. One process, one thread; both were run at once on the idle 2-core host."""
import json
import sys
import time

import torch

from bench import fit
from bench.measure import capacity

torch.set_num_threads(1)
mode = sys.argv[1]
if mode == "off":
    capacity._Deep.FROM_DEPTH = 10**6
rows, per = [], {}
t0 = time.perf_counter()
for m in ["adamw", "checkpointing", "grad_accum", "galore_layerwise", "lora"]:
    t = time.perf_counter()
    rows += fit.answer("examples/mistral-7b/config.json", m, [16, 24, 40, 80], 8, 512, "bfloat16", 4096)
    per[m] = round(time.perf_counter() - t, 1)
json.dump({"rows": rows, "seconds": per, "total": round(time.perf_counter() - t0, 1)},
          open(f"depth-{mode}.json", "w"), indent=1)

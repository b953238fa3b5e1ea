"""fit's rows for methods with the trace line off (every batch run), as JSON."""
import json, sys, time
from bench import fit
from bench.measure import capacity
if sys.argv[1] == "off":
    capacity.Oracle._from_line = lambda self, batch: None
out = {}
for m in sys.argv[3:]:
    t = time.perf_counter()
    rows = fit.answer(method=m, model="examples/mistral-7b/config.json", batch_size=8, seq_len=512,
                      memory_gb=[16, 24, 40, 80], max_batch=4096, dtype="bfloat16")
    out[m] = {"rows": rows, "s": time.perf_counter() - t}
json.dump(out, open(sys.argv[2], "w"), default=str)

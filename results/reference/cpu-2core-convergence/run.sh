#!/bin/sh
# The `convergence` suite's Markov cells of AdamW, AdamA, MicroAdam and GaLore (its grids on
# seed 100, then seeds 0-2 at the chosen rates), run from the repository's root without the
# rest of the suite: the grid first, two processes at a time, then the tuned jobs.
set -e
python - <<'PY'
import json, subprocess, yaml
from concurrent.futures import ThreadPoolExecutor
from bench import suite

config = yaml.safe_load(open("config/config.yaml"))
config["suite"] = "convergence"
_, jobs = suite.check(config)
chosen = {p: j for p, j in jobs.items() if j.method in {"adamw", "adama", "microadam", "galore"}
          and j.task == "markov" and not j.init and not j.save_weights}
for tuned in (False, True):
    part = [{"job": j.to_dict(), "out": p} for p, j in chosen.items() if bool(j.tuned_from) == tuned]
    run = lambda half: subprocess.run(["membench", "many", "--jobs-json", json.dumps(half), "--threads", "1"], check=True)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(run, [part[0::2], part[1::2]]))
PY
membench aggregate --summary summary.csv --curves curves.csv results/runs/convergence/convergence/*/*/*.json
membench figures --summary summary.csv --curves curves.csv --out figures
membench report --summary summary.csv --out results.md

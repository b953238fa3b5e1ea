"""Does a throughput job's interval hold the ratio that running the job again gives?

Runs the same paired throughput jobs (each method beside the baseline) REPEATS times,
each job in a fresh process (`membench run`; with --panel, the methods of one repeat as
one panel in one process, as a CPU suite runs them), the repeats one after another, then
scores every pair of repeats of a method as `membench compare --ratios` scores two
summaries: |log(r1/r2)|, whether each run's 95% interval holds the other's ratio (one way,
and both ways: about 83% for exact intervals), and whether the two agree within their
combined interval (|log(r1/r2)| <= sqrt(h1^2 + h2^2): about 95%). It scores three
intervals, each recomputed from the same rounds: the one the jobs report (`interval`: t
over segments of rounds on fresh memory layouts, plus timing.BETWEEN_RUNS_SD), the same
without the between-runs term (`segments_only`: what one process sees), and the bootstrap
over rounds the jobs reported before segments (`bootstrap_rounds`). And it splits the
spread of the segments' median log ratios into within a process and between processes:
`process_excess_sd` is the spread between runs that no interval from inside one process
can see, and `between_runs_estimate` pools it over the methods (what BETWEEN_RUNS_SD is
set from; `--between-runs X --only M` scores method M with X, e.g. X estimated from the
other methods).

A benchmark (timings), not a test: it runs for minutes.

    python scripts/throughput_repeats.py --repeats 6 --methods checkpointing grad_accum adama \\
        --model gpt2-tiny --batch-size 16 --seq-len 128 --steps 24 --rounds 24 --threads 1 --out DIR
    python scripts/throughput_repeats.py --score DIR     # score the records already in DIR
    python scripts/throughput_repeats.py --runs RUN1 RUN2  # two whole runs (e.g. a suite's) as repeats
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.measure import timing  # noqa: E402


def run_jobs(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = dict(kind="throughput", model=args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                  steps=args.steps, rounds=args.rounds, warmup_steps=args.warmup_steps, baseline=args.baseline,
                  threads=args.threads, seed=args.seed)
    for rep in range(args.repeats):
        started = time.perf_counter()
        if args.panel:
            entries = [{"job": {**common, "method": m}, "out": str(out / f"rep{rep}-{m}.json")}
                       for m in args.methods]
            cmds = [[sys.executable, "-m", "bench", "many", "--jobs-json", json.dumps(entries),
                     "--threads", str(args.threads)]]
        else:
            cmds = [[sys.executable, "-m", "bench", "run", "--out", str(out / f"rep{rep}-{m}.json"), "--method", m,
                     *itertools.chain.from_iterable((f"--{k.replace('_', '-')}", str(v))
                                                    for k, v in common.items())]
                    for m in args.methods]
        for cmd in cmds:
            subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True)
        print(f"repeat {rep + 1}/{args.repeats}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)


def load(out: Path) -> dict[str, list[dict]]:
    """The ok throughput results in `out` by method, in the order of their repeats."""
    records: dict[str, list[dict]] = {}
    for path in sorted(out.glob("rep*-*.json"), key=lambda p: int(p.name[3:].split("-")[0])):
        record = json.loads(path.read_text())
        if record.get("status") == "ok":
            records.setdefault(record["job"]["method"], []).append(_segmented(record["throughput"]))
    return records


def load_runs(dirs: list[str]) -> dict[str, list[dict]]:
    """Whole runs as repeats (each directory one run: its result JSONs, at any depth), by
    model/method; the cells that every run has ok."""
    runs = []
    for d in dirs:
        found = {}
        for path in Path(d).rglob("*.json"):
            record = json.loads(path.read_text())
            if record.get("status") == "ok" and "throughput" in record:
                found[f"{record['job']['model']}/{record['job']['method']}"] = _segmented(record["throughput"])
        runs.append(found)
    return {k: [r[k] for r in runs] for k in sorted(set.intersection(*(set(r) for r in runs)))}


def _segmented(t: dict) -> dict:
    """A result from before segments: its rounds (in time order) grouped as segments
    would be (`timing.segment_bounds`), without the relayout between them."""
    return t if "round_segments" in t else {**t, "round_segments": timing.segment_bounds(len(t["round_ratios"]))}


# the intervals scored: the one the jobs report now, the same without the between-runs
# term (what one run sees from inside), and the bootstrap over rounds reported before segments
INTERVALS = ("interval", "segments_only", "bootstrap_rounds")


def interval(t: dict, which: str, between_runs: float = timing.BETWEEN_RUNS_SD) -> tuple[float, float, float]:
    """A result's ratio and interval, recomputed from its rounds by the current code."""
    if which == "bootstrap_rounds":
        return timing.bootstrap_median(t["round_ratios"])
    return timing.segment_interval(t["round_ratios"], t["round_segments"],
                                   between_runs=between_runs if which == "interval" else 0.0)


def pairs(records: dict[str, list[dict]], which: str, between_runs: float = timing.BETWEEN_RUNS_SD) -> list[dict]:
    """Every pair of repeats (i < j) of every method, scored as `compare.ratio_agreement`."""
    out = []
    for method, runs in records.items():
        got = [interval(t, which, between_runs) for t in runs]
        for i, j in itertools.combinations(range(len(got)), 2):
            (r1, lo1, hi1), (r2, lo2, hi2) = got[i], got[j]
            h1, h2 = math.log(hi1 / lo1) / 2, math.log(hi2 / lo2) / 2
            one, other = lo1 <= r2 <= hi1, lo2 <= r1 <= hi2
            out.append({"method": method, "i": i, "j": j, "abs_log": abs(math.log(r1 / r2)),
                        "one_way": (one + other) / 2, "both": one and other,
                        "combined": abs(math.log(r1 / r2)) <= math.hypot(h1, h2), "half": (h1 + h2) / 2})
    return out


def score(records: dict[str, list[dict]], between_runs: float = timing.BETWEEN_RUNS_SD) -> dict:
    """Each interval's agreement over every pair of repeats; per method too."""
    out = {}
    for which in INTERVALS:
        p = pairs(records, which, between_runs)
        summary = {
            "pairs": len(p), "median_abs_log": statistics.median(x["abs_log"] for x in p),
            "max_abs_log": max(x["abs_log"] for x in p),
            "one_way_coverage": statistics.fmean(x["one_way"] for x in p),
            "mutual_coverage": statistics.fmean(x["both"] for x in p),
            "combined_agreement": statistics.fmean(x["combined"] for x in p),
            "median_half_width": statistics.median(x["half"] for x in p)}
        summary["by_method"] = {m: {"median_abs_log": statistics.median(x["abs_log"] for x in p if x["method"] == m),
                                    "one_way_coverage": statistics.fmean(x["one_way"] for x in p if x["method"] == m),
                                    "combined_agreement": statistics.fmean(x["combined"] for x in p
                                                                           if x["method"] == m)}
                                for m in records}
        out[which] = summary
    return out


def between_runs_estimate(records: dict[str, list[dict]]) -> float:
    """The between-runs sd (log) the repeats show: the root of the mean over methods of the
    processes' variance beyond what their segments predict (each unclipped, so that the
    noise of few repeats averages out; 0 if the mean is not positive)."""
    excess = [components(r)["process_excess_var"] for r in records.values() if len(r) > 1]
    return max(0.0, statistics.fmean(excess)) ** 0.5 if excess else 0.0


def components(runs: list[dict]) -> dict:
    """The spread of segment medians (log ratio) within a process against that of the
    processes' means: with no effect per process, var(process means) is the within-process
    variance of a segment over the number of segments (`f` about 1)."""
    means, within = [], []
    for t in runs:
        groups: dict[int, list[float]] = {}
        for r, s in zip(t["round_ratios"], t["round_segments"]):
            groups.setdefault(s, []).append(math.log(r))
        medians = [statistics.median(g) for g in groups.values()]
        means.append(statistics.fmean(medians))
        within.append(statistics.variance(medians))
    k = len(set(runs[0]["round_segments"]))
    expected = statistics.fmean(within) / k
    between = statistics.variance(means)
    return {"processes": len(runs), "segments": k, "segment_sd": statistics.fmean(within) ** 0.5,
            "process_means_sd": between ** 0.5, "expected_from_segments_sd": expected ** 0.5,
            "f": between / expected, "process_excess_var": between - expected,
            "process_excess_sd": max(0.0, between - expected) ** 0.5}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="where the jobs' results go")
    p.add_argument("--score", metavar="DIR", help="only score the results already in DIR")
    p.add_argument("--runs", nargs="+", metavar="DIR",
                   help="only score whole runs as repeats (each DIR one run's result JSONs, e.g. a suite's runs/)")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--methods", nargs="+", default=["checkpointing", "grad_accum", "adama"])
    p.add_argument("--baseline", default="adamw")
    p.add_argument("--model", default="gpt2-tiny")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--panel", action="store_true", help="a repeat's methods as one panel in one process")
    p.add_argument("--between-runs", type=float, default=timing.BETWEEN_RUNS_SD,
                   help="the between-runs sd the scored interval adds (default: timing.BETWEEN_RUNS_SD)")
    p.add_argument("--only", nargs="+", help="with --score: score these methods' results only")
    args = p.parse_args(argv)
    if not (args.score or args.out or args.runs):
        p.error("--out DIR (run and score), --score DIR or --runs DIR DIR...")
    if not (args.score or args.runs):
        run_jobs(args)
    out = Path(args.score or args.out or ".")
    records = load_runs(args.runs) if args.runs else load(out)
    if args.only:
        records = {m: r for m, r in records.items() if m in args.only}
    result = {"between_runs": args.between_runs, "score": score(records, args.between_runs),
              "components": {m: components(r) for m, r in records.items() if len(r) > 1},
              "between_runs_estimate": between_runs_estimate(records),
              "ratios": {m: [t["throughput_ratio"] for t in r] for m, r in records.items()}}
    if not args.runs:
        (out / "score.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

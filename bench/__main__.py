"""Command line: run one job and write its result file, or several in one process.

    python -m bench --kind memory --method grad_accum --model gpt2-tiny \\
        --batch-size 8 --seq-len 128 --out results/runs/example.json
    python -m bench many jobs.json        # [{"args": [...], "out": "..."}, ...]

`python -m bench fit ...` (`membench fit`) asks instead whether a model fits on GPUs of
given sizes, for every method: `bench.fit`.
"""
from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys

from bench.measure import records as results
from bench.method import MethodError, available, load
from bench.models import MODELS, is_known
from bench.data import TASKS
from bench.job import DTYPE_NAMES, JOB_DEFAULTS as D, KINDS, Job
from bench.measure.runner import run, run_panel


def parse_hparam(text: str):
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {value}")
    return value


def _model(name: str) -> str:
    if not is_known(name):
        raise argparse.ArgumentTypeError(f"unknown model {name!r}")
    return name


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run one membench job (one method, one model, one kind of measurement) "
                    "and write one JSON result with its provenance. A method that fails, runs "
                    "out of memory or diverges still writes a result, with that status; the "
                    "exit code is 0 so a workflow goes on.",
        epilog="kinds: memory = peak bytes by category over a warm-up and a measured step; "
               "throughput = median step time over timed steps after warm-up; "
               "convergence = loss per step; capacity = largest batch that fits each of --memory-gb; "
               "model_capacity = largest size of the model's family that trains at --batch-size "
               "in each of --memory-gb. "
               "Methods: " + ", ".join(available()) +
               " (stack with '+', e.g. checkpointing+grad_accum; fix hyperparameters with '@', "
               "e.g. galore@rank=8). "
               "Does a model fit on a GPU, per method? `python -m bench fit --help`.")
    p.add_argument("--kind", required=True, choices=KINDS)
    p.add_argument("--method", required=True, help="method module name or a+b stack")
    p.add_argument("--model", required=True, type=_model, metavar="MODEL",
                   help="one of: " + ", ".join(MODELS) + "; or any width and depth of a family "
                        "as <family>-d<width>-l<layers>[-v<vocab>], e.g. llama-d3072-l28; "
                        "model_capacity: the first size of the ladder searched")
    p.add_argument("--batch-size", type=_positive, required=True, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=_positive, required=True, help="tokens per sequence")
    p.add_argument("--out", required=True, help="result JSON path (written atomically)")
    p.add_argument("--seed", type=int, default=D["seed"], help="seeds model init and data (default %(default)s)")
    p.add_argument("--device", default=D["device"], help="cpu or cuda[:N] (default %(default)s)")
    p.add_argument("--dtype", default=D["dtype"], choices=DTYPE_NAMES, help="parameter dtype (default %(default)s)")
    p.add_argument("--task", default=D["task"], choices=sorted(TASKS), help="training data (default %(default)s)")
    p.add_argument("--attn-implementation", default=D["attn_implementation"], choices=["sdpa", "eager"],
                   help="attention kernel (default %(default)s)")
    p.add_argument("--dropout", type=float, default=D["dropout"], help="override the model's dropout")
    p.add_argument("--hparam", type=parse_hparam, action="append", default=[], metavar="KEY=VALUE",
                   help="override a method hyperparameter (JSON value), repeatable")
    p.add_argument("--capacity-gb", type=float, default=D["capacity_gb"],
                   help="memory capacity in GiB: over it the job records status oom")
    p.add_argument("--simulate", action="store_true",
                   help="memory and capacity kinds: run the step on fake tensors (no memory is "
                        "allocated; tier 'simulated'), so paper-sized models fit on a laptop; "
                        "what a GPU would need is predicted by a model of CUDA's caching allocator")
    p.add_argument("--memory-gb", type=float, nargs="+", default=D["memory_gb"], metavar="GB",
                   help="capacity kinds: memory sizes in GiB to find the largest batch (or "
                        "model) for; capacity: --batch-size is then the largest batch tried")
    p.add_argument("--steps", type=_positive, default=D["steps"],
                   help="convergence: steps; throughput: timed steps (default %(default)s)")
    p.add_argument("--warmup-steps", type=int, default=D["warmup_steps"],
                   help="throughput: untimed steps first (default %(default)s)")
    p.add_argument("--rounds", type=_positive, default=D["rounds"],
                   help="throughput: interleaved rounds of the method and its baseline; --steps "
                        "are split among them (default %(default)s)")
    p.add_argument("--baseline", default=D["baseline"],
                   help="throughput: the method timed beside --method in the same process; the "
                        "result is the ratio of their tokens/s with a 95%% bootstrap interval "
                        "(default %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return p


def job_from_args(args: argparse.Namespace) -> Job:
    """The Job the parsed arguments describe; a bad method, stack or hyperparameter is an
    argument error (SystemExit 2), before any work."""
    method = args.method
    unknown = [m for m in (part.partition("@")[0] for part in method.split("+")) if m not in available()]
    if unknown:
        parser().error(f"unknown method {unknown[0]!r}; available: {', '.join(available())}")
    try:
        load(method, dict(args.hparam))
    except MethodError as e:
        parser().error(str(e))
    return Job(kind=args.kind, method=method, model=args.model, batch_size=args.batch_size,
               seq_len=args.seq_len, seed=args.seed, device=args.device, dtype=args.dtype,
               task=args.task, attn_implementation=args.attn_implementation, dropout=args.dropout,
               hparams=dict(args.hparam), capacity_gb=args.capacity_gb, steps=args.steps,
               warmup_steps=args.warmup_steps, rounds=args.rounds, baseline=args.baseline,
               threads=args.threads, simulate=args.simulate, memory_gb=args.memory_gb)


def run_one(job: Job, out: str) -> dict:
    print(f"membench: {job.kind} {job.method} on {job.model} (batch {job.batch_size}, "
          f"seq {job.seq_len}, seed {job.seed}, {job.device})", file=sys.stderr, flush=True)
    return write_one(run(job), out)


def write_one(record: dict, out: str) -> dict:
    results.write_atomic(out, record)
    print(f"membench: {record['job']['method']}: status {record['status']}"
          + (f" ({record['message']})" if record["message"] else "")
          + f", {record['wall_time_s']:.1f} s -> {out}", file=sys.stderr, flush=True)
    return record


# host memory a panel's sides may hold together (parameters, gradients, two moments each)
PANEL_BYTES = 2 * 2**30


def panels(jobs: list[Job]) -> list[list[int]]:
    """`jobs`' indices in batches run together: CPU throughput jobs that differ only in
    their method form one panel (timed beside one baseline, `run_panel`), as many as fit
    in PANEL_BYTES; every other job runs alone. Batches in the order of their first job."""
    import dataclasses

    open_panel: dict[tuple, list[int]] = {}  # panel key -> the batch still filling
    out: list[list[int]] = []
    for i, job in enumerate(jobs):
        if job.kind != "throughput" or job.device != "cpu":
            out.append([i])
            continue
        fields = dataclasses.asdict(job)
        key = tuple((k, repr(v)) for k, v in fields.items() if k not in ("method", "hparams"))
        batch = open_panel.get(key)
        if batch is None or (len(batch) + 2) * 16 * _n_params(job.model, job.attn_implementation) > PANEL_BYTES:
            batch = open_panel[key] = []
            out.append(batch)
        batch.append(i)
    return out


@functools.cache
def _n_params(model: str, attn_implementation: str) -> int:
    import torch

    from bench import models

    with torch.device("meta"):
        return models.n_params(models.build(model, attn_implementation))


def many(argv: list[str]) -> int:
    """`python -m bench many JOBS.json [--threads N]` (or `--jobs-json TEXT`): run several jobs in one process, one
    after another (one start-up of torch for all of them); JOBS.json is a list of
    {"args": [...the arguments of one job...], "out": "result.json"}. Each result is
    written atomically as soon as its job ends, so an interrupted group keeps the results
    it finished. CPU throughput jobs that differ only in their method are timed together,
    as one panel beside one baseline (`panels`). CUDA jobs each run in a fresh process
    (the allocator's peak must start from nothing)."""
    p = argparse.ArgumentParser(prog="python -m bench many", description=many.__doc__)
    p.add_argument("jobs", nargs="?", help="a JSON file: a list of {args, out}")
    p.add_argument("--jobs-json", help="the same list as JSON text (instead of a file)")
    p.add_argument("--threads", type=_positive, default=None, help="torch CPU threads")
    opts = p.parse_args(argv)
    if (opts.jobs is None) == (opts.jobs_json is None):
        p.error("give a JSON file or --jobs-json, not both")
    if opts.jobs_json is not None:
        entries = json.loads(opts.jobs_json)
    else:
        with open(opts.jobs) as f:
            entries = json.load(f)
    jobs = [job_from_args(parser().parse_args([*e["args"], "--out", e["out"]])) for e in entries]
    for job in jobs:
        if opts.threads:
            job.threads = opts.threads
    done = 0
    for batch in panels(jobs):
        if len(batch) > 1:  # throughput jobs timed together beside one baseline
            print(f"membench many: jobs {done + 1}-{done + len(batch)}/{len(jobs)}: "
                  f"{len(batch)} throughput jobs on {jobs[batch[0]].model}, one panel",
                  file=sys.stderr, flush=True)
            for i, record in zip(batch, run_panel([jobs[i] for i in batch])):
                write_one(record, entries[i]["out"])
            done += len(batch)
            continue
        i = batch[0]
        job, entry = jobs[i], entries[i]
        done += 1
        print(f"membench many: job {done}/{len(jobs)}", file=sys.stderr, flush=True)
        if job.device.startswith("cuda"):
            # a GPU job reads the allocator's peak: each in a fresh process, so nothing an
            # earlier job left allocated (a method's reference cycle) is counted
            threads = ["--threads", str(opts.threads)] if opts.threads else []
            subprocess.run([sys.executable, "-m", "bench", *entry["args"], "--out", entry["out"],
                            *threads], check=False)
        else:
            run_one(job, entry["out"])
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["many"]:
        return many(argv[1:])
    if argv[:1] == ["fit"]:
        from bench import fit

        return fit.main(argv[1:])
    args = parser().parse_args(argv)
    run_one(job_from_args(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

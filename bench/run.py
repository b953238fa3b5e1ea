"""Run jobs from the command line and write their results: `membench run` (one job, its
flags made from config/schema.yaml's `$defs/job`) and `membench many` (a group of jobs
given as the JSON of their fields, one process for all of them: the workflow's rules).

    membench run --kind memory --method grad_accum --model gpt2-tiny \\
        --batch-size 8 --seq-len 128 --out results/runs/example.json

A method that fails, runs out of memory or diverges still writes a result, with that
status; the exit code is 0 so a workflow goes on.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from bench.job import JOB_FIELDS, JOB_SCHEMA, PROPERTIES, Job, JobError
from bench.measure import records
from bench.measure.runner import panels, run, run_panel
from bench.method import MethodError, available, load
from bench.models import MODELS, is_known

_PARSE = {"integer": int, "number": float, "string": str}


def _flag(p: argparse.ArgumentParser, name: str, prop: dict) -> None:
    """One flag of `membench run` for the job field `name`, as its schema entry says."""
    flag = "--" + name.replace("_", "-")
    types = prop.get("type", "string")
    types = [t for t in (types if isinstance(types, list) else [types]) if t != "null"]
    default = prop.get("default")
    text = prop.get("description", "")
    if default is not None and default is not False and default not in ([], {}):
        text += f" (default {default})"
    text = text.replace("%", "%%")
    kw = dict(required=name in JOB_SCHEMA["required"], help=text)
    if "enum" in prop:
        p.add_argument(flag, choices=prop["enum"], default=default, **kw)
    elif types == ["boolean"]:
        p.add_argument(flag, action="store_true", help=text)
    elif types == ["array"]:
        p.add_argument(flag, type=_PARSE[prop["items"]["type"]], nargs="+", default=default,
                       metavar="X", **kw)
    elif types == ["object"]:  # hparams
        p.add_argument("--hparam", type=parse_hparam, action="append", default=[],
                       metavar="KEY=VALUE", help=text + "; KEY=VALUE (a JSON value), repeatable")
    else:
        p.add_argument(flag, type=_PARSE[types[0]], default=default, **kw)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="membench run",
        description="Run one job (one method, one model, one kind of measurement) and write "
                    "one JSON result with its provenance. A method that fails, runs out of "
                    "memory or diverges still writes a result, with that status; the exit "
                    "code is 0 so a workflow goes on. The flags are config/schema.yaml's job "
                    "fields.",
        epilog="models: " + ", ".join(MODELS) + ", or any width and depth of a family as "
               "<family>-d<width>-l<layers>[-v<vocab>]. methods: " + ", ".join(available()) +
               " (stack with '+', e.g. checkpointing+grad_accum; fix options with '@', e.g. "
               "galore@rank=8). Does a model fit on a GPU, per method? `membench fit --help`.")
    for name in JOB_FIELDS:
        _flag(p, name, PROPERTIES[name])
    p.add_argument("--out", required=True, help="result JSON path (written atomically)")
    return p


def parse_hparam(text: str):
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def job_from_args(args: argparse.Namespace) -> Job:
    """The Job the parsed flags describe; a value the schema rejects, an unknown model,
    method, stack or option is an argument error (SystemExit 2), before any work."""
    fields = {name: getattr(args, name) for name in JOB_FIELDS if name != "hparams"}
    fields["hparams"] = dict(args.hparam)
    try:
        job = Job.from_dict(fields)
        check_names(job)
    except (JobError, MethodError) as e:
        parser().error(str(e))
    return job


def check_names(job: Job) -> None:
    """A MethodError if the job's model, method, stack or options do not exist."""
    if not is_known(job.model):
        raise MethodError(f"unknown model {job.model!r}; known: {', '.join(MODELS)}, or a "
                          f"shape <family>-d<width>-l<layers>[-v<vocab>]")
    load(job.method, job.hparams)


def run_one(job: Job, out: str) -> dict:
    print(f"membench: {job.kind} {job.method} on {job.model} (batch {job.batch_size}, "
          f"seq {job.seq_len}, seed {job.seed}, {job.device})", file=sys.stderr, flush=True)
    return write_one(run(job), out)


def write_one(record: dict, out: str) -> dict:
    records.write_atomic(out, record)
    print(f"membench: {record['job']['method']}: status {record['status']}"
          + (f" ({record['message']})" if record["message"] else "")
          + f", {record['wall_time_s']:.1f} s -> {out}", file=sys.stderr, flush=True)
    return record


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    run_one(job_from_args(args), args.out)
    return 0


def many(argv=None) -> int:
    """Run several jobs in one process, one after another (one start-up of torch for all
    of them). JOBS is a JSON list of {"job": {...a job's fields...}, "out": "result.json"}.
    Each result is written atomically as soon as its job ends, so an interrupted group
    keeps the results it finished. CPU throughput jobs that differ only in their method are
    timed together, as one panel beside one baseline. CUDA jobs each run in a fresh
    process (the allocator's peak must start from nothing)."""
    p = argparse.ArgumentParser(prog="membench many", description=many.__doc__)
    p.add_argument("jobs", nargs="?", help="a JSON file: a list of {job, out}")
    p.add_argument("--jobs-json", help="the same list as JSON text (instead of a file)")
    p.add_argument("--threads", type=_positive, default=None, help="torch CPU threads")
    p.add_argument("--here", action="store_true",
                   help="run CUDA jobs in this process too (how a CUDA job's own process runs it)")
    opts = p.parse_args(argv)
    if (opts.jobs is None) == (opts.jobs_json is None):
        p.error("give a JSON file or --jobs-json, not both")
    if opts.jobs_json is not None:
        entries = json.loads(opts.jobs_json)
    else:
        with open(opts.jobs) as f:
            entries = json.load(f)
    try:
        jobs = [Job.from_dict({**e["job"], "threads": opts.threads or e["job"].get("threads")})
                for e in entries]
    except JobError as e:
        p.error(str(e))
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
        job, out = jobs[i], entries[i]["out"]
        done += 1
        print(f"membench many: job {done}/{len(jobs)}", file=sys.stderr, flush=True)
        if job.device.startswith("cuda") and not opts.here:
            # a GPU job reads the allocator's peak: each in a fresh process, so nothing an
            # earlier job left allocated (a method's reference cycle) is counted
            one = json.dumps([{"job": job.to_dict(), "out": out}])
            subprocess.run([sys.executable, "-m", "bench", "many", "--here", "--jobs-json", one],
                           check=False)
        else:
            run_one(job, out)
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {value}")
    return value

"""Run jobs and write their results: `membench run` (one job, its flags made from
config/schema.yaml's `$defs/job`), and `work`, the loop that runs a group of jobs in one
process for `membench many` (bench.many, which watches it).

    membench run --kind memory --method grad_accum --model gpt2-tiny \\
        --batch-size 8 --seq-len 128 --out results/runs/example.json

A method that fails, runs out of memory or diverges still writes a result, with that
status; the exit code is 0 so a workflow goes on.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from bench.job import JOB_FIELDS, JOB_SCHEMA, PROPERTIES, Job, JobError
from bench.measure import records
from bench.measure.runner import panels, run, run_panel
from bench.measure.step import TimedOut
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
    """A MethodError if the job's model, method, stack or options do not exist, or its
    dtype and precision cannot go together."""
    from bench.measure.step import precision_error

    problem = precision_error(job.dtype, job.precision)
    if problem:
        raise MethodError(problem)
    if not is_known(job.model):
        raise MethodError(f"unknown model {job.model!r}; known: {', '.join(MODELS)}, or a "
                          f"shape <family>-d<width>-l<layers>[-v<vocab>]")
    load(job.method, job.hparams)


def _describe(job: Job) -> str:
    return (f"{job.kind} {job.method} on {job.model} (batch {job.batch_size}, seq {job.seq_len}, "
            f"seed {job.seed}, {job.device})")


def run_one(job: Job, out: str) -> dict:
    print(f"membench: {_describe(job)}", file=sys.stderr, flush=True)
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


def work(entries: list[dict], progress_fd: int) -> int:
    """Run `entries` ({"job": fields, "out": path}) one after another in this process (one
    start-up of torch for all of them), each result written atomically as soon as its job
    ends; CPU throughput jobs that differ only in their method are timed together, as one
    panel beside one baseline. Before and after each job (or panel) a line on
    `progress_fd`: {"start": [indices]} / {"done": [indices]}, for `membench many`, which
    runs this in a child process and watches it. Returns after a job that timed out (the
    process may be left in any state): `membench many` runs the rest in a fresh one."""
    _die_with_parent()
    report = os.fdopen(progress_fd, "w", buffering=1)

    def say(event: str, batch: list[int]) -> None:
        report.write(json.dumps({event: batch}) + "\n")

    jobs = [Job.from_dict(e["job"]) for e in entries]
    done = 0
    for batch in panels(jobs):
        say("start", batch)
        if len(batch) == 1:
            print(f"membench many: job {done + 1}/{len(jobs)}: {_describe(jobs[batch[0]])}",
                  file=sys.stderr, flush=True)
        else:  # throughput jobs timed together beside one baseline
            print(f"membench many: jobs {done + 1}-{done + len(batch)}/{len(jobs)}: "
                  f"{len(batch)} throughput jobs on {jobs[batch[0]].model}, one panel",
                  file=sys.stderr, flush=True)
        try:
            results = [run(jobs[batch[0]])] if len(batch) == 1 else run_panel([jobs[i] for i in batch])
        except TimedOut as e:  # the limit fell after the job's own handler was left
            results = [records.failure(jobs[i], "timeout", str(e)) for i in batch]
        for i, record in zip(batch, results):
            write_one(record, entries[i]["out"])
        done += len(batch)
        say("done", batch)
        if any(r["status"] == "timeout" for r in results):
            # the limit may have fallen anywhere (inside an import, holding a lock): the
            # rest of the jobs get a fresh process (`membench many` starts one)
            return 0
    return 0


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the process that started it dies (the fork
    server, which ends when `membench many` does: a killed `membench many` leaves no job
    running on)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

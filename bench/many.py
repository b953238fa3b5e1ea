"""`membench many`: run a group of jobs (the workflow's rules) in one child process, and
watch it, so that every job leaves a row however it ends.

The jobs run one after another in a worker process (`bench.run.work`: one start-up of
torch for them all; a CUDA job gets a worker of its own, so the allocator's peak starts
from nothing). Workers are forks of a fork server (`bench.workers`) that imported torch and
transformers' model code once, so a worker started after a fault costs a fork, not those
imports again. The worker says on a pipe which job it starts and which it finished. This
process stays small (it never imports torch: the fork server does) and writes the row of a
job the worker could not write itself:

- past its time limit (`Job.time_limit`): the job's own limit ends it first, from inside,
  with a `timeout` row and what it had measured; a job stuck in C code (a collective
  that never returns) is killed GRACE seconds later and gets a `timeout` row here;
- killed by a signal (the kernel's OOM killer, a user's `kill -9`): a row with status
  `oom` where the memory cgroup counted an OOM kill, else `killed`, naming the signal;
- a worker that exits without finishing its job: an `error` row with its exit code.

The jobs the worker had not started run in a fresh worker. A result the worker wrote is
never overwritten.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time
from pathlib import Path

from bench import workers
from bench.job import Job, JobError
from bench.measure import records


# what the fork server imports: what a job needs before it starts (not the fit and sharded
# code that bench.workers.PRELOAD adds for its other callers)
PRELOAD = ["bench.run", "transformers.modeling_utils"]


def grace(limit: float) -> float:
    """Seconds a job may run past its limit before it is killed from outside."""
    return 5.0 + 0.1 * limit


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="membench many", description=(
        "Run a group of jobs (a JSON list of {\"job\": {...the job's fields...}, \"out\": "
        "\"result.json\"}) in one worker process, one after another, each result written "
        "atomically as soon as its job ends. A job past its time limit, killed by a signal "
        "(out of host memory) or whose process dies still leaves a row (status timeout, "
        "oom, killed or error); the others go on. CPU throughput jobs that differ only in "
        "their method are timed together, as one panel beside one baseline."))
    p.add_argument("jobs", nargs="?", help="a JSON file: a list of {job, out}")
    p.add_argument("--jobs-json", help="the same list as JSON text (instead of a file)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (at least 1)")
    opts = p.parse_args(argv)
    if (opts.jobs is None) == (opts.jobs_json is None):
        p.error("give a JSON file or --jobs-json, not both")
    if opts.threads is not None and opts.threads < 1:
        p.error(f"--threads: must be at least 1, not {opts.threads}")
    entries = json.loads(opts.jobs_json) if opts.jobs_json is not None else json.loads(
        Path(opts.jobs).read_text())
    try:
        jobs = [Job.from_dict({**e["job"], "threads": opts.threads or e["job"].get("threads")})
                for e in entries]
    except JobError as e:
        p.error(str(e))
    entries = [{"job": job.to_dict(), "out": e["out"]} for job, e in zip(jobs, entries)]
    return supervise(entries, jobs)


def supervise(entries: list[dict], jobs: list[Job]) -> int:
    pending = list(range(len(jobs)))
    while pending:
        cuda = jobs[pending[0]].device.startswith("cuda")
        # a CUDA job alone in its worker; CPU jobs together
        chunk = pending[:1] if cuda else [i for i in pending if not jobs[i].device.startswith("cuda")]
        finished, current, ending = _watch(entries, jobs, chunk)
        for i in current:
            if not os.path.exists(entries[i]["out"]):
                status, message, wall = ending
                records.write_atomic(entries[i]["out"], records.failure(jobs[i], status, message, wall))
                print(f"membench many: {jobs[i].method}: status {status} ({message}) -> "
                      f"{entries[i]['out']}", file=sys.stderr, flush=True)
        if not finished and not current:  # the worker died before it started a job
            status, message, wall = ending
            for i in chunk:
                records.write_atomic(entries[i]["out"], records.failure(
                    jobs[i], "error", f"the worker ended before any job: {message}", wall))
            finished = set(chunk)
        pending = [i for i in pending if i not in finished and i not in current]
    return 0


def _watch(entries, jobs, chunk: list[int]) -> tuple[set, list, tuple]:
    """Run `chunk` in a worker until it exits or a job overruns; the jobs it finished, the
    ones it had started and not finished, and how it ended (status, message, seconds)."""
    forks = workers.context(PRELOAD)
    reader, writer = forks.Pipe(duplex=False)
    oom_kills = _oom_kills()
    worker = forks.Process(target=_work, args=([entries[i] for i in chunk], writer), name="membench-many-worker")
    try:
        worker.start()
    except Exception as e:  # noqa: BLE001 - no worker (the fork server cannot start): the chunk's rows say why
        reader.close()
        writer.close()
        return set(), [], ("error", f"it could not start ({type(e).__name__}: {e})", 0.0)
    writer.close()  # the worker holds the other copy: its exit ends the pipe
    read_end = reader.fileno()
    finished: set[int] = set()
    current: list[int] = []
    started = time.monotonic()
    timed_out, buffer = None, b""
    try:
        while True:
            wait = None
            if current:
                limit = sum(jobs[i].time_limit() for i in current)
                wait = max(0.0, started + limit + grace(limit) - time.monotonic())
            if not select.select([read_end], [], [], wait)[0]:
                timed_out = limit
                worker.kill()
                break
            data = os.read(read_end, 65536)
            if not data:
                break
            buffer += data
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                event = json.loads(line)
                if "start" in event:
                    current, started = [chunk[k] for k in event["start"]], time.monotonic()
                else:
                    finished |= {chunk[k] for k in event["done"]}
                    current = []
    finally:
        reader.close()
        if worker.exitcode is None and timed_out is None:
            worker.kill()  # this process is being stopped: take the worker with it
        worker.join()
        code = worker.exitcode
    wall = time.monotonic() - started
    if timed_out is not None:
        ending = ("timeout", f"time limit of {timed_out:g} s reached; the job did not return "
                             f"to Python, so it was killed {grace(timed_out):g} s later", wall)
    elif code < 0:
        name = signal.Signals(-code).name
        if _oom_kills() > oom_kills:
            ending = ("oom", f"killed: {name} by the kernel's OOM killer (out of host memory)", wall)
        else:
            likely = ", likely out of host memory" if -code == signal.SIGKILL else ""
            ending = ("killed", f"killed: {name}{likely}", wall)
    else:
        ending = ("error", f"the job's process exited with code {code} (its log says why)", wall)
    return finished, current, ending


def _work(entries: list[dict], writer) -> None:
    """A worker (a fork of the fork server): run `entries`, saying on `writer` which job
    starts and which finished."""
    from bench.run import work

    progress_fd = os.dup(writer.fileno())  # work() owns its copy
    writer.close()
    sys.exit(work(entries, progress_fd))


def _oom_kills() -> int:
    """The OOM kills this process's memory cgroup has counted (cgroup v2's memory.events or
    v1's memory.oom_control), or 0 where neither can be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":
            counters = Path("/sys/fs/cgroup") / group.lstrip("/") / "memory.events"
        elif "memory" in controllers.split(","):
            counters = Path("/sys/fs/cgroup/memory") / group.lstrip("/") / "memory.oom_control"
        else:
            continue
        try:
            for entry in counters.read_text().splitlines():
                key, _, value = entry.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return 0

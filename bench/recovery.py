"""Recovery when a run starts: the lock of a run that died, and result files that cannot
be read. The Snakefile calls these while it is parsed, which is before Snakemake builds
its DAG and before it checks its lock (Snakemake 9: `.snakemake/locks/N.input.lock` and
`N.output.lock`, the files the run reads and writes, one per line; a run that ends,
whether it succeeds or fails, removes them, but a run killed with SIGKILL, or whose machine
stops, leaves them, and the next run stops on "Directory cannot be locked").

The lock of a run that died (`clear_stale_lock`)
-----------------------------------------------
Every Snakemake process that parses this workflow (the main process only: not a job
that a cluster executor runs) leaves a record in `.snakemake/membench-runs/`: its pid, the
pid's start time (/proc/PID/stat), the machine's boot id, host name and pid namespace, its
command line.
It removes the record when it exits (`atexit`), so a record outlives its process only when
the process was killed. A process always parses before it takes the lock, so whichever
process holds a lock has a record while it lives.

When lock files exist at parse time they are removed only if all of these hold:

- at least one record exists (no record: the lock was taken by something that does not
  write records, such as another Snakefile in the same folder; it is left to Snakemake's
  message, and this module prints the exact `--unlock` command);
- every recorded process is dead: on this host, and either the machine rebooted since
  (another boot id), or no process has the pid, or the pid's start time differs (the pid
  was reused), or it is a zombie. A record from another host or pid namespace (another
  container) cannot be checked and counts as alive;
- no job of the dead run still runs here: no process whose working folder is this one runs
  `bench many` (killing Snakemake alone leaves its jobs running and writing results);
- no job of the dead run was given to a cluster (an incomplete marker in
  `.snakemake/incomplete/` with an external job id): it may still be queued or running
  there. The lock stays and the message names the job ids and the `--unlock` command.

Only the lock files seen before the records were read are removed, so a lock taken in
between by a new run (which wrote its record first) is never touched. The records of dead
processes are removed with them. What Snakemake then does is its own: the outputs of the
jobs that were running are marked incomplete, and `rerun-incomplete: true`
(profiles/default) runs those jobs again; every result already written is whole
(bench.measure.records writes atomically) and kept.

Result files that cannot be read (`set_aside_unreadable`)
---------------------------------------------------------
A planned result that is not whole JSON, or not a result of this version of membench
(`schema_version`), is moved to `results/unreadable/<its path under results/>` (never
deleted, never overwritten: a second one gets a `.1` suffix), with a line on stderr, so
Snakemake sees it missing and runs its group again. `read_result` is the same check for
readers (bench.report.aggregate leaves such a file out and names it).
"""
from __future__ import annotations

import atexit
import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path

from bench.measure.records import SCHEMA_VERSION

STATE = Path(".snakemake")
LOCKS = STATE / "locks"
RECORDS = STATE / "membench-runs"
INCOMPLETE = STATE / "incomplete"
UNREADABLE = Path("results/unreadable")


def say(text: str) -> None:
    print(f"membench: {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- result files


class UnreadableResult(ValueError):
    """A result file that cannot be read as a result of this version; `why` says why."""

    def __init__(self, path, why: str):
        super().__init__(f"{path}: {why}")
        self.path, self.why = str(path), why


def read_result(path: str | Path) -> dict:
    """The result record in `path`; UnreadableResult naming why when it is not whole JSON,
    not a JSON object, or not a result of this schema version."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except json.JSONDecodeError as e:
        raise UnreadableResult(path, f"not whole JSON, truncated or not a result: {e.msg} at "
                                     f"line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError:
        raise UnreadableResult(path, "not UTF-8 text: not a result") from None
    except OSError as e:
        raise UnreadableResult(path, f"cannot be opened: {e.strerror or e}") from None
    if not isinstance(record, dict):
        raise UnreadableResult(path, f"a JSON {type(record).__name__}, not a result")
    version = record.get("schema_version")
    if version is None:
        raise UnreadableResult(path, "no schema_version: not a membench result")
    if version != SCHEMA_VERSION:
        raise UnreadableResult(path, f"schema_version {version!r}, this version of membench "
                                     f"reads {SCHEMA_VERSION}")
    if not isinstance(record.get("job"), dict) or "status" not in record:
        raise UnreadableResult(path, "no job or no status: not a whole result")
    return record


def problem(path: str | Path) -> str | None:
    """Why the result file cannot be read, or None when it can."""
    try:
        read_result(path)
    except UnreadableResult as e:
        return e.why
    return None


def aside_path(path: str | Path, dest: Path = UNREADABLE) -> Path:
    """Where an unreadable `path` goes: dest/<path under results/> (dest/<path> for a path
    elsewhere), with .1, .2, ... added when that is taken."""
    path = Path(path)
    parts = path.parts[1:] if path.parts[:1] == ("results",) else path.parts
    target = dest.joinpath(*(p for p in parts if p not in ("/", "..")))
    n, free = 0, target
    while free.exists():
        n += 1
        free = target.with_name(f"{target.name}.{n}")
    return free


def set_aside_unreadable(paths, workflow=None, dest: Path = UNREADABLE) -> list[tuple[str, str, str]]:
    """Move every existing file of `paths` (the planned results) that `read_result` refuses
    to `aside_path` and say so on stderr; Snakemake then sees it missing and runs its job
    again. Returns (path, where it went, why) for each. Nothing in a process that is not
    Snakemake's main one (`workflow`: a cluster job parses the Snakefile too)."""
    if not main_process(workflow):
        return []
    moved = []
    for path in paths:
        if not os.path.isfile(path):
            continue
        why = problem(path)
        if why is None:
            continue
        target = aside_path(path, dest)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        say(f"{path} cannot be read ({why}); moved to {target}, and its job runs again")
        moved.append((str(path), str(target), why))
    return moved


# ---------------------------------------------------------------- the lock


def main_process(workflow) -> bool:
    """Snakemake's main process (not a cluster job's or a subprocess's parse)."""
    return workflow is None or bool(getattr(workflow, "is_main_process", True))


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def process_start(pid: int) -> tuple[int, str] | None:
    """(start time in clock ticks after boot, state letter) of `pid` from /proc, or None
    when no such process (or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": comm may hold spaces
    return int(fields[19]), fields[0]  # field 22 (starttime), field 3 (state)


def pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def this_process() -> dict:
    pid = os.getpid()
    start = process_start(pid)
    return {"pid": pid, "start_ticks": start[0] if start else None, "boot_id": boot_id(),
            "host": socket.gethostname(), "pid_ns": pid_namespace(), "argv": sys.argv,
            "cwd": os.getcwd(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def alive(record: dict) -> bool:
    """Whether the recorded process may still run: False only when it is known dead."""
    if record.get("host") != socket.gethostname() or record.get("pid_ns") != pid_namespace():
        return True  # another machine's (or container's) process cannot be checked from here
    if record.get("boot_id") and boot_id() and record["boot_id"] != boot_id():
        return False  # the machine rebooted since
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True
    if Path("/proc/self/stat").exists():
        start = process_start(pid)
        if start is None:
            return False
        ticks, state = start
        if record.get("start_ticks") is not None and ticks != record["start_ticks"]:
            return False  # the pid now belongs to another process
        return state not in ("Z", "X")  # a zombie holds nothing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_records(folder: Path = RECORDS) -> dict[Path, dict]:
    out = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            out[path] = json.loads(path.read_text())
        except (OSError, ValueError):
            out[path] = {}  # half-written by a process killed while writing it: no pid
    return out


def write_record(folder: Path = RECORDS) -> Path:
    """Record this process (atomically) and remove the record when it exits."""
    me = this_process()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{me['host']}-{me['pid']}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(me))
    os.replace(tmp, path)

    def remove(pid=me["pid"]):
        if os.getpid() == pid:  # not in a forked child
            try:
                path.unlink()
            except OSError:
                pass

    atexit.register(remove)
    return path


def running_jobs(workdir: str | Path = ".") -> list[tuple[int, str]]:
    """(pid, its command up to `many`) of each process, other than this one, whose working
    folder is `workdir` and which runs `bench many` (a workflow job: `python -m bench many`,
    `membench many`)."""
    workdir = os.path.realpath(workdir)
    out = []
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        if pid == os.getpid():
            continue
        try:
            if os.path.realpath(entry / "cwd") != workdir:
                continue
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "many" in argv and any(Path(a).name in ("bench", "membench") for a in argv):
            out.append((pid, " ".join(argv[: argv.index("many") + 1])))
    return out


def cluster_jobs(folder: Path = INCOMPLETE) -> list[str]:
    """The external (cluster) job ids that Snakemake marked in its incomplete markers."""
    ids = set()
    for path in folder.rglob("*") if folder.is_dir() else []:
        try:
            job = json.loads(path.read_text()).get("external_jobid")
        except (OSError, ValueError, AttributeError):
            continue
        if job:
            ids.add(str(job))
    return sorted(ids)


def command(argv: list[str] | None = None) -> list[str]:
    """The command line as typed (`python -m snakemake` leaves its __main__.py in argv[0])."""
    argv = list(sys.argv if argv is None else argv) or ["snakemake"]
    prog = [sys.executable, "-m", "snakemake"] if Path(argv[0]).name == "__main__.py" else argv[:1]
    return prog + argv[1:]


def unlock_command(argv: list[str] | None = None) -> str:
    """This command with --unlock added (and a dry run's -n left out)."""
    line = [a for a in command(argv) if a not in ("-n", "--dry-run", "--dryrun")]
    return shlex.join([*line, "--unlock"])


def describe(record: dict) -> str:
    argv = record.get("argv") or []
    line = shlex.join(command(argv))[:120] if argv else "?"
    return f"pid {record.get('pid')} on {record.get('host')}, started {record.get('date')}: {line}"


def clear_stale_lock(workflow=None) -> str:
    """Remove the lock of a run that died (see the module's docstring for when); print
    what it did or why not on stderr. Returns "none" (no lock), "cleared", "running" (a
    recorded process lives), "jobs" (a job of the dead run still runs here), "cluster"
    (cluster jobs may still run) or "unknown" (no record says who took the lock)."""
    if not main_process(workflow) or "--unlock" in sys.argv:
        return "none"
    locks = sorted(LOCKS.glob("*.lock")) if LOCKS.is_dir() else []
    if not locks:
        for path, record in read_records().items():  # records of runs that ended badly
            if not alive(record):
                path.unlink(missing_ok=True)
        return "none"
    me = this_process()
    records = {p: r for p, r in read_records().items()
               if [r.get(k) for k in ("host", "pid", "start_ticks")]
               != [me[k] for k in ("host", "pid", "start_ticks")]}
    if not records:
        say(f"{LOCKS}/ holds a lock and no record says which run took it (a run from before "
            f"this check, or another Snakefile in this folder). If no other Snakemake runs "
            f"here, remove it with\n    {unlock_command()}\nthen run your command again.")
        return "unknown"
    living = [r for r in records.values() if alive(r)]
    if living:
        say(f"another run of this workflow may be running ({describe(living[0])}); its lock "
            f"stays. Wait for it to end, or stop it (kill {living[0].get('pid')}), then run "
            f"your command again.")
        return "running"
    jobs = running_jobs()
    if jobs:
        pids = " ".join(str(pid) for pid, _ in jobs)
        say(f"the run that took the lock has died, but its jobs still run here (pid {pids}: "
            f"{jobs[0][1]}); the lock stays until they end. Wait for them, or stop them "
            f"(kill {pids}), then run your command again.")
        return "jobs"
    queued = cluster_jobs()
    if queued:
        say(f"the run that took the lock has died; it had given jobs to a cluster, which may "
            f"still run ({', '.join(queued[:10])}). Check them (squeue -j "
            f"{','.join(queued[:10])}), cancel them if you like, then remove the lock with\n"
            f"    {unlock_command()}\nand run your command again.")
        return "cluster"
    for lock in locks:  # only those seen before the records were read
        lock.unlink(missing_ok=True)
    for path in records:
        path.unlink(missing_ok=True)
    dead = next(iter(records.values()))
    say(f"removed the lock left by a run that died ({describe(dead)}); the jobs it left "
        f"unfinished run again.")
    return "cleared"


def at_parse(workflow=None) -> str:
    """What the Snakefile calls as it is parsed: clear a stale lock, then record this
    process (Snakemake's main process only)."""
    if not main_process(workflow):
        return "none"
    what = clear_stale_lock(workflow)
    write_record()
    return what

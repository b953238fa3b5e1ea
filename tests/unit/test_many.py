"""`membench many` leaves a row for every job however it ends: past its time limit (ended
from inside, or killed from outside when it does not return to Python), killed by a
signal, killed by the kernel's OOM killer in a memory cgroup; the group's other jobs go
on. The faulty methods are written into a copy of methods/ for these tests only."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

FAULTY = {
    # the third step hangs in Python: the job's own time limit ends it, with two steps kept
    "sleeper": '''
    steps = 0

    def train_step(self, model, optimizer, batch):
        self.steps += 1
        while self.steps >= 3:
            time.sleep(1)
        return super().train_step(model, optimizer, batch)
''',
    # The three faults below end their worker process, so each runs in a fresh worker (the
    # supervisor starts one for the jobs left): they strike as the job builds its method
    # (`bench.method.load`, inside the job: after the worker has announced it, within its
    # time limit), before the model is built, so such a worker never pays the import of
    # transformers (about 7 of its 10 CPU-seconds on 2 cores). What `membench many` sees
    # is the same as in a training step: a started job that never ends, or a worker that
    # dies by a signal.
    # a hang no Python handler reaches (as inside C code): killed from outside
    "stuck": '''
    def __init__(self):
        super().__init__()
        signal.signal(signal.SIGALRM, signal.SIG_IGN)
        while True:
            time.sleep(1)
''',
    # killed from outside, as the OOM killer or a user's kill -9 would
    "selfkill": '''
    def __init__(self):
        super().__init__()
        os.kill(os.getpid(), signal.SIGKILL)
''',
    # allocates host memory until the kernel kills it
    "hog": '''
    def __init__(self):
        super().__init__()
        held = []
        while True:
            held.append(torch.ones(2**26))
''',
}


@pytest.fixture(scope="module")
def methods_copy(tmp_path_factory):
    root = tmp_path_factory.mktemp("faulty")
    shutil.copytree(REPO / "methods", root / "methods", ignore=shutil.ignore_patterns("__pycache__"))
    for name, body in FAULTY.items():
        (root / "methods" / f"{name}.py").write_text(
            f'"""Test method: {name}."""\nimport os\nimport signal\nimport time\n\nimport torch\n\n'
            f"from bench.method import Method\n\n\nclass Faulty(Method):\n"
            f'    paper = "none (a fault test)"\n{body}\n\nMETHOD = Faulty\n')
    return root


def many(root: Path, jobs: list[dict], out: Path, cgroup: Path | None = None):
    base = {"kind": "convergence", "model": "gpt2-tiny", "batch_size": 2, "seq_len": 16,
            "steps": 4, "log_every": 0}
    entries = [{"job": {**base, **job}, "out": str(out / f"{i}.json")} for i, job in enumerate(jobs)]
    join = (lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid()))) if cgroup else None
    done = subprocess.run([sys.executable, "-m", "bench", "many", "--jobs-json", json.dumps(entries),
                           "--threads", "1"], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)}, preexec_fn=join)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((out / f"{i}.json").read_text()) for i in range(len(jobs))], done.stderr


def test_hung_killed_and_oom_killed_jobs_become_rows_and_the_others_go_on(methods_copy, tmp_path):
    # inside a 1.5 GiB memory cgroup where this machine allows one: then a job that exhausts
    # host memory is ended by the kernel's OOM killer, as on a machine without the cap
    group = _memory_cgroup(1536 * 2**20)
    faults = [{"method": "sleeper", "time_limit_s": 3}, {"method": "stuck", "time_limit_s": 1},
              {"method": "selfkill"}] + ([{"method": "hog"}] if group else [])
    try:
        rows, log = many(methods_copy, [{"method": "adamw"}, *faults, {"method": "adamw", "seed": 1}],
                         tmp_path, group)
    finally:
        if group:
            group.rmdir()
    statuses = ["ok", "timeout", "timeout", "killed"] + (["oom"] if group else []) + ["ok"]
    assert [r["status"] for r in rows] == statuses, log
    hung = rows[1]
    assert hung["message"] == "time limit of 3 s reached"
    assert [c["step"] for c in hung["curve"]] == [1, 2]  # what it had done is kept
    assert "did not return to Python" in rows[2]["message"]
    assert rows[3]["message"].startswith("killed: SIGKILL")
    for r in rows[2:-1]:  # written by the watching process: the job, its status, provenance
        assert r["job"]["method"] in ("stuck", "selfkill", "hog") and r["provenance"]["commit"]
    # the jobs before and after the faults ran whole; a fresh process after each fault
    assert len(rows[0]["curve"]) == len(rows[-1]["curve"]) == 4
    assert log.count("membench many: job 1/") == len(faults) + 1
    if group is None:
        pytest.skip("the OOM-killer case was not run: no memory cgroup can be made here (needs "
                    "root and cgroup v1's memory controller); the other faults passed")
    assert rows[4]["message"] == "killed: SIGKILL by the kernel's OOM killer (out of host memory)"


def _memory_cgroup(limit: int) -> Path | None:
    """A fresh cgroup-v1 memory group of `limit` bytes (no swap), or None where this
    machine does not allow one."""
    base = Path("/sys/fs/cgroup/memory")
    group = base / f"membench-test-{os.getpid()}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
        swap = group / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(limit))
    except OSError:
        if group.exists():
            group.rmdir()
        return None
    return group


def test_workers_start_where_tmpdir_is_too_long_for_a_socket(tmp_path):
    """The fork server (bench.workers: `membench many`'s and `membench fit`'s workers, a
    real sharded run's ranks) listens on a Unix socket under TMPDIR; under a TMPDIR as long
    as a cluster's per-job scratch folder can be, its path is too long to bind, and
    workers must still start."""
    long = tmp_path / ("d" * 110)
    long.mkdir()
    code = ("from bench import workers\n"
            "worker = workers.context(['json']).Process(target=print, args=('started',))\n"
            "worker.start(); worker.join(); raise SystemExit(worker.exitcode)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "TMPDIR": str(long)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "started" in done.stdout, done.stderr[-2000:]


def test_a_worker_that_cannot_start_leaves_every_jobs_row(tmp_path, monkeypatch):
    """Where no worker can start (the fork server cannot), each job of the group gets an
    `error` row saying why, and `membench many` returns."""
    import multiprocessing

    from bench import many as group
    from bench.job import Job

    class NoWorker:
        Pipe = staticmethod(multiprocessing.Pipe)

        class Process:
            def __init__(self, **_):
                pass

            def start(self):
                raise OSError("AF_UNIX path too long")

    monkeypatch.setattr(group.workers, "context", lambda preload: NoWorker)
    jobs = [Job(kind="memory", method=m, model="gpt2-tiny", batch_size=2, seq_len=16) for m in ("adamw", "lomo")]
    entries = [{"job": job.to_dict(), "out": str(tmp_path / f"{i}.json")} for i, job in enumerate(jobs)]
    assert group.supervise(entries, jobs) == 0
    rows = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2)]
    assert [(r["status"], r["job"]["method"]) for r in rows] == [("error", "adamw"), ("error", "lomo")]
    assert all(r["message"] == "the worker ended before any job: it could not start (OSError: AF_UNIX path too long)"
               for r in rows)

"""bench.recovery: which result files cannot be read and where they are set aside; when
the lock of a run that died is removed, and every case where it is left alone."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from bench import recovery
from bench.measure.records import SCHEMA_VERSION
from conftest import REPO

RESULT = {"schema_version": SCHEMA_VERSION, "job": {"kind": "memory", "method": "adamw"},
          "status": "ok", "memory": {"peak_bytes": 123}}
GOOD = json.dumps(RESULT, indent=1)
BAD = {
    "truncated": (GOOD[: len(GOOD) // 2], "not whole JSON"),
    "empty": ("", "not whole JSON"),
    "binary": (b"\x89PNG\r\n\x1a\n\xff\xfe", "not UTF-8"),
    "list": ("[1, 2]", "a JSON list, not a result"),
    "foreign": (json.dumps({"hello": "world"}), "no schema_version: not a membench result"),
    "older": (json.dumps({**RESULT, "schema_version": 0}), "schema_version 0, this version"),
    "no_job": (json.dumps({"schema_version": SCHEMA_VERSION, "status": "ok"}), "no job or no status"),
}


def write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


@pytest.mark.parametrize("name", BAD)
def test_what_cannot_be_read_says_why(tmp_path, name):
    content, why = BAD[name]
    path = write(tmp_path / f"{name}.json", content)
    assert why in recovery.problem(path)
    with pytest.raises(recovery.UnreadableResult, match=why.split(":")[0]):
        recovery.read_result(path)


def test_a_whole_result_reads_and_a_missing_one_says_so(tmp_path):
    assert recovery.read_result(write(tmp_path / "ok.json", GOOD)) == RESULT
    assert recovery.problem(tmp_path / "ok.json") is None
    assert "cannot be opened" in recovery.problem(tmp_path / "absent.json")


def test_unreadable_planned_results_are_moved_aside_never_deleted(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    base = "results/runs/smoke/memory/gpt2-tiny"
    paths = {name: f"{base}/{name}/cell.json" for name in ["ok", *BAD]}
    for name, path in paths.items():
        write(tmp_path / path, GOOD if name == "ok" else BAD[name][0])
    planned = [*paths.values(), f"{base}/not_written_yet/cell.json"]

    moved = recovery.set_aside_unreadable(planned)
    assert sorted(src for src, _, _ in moved) == sorted(p for n, p in paths.items() if n != "ok")
    err = capsys.readouterr().err
    for name, path in paths.items():
        aside = tmp_path / "results/unreadable" / path.removeprefix("results/")
        if name == "ok":
            assert (tmp_path / path).read_text() == GOOD and not aside.exists()
            continue
        assert not (tmp_path / path).exists()  # missing, so Snakemake runs its group again
        content = BAD[name][0]
        assert (aside.read_bytes() if isinstance(content, bytes) else aside.read_text()) == content
        [line] = [x for x in err.splitlines() if path in x]
        assert line.startswith("membench: ") and str(aside.relative_to(tmp_path)) in line
        assert BAD[name][1].split(":")[0] in line and "runs again" in line

    # a second unreadable file at the same path keeps the first one set aside
    write(tmp_path / paths["foreign"], "{")
    [(_, target, _)] = recovery.set_aside_unreadable(planned)
    assert target.endswith("cell.json.1")
    assert (tmp_path / target).read_text() == "{"
    assert json.loads((tmp_path / target[:-2]).read_text()) == {"hello": "world"}
    assert recovery.set_aside_unreadable(planned) == []  # what remains reads


def test_nothing_is_moved_or_cleared_outside_snakemakes_main_process(tmp_path, monkeypatch):
    """A cluster job parses the Snakefile too; it leaves results and locks alone."""
    monkeypatch.chdir(tmp_path)
    job = type("Workflow", (), {"is_main_process": False})()
    write(tmp_path / "results/runs/a.json", "{")
    write(tmp_path / ".snakemake/locks/0.input.lock", "x\n")
    assert recovery.set_aside_unreadable(["results/runs/a.json"], job) == []
    assert recovery.at_parse(job) == "none"
    assert (tmp_path / "results/runs/a.json").exists()
    assert (tmp_path / ".snakemake/locks/0.input.lock").exists()
    assert not (tmp_path / ".snakemake/membench-runs").exists()


# ---------------------------------------------------------------- the lock


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["/venv/bin/snakemake", "--cores", "all", "-n"])
    return tmp_path


def locked(root):
    write(root / ".snakemake/locks/0.input.lock", "results/summary.csv\n")
    write(root / ".snakemake/locks/0.output.lock", "results/runs/x.json\n")


def lock_files(root):
    return sorted(p.name for p in (root / ".snakemake/locks").glob("*"))


def record_of(pid, **kw):
    start = recovery.process_start(pid)
    record = {"pid": pid, "start_ticks": start[0] if start else None, "boot_id": recovery.boot_id(),
              "pid_ns": recovery.pid_namespace(),
              "host": socket.gethostname(), "argv": ["snakemake", "--cores", "all"],
              "cwd": os.getcwd(), "date": "2026-01-01 00:00:00", **kw}
    write(recovery.RECORDS / f"{record['host']}-{pid}.json", json.dumps(record))
    return record


@pytest.fixture
def dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    start = recovery.process_start(child.pid)
    child.wait()
    return child.pid, start[0]


@pytest.fixture
def sleeper():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield child
    child.kill()
    child.wait()


def test_the_lock_of_a_dead_run_is_removed(workdir, dead_pid, capsys):
    pid, ticks = dead_pid
    locked(workdir)
    record_of(pid, start_ticks=ticks)
    assert recovery.clear_stale_lock() == "cleared"
    assert lock_files(workdir) == [] and list(recovery.RECORDS.glob("*")) == []
    err = capsys.readouterr().err
    assert f"removed the lock left by a run that died (pid {pid}" in err


def test_a_reused_pid_a_zombie_and_a_reboot_count_as_dead(workdir, sleeper):
    for kw in ({"start_ticks": recovery.process_start(sleeper.pid)[0] - 1},  # another process
               {"boot_id": "another-boot"}):
        locked(workdir)
        record_of(sleeper.pid, **kw)
        assert recovery.clear_stale_lock() == "cleared", kw
    sleeper.kill()  # not waited for: a zombie
    time.sleep(0.2)
    assert recovery.process_start(sleeper.pid)[1] == "Z"
    locked(workdir)
    record_of(sleeper.pid)
    assert recovery.clear_stale_lock() == "cleared"


def test_the_lock_of_a_live_run_stays(workdir, sleeper, dead_pid, capsys):
    locked(workdir)
    record_of(dead_pid[0], start_ticks=dead_pid[1])
    record_of(sleeper.pid)  # alive, beside a dead one: it may hold the lock
    assert recovery.clear_stale_lock() == "running"
    assert lock_files(workdir) == ["0.input.lock", "0.output.lock"]
    err = capsys.readouterr().err
    assert f"pid {sleeper.pid}" in err and f"kill {sleeper.pid}" in err


@pytest.mark.parametrize("elsewhere", [{"host": "another-host"}, {"pid_ns": "pid:[1]"}])
def test_a_run_on_another_host_or_container_counts_as_alive(workdir, dead_pid, elsewhere):
    locked(workdir)
    record_of(dead_pid[0], start_ticks=dead_pid[1], **elsewhere)
    assert recovery.clear_stale_lock() == "running"
    assert lock_files(workdir) == ["0.input.lock", "0.output.lock"]


def test_without_a_record_the_lock_stays_and_the_exact_command_is_named(workdir, capsys):
    locked(workdir)
    assert recovery.clear_stale_lock() == "unknown"
    assert lock_files(workdir) == ["0.input.lock", "0.output.lock"]
    assert "    /venv/bin/snakemake --cores all --unlock\n" in capsys.readouterr().err


def test_a_job_of_the_dead_run_still_running_keeps_the_lock(workdir, dead_pid, capsys):
    """`kill -9` of Snakemake alone leaves its jobs running and writing results."""
    locked(workdir)
    record_of(dead_pid[0], start_ticks=dead_pid[1])
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "bench", "many"],
                           cwd=workdir)
    try:
        time.sleep(0.2)
        assert recovery.clear_stale_lock() == "jobs"
        assert f"kill {job.pid}" in capsys.readouterr().err
        assert lock_files(workdir) == ["0.input.lock", "0.output.lock"]
    finally:
        job.kill()
        job.wait()
    assert recovery.clear_stale_lock() == "cleared"


def test_jobs_given_to_a_cluster_keep_the_lock(workdir, dead_pid, capsys):
    locked(workdir)
    record_of(dead_pid[0], start_ticks=dead_pid[1])
    write(recovery.INCOMPLETE / "cmVzdWx0cw==", json.dumps({"external_jobid": "4242"}))
    write(recovery.INCOMPLETE / "b3RoZXI=", json.dumps({"external_jobid": None}))
    assert recovery.clear_stale_lock() == "cluster"
    err = capsys.readouterr().err
    assert "squeue -j 4242" in err and "/venv/bin/snakemake --cores all --unlock" in err
    assert lock_files(workdir) == ["0.input.lock", "0.output.lock"]


def test_without_a_lock_only_records_of_dead_runs_are_removed(workdir, dead_pid, sleeper):
    record_of(dead_pid[0], start_ticks=dead_pid[1])
    live = record_of(sleeper.pid)
    assert recovery.clear_stale_lock() == "none"
    assert [p.name for p in recovery.RECORDS.glob("*")] == [f"{live['host']}-{sleeper.pid}.json"]


def test_a_process_records_itself_and_removes_its_record_as_it_exits(tmp_path):
    """A record outlives its process only when the process is killed."""
    code = ("import sys, time; sys.path.insert(0, %r); from bench import recovery; "
            "recovery.at_parse(); print(flush=True); time.sleep(float(sys.argv[1]))" % str(REPO))
    ended = subprocess.run([sys.executable, "-c", code, "0"], cwd=tmp_path, timeout=60)
    assert ended.returncode == 0 and list((tmp_path / ".snakemake/membench-runs").glob("*")) == []
    killed = subprocess.Popen([sys.executable, "-c", code, "60"], cwd=tmp_path,
                              stdout=subprocess.PIPE)
    killed.stdout.readline()  # recorded
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    [left] = (tmp_path / ".snakemake/membench-runs").glob("*.json")
    record = json.loads(left.read_text())
    assert record["pid"] == killed.pid and not recovery.alive(record)


def test_the_unlock_command_is_the_command_typed(monkeypatch):
    assert recovery.unlock_command([".venv/bin/snakemake", "--cores", "all", "-n"]) == \
        ".venv/bin/snakemake --cores all --unlock"
    main = "/x/site-packages/snakemake/__main__.py"
    assert recovery.unlock_command([main, "--config", "suite=smoke"]) == \
        f"{sys.executable} -m snakemake --config suite=smoke --unlock"

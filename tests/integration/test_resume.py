"""A run killed with SIGKILL finishes when the same command is run again: the dead run's
lock is removed (bench.recovery), the jobs it left unfinished run again
(`rerun-incomplete`, profiles/default), and every result equals an uninterrupted run's.
Result files that cannot be read are left out of the tables, or set aside and rerun."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pandas as pd
import pytest

from bench.report.figures import FIGURES
from conftest import snakemake

SMOKE = ("--cores", "2", "--config", "suite=smoke")
PLANNED = 18  # the smoke suite's results: 2 methods x (memory, throughput, 2 learning rates on a
#               tuning seed, 2 convergence seeds at the chosen one, capacity, model_capacity), a
#               pre-training run and one fine-tuning job


def results(root) -> dict:
    """Each result under results/runs/smoke, without what differs between two runs of the
    same job: wall times and timings (a convergence curve's wall_s, a throughput job's
    tokens/s), and provenance (date, host, commit)."""
    out = {}
    for path in sorted((root / "results" / "runs" / "smoke").rglob("*.json")):
        record = json.loads(path.read_text())
        record = {k: v for k, v in record.items() if k not in ("provenance", "wall_time_s", "throughput")}
        if "curve" in record:
            record["curve"] = [{k: v for k, v in p.items() if k != "wall_s"} for p in record["curve"]]
        out[str(path.relative_to(root))] = record
    return out


# The groups whose results are deleted from a copy of the uninterrupted run before the run
# that is killed (7 of the 18 results: memory, the tuned convergence seeds reading the grid's
# results, the fine-tuning reading the pre-training's weights). The rest of the DAG is the
# smoke run's, so the killed run and the one that finishes it do part of a smoke run between
# them, not a whole one (about 85 CPU-seconds less on 2 cores): the lock, the incomplete jobs
# and their rerun are the same as after a kill of a run that started from nothing.
REDO = ("/memory/", "-tuned.json", "-finetune.json")
REDONE = 7


@pytest.mark.slow
@pytest.mark.xdist_group("smoke_run")
def test_a_killed_run_finishes_with_the_same_command(tmp_path, smoke_run):
    uninterrupted, first = smoke_run  # an uninterrupted run of the same command
    assert first.returncode == 0, first.stderr[-3000:]
    workflow_copy = tmp_path / "workflow"
    shutil.copytree(uninterrupted, workflow_copy, symlinks=True)
    runs = workflow_copy / "results" / "runs"
    state = workflow_copy / ".snakemake"
    assert not list((state / "locks").glob("*.lock")) and not list((state / "incomplete").glob("*"))
    redo = [p for p in runs.rglob("*.json") if any(k in str(p) for k in REDO)]
    assert len(redo) == REDONE, sorted(map(str, redo))
    for path in redo:
        path.unlink()
    # and what is made from the results: the command has to make all of it again
    reports = [workflow_copy / "results" / name for name in ("summary.csv", "curves.csv", "figures", "paper")]
    reports.append(workflow_copy / "paper" / "results.md")
    for path in reports:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()

    # the same command, killed (all of its process group: Snakemake and its jobs, as a
    # closed terminal or an out-of-memory killer would) once one of those results is written
    # again and the next groups are running (their outputs marked incomplete)
    run = subprocess.Popen([sys.executable, "-m", "snakemake", *SMOKE], cwd=workflow_copy,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    deadline = time.monotonic() + 300
    while run.poll() is None and time.monotonic() < deadline and not (
            any(p.exists() for p in redo) and any((state / "incomplete").glob("*"))):
        time.sleep(0.05)
    assert run.poll() is None, f"the run ended (exit {run.returncode}) before it could be killed"
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    before = {p: p.read_bytes() for p in runs.rglob("*.json")}
    assert PLANNED - len(redo) < len(before) < PLANNED, len(before)
    assert list((state / "locks").glob("*.lock")), "the killed run left no lock"
    assert list((state / "incomplete").glob("*")), "the killed run left no incomplete job"

    # files a reader cannot use, beside the suite's: left out of the tables, named in the log
    foreign = runs / "elsewhere" / "memory" / "gpt2-tiny" / "adamw"
    foreign.mkdir(parents=True)
    (foreign / "truncated.json").write_text('{"schema_version": 1, "job": {"kind": "mem')
    (foreign / "notes.json").write_text(json.dumps({"title": "my notes"}))

    again = snakemake(workflow_copy, *SMOKE)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "membench: removed the lock left by a run that died" in again.stderr
    assert not list((state / "locks").glob("*.lock"))
    resumed = results(workflow_copy)
    assert len(resumed) == PLANNED and all(r["status"] == "ok" for r in resumed.values())
    # what the killed run had finished is kept as it was; the rest was run again: exactly
    # what an uninterrupted run of those jobs gives
    kept = {str(p.relative_to(workflow_copy)) for p, data in before.items()
            if p.exists() and p.read_bytes() == data}
    rerun = sorted(set(resumed) - kept)
    assert rerun and all(not path.startswith("results/runs/elsewhere") for path in kept)
    expected = results(uninterrupted)
    for path in rerun:
        assert resumed[path] == expected[path], path  # status, memory, capacity, losses, cost
    assert resumed == expected  # and what the killed run wrote

    log = (workflow_copy / "results" / "logs" / "aggregate.log").read_text()
    for name in ("truncated", "notes"):
        assert f"aggregate: left out results/runs/elsewhere/memory/gpt2-tiny/adamw/{name}.json" in log
    summary = pd.read_csv(workflow_copy / "results" / "summary.csv")
    assert sorted(set(summary.result_file)) == sorted(resumed)  # the foreign files left out
    for name in FIGURES:
        assert (workflow_copy / "results" / "figures" / f"{name}.png").stat().st_size > 1000
    assert (workflow_copy / "paper" / "results.md").exists()
    assert (workflow_copy / "results" / "paper" / "article.html").exists()


def test_a_planned_result_that_cannot_be_read_is_set_aside_and_run_again(workflow_copy):
    planned = "results/runs/smoke/memory/gpt2-tiny/adamw/markov-bs4-seq32-seed0.json"
    (workflow_copy / planned).parent.mkdir(parents=True)
    (workflow_copy / planned).write_text('{"schema_version": 1, "job": {"ki')  # truncated
    out = snakemake(workflow_copy, "-n", *SMOKE)
    assert out.returncode == 0, out.stderr[-3000:]
    aside = workflow_copy / "results" / "unreadable" / planned.removeprefix("results/")
    assert aside.read_text() == '{"schema_version": 1, "job": {"ki'  # kept, not deleted
    assert not (workflow_copy / planned).exists()
    assert f"membench: {planned} cannot be read (not whole JSON" in out.stderr
    assert planned in out.stdout  # its group is planned again

"""A run killed with SIGKILL finishes when the same command is run again: the dead run's
lock is removed (bench.recovery), the jobs it left unfinished run again
(`rerun-incomplete`, profiles/default), what it finished is kept, and a result run again is
what a run of its job gives. Result files that cannot be read are left out of the tables,
or set aside and rerun."""
import json

import pandas as pd
import pytest

from bench.job import Job
from bench.measure import runner
from bench.report.figures import FIGURES
from conftest import KILLED_GROUP, SMOKE, snakemake

PLANNED = 18  # the smoke suite's results: 2 methods x (memory, throughput, 2 learning rates on a
#               tuning seed, 2 convergence seeds at the chosen one, capacity, model_capacity), a
#               pre-training run and one fine-tuning job


@pytest.mark.slow
@pytest.mark.xdist_group("smoke_run")
def test_a_killed_run_finishes_with_the_same_command(smoke_run):
    """The smoke run (conftest.smoke_run) was killed while its memory group ran, then run
    again with the same command."""
    root, again, killed = smoke_run
    runs, state = root / "results" / "runs", root / ".snakemake"
    assert killed["running"], "the run ended before it could be killed"
    assert killed["locks"], "the killed run left no lock"
    assert killed["incomplete"], "the killed run left no incomplete job"
    assert 0 < len(killed["results"]) < PLANNED
    assert any(KILLED_GROUP in str(p) for p in killed["results"])  # the group was halfway

    assert again.returncode == 0, again.stderr[-3000:]
    assert "membench: removed the lock left by a run that died" in again.stderr
    assert not list((state / "locks").glob("*.lock")) and not list((state / "incomplete").glob("*"))
    finished = {p: json.loads(p.read_text()) for p in (runs / "smoke").rglob("*.json")}
    assert len(finished) == PLANNED and all(r["status"] == "ok" for r in finished.values())
    # what the killed run had finished is kept as it was; what its jobs in flight had written
    # (their outputs marked incomplete) was written again, by their groups run whole
    in_flight = killed["incomplete"]
    assert any(KILLED_GROUP in path for path in in_flight), in_flight
    for path, data in killed["results"].items():
        rerun = str(path.relative_to(root)) in in_flight
        assert (path.read_bytes() != data) == rerun, (path, rerun)
    assert all((root / path).exists() for path in in_flight)
    # each result of the memory group is what a run of its job gives (bytes, split by category, cost)
    group = [r for p, r in finished.items() if KILLED_GROUP in str(p)]
    assert len(group) == 2 and all(str(p.relative_to(root)) in in_flight for p in finished if KILLED_GROUP in str(p))
    for record in group:
        alone = runner.run(Job(**record["job"]))
        assert alone["status"] == "ok" and alone["memory"] == record["memory"], record["job"]["method"]
        assert alone["cost"] == record["cost"]

    # the files beside the suite's that a reader cannot use: left out of the tables, named in the log
    log = (root / "results" / "logs" / "aggregate.log").read_text()
    for name in ("truncated", "notes"):
        assert f"aggregate: left out results/runs/elsewhere/memory/gpt2-tiny/adamw/{name}.json" in log
    summary = pd.read_csv(root / "results" / "summary.csv")
    assert sorted(set(summary.result_file)) == sorted(str(p.relative_to(root)) for p in finished)
    for name in FIGURES:
        assert (root / "results" / "figures" / f"{name}.png").stat().st_size > 1000
    assert (root / "paper" / "results.md").exists()
    assert (root / "results" / "paper" / "article.html").exists()


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

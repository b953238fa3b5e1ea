"""The DAG end to end on the smoke suite: results, tables, figures, paper, resumption."""
import json
import shutil

import pandas as pd
import pytest

from bench import suite as plan
from bench.report.aggregate import SUMMARY_COLUMNS
from bench.report.figures import FIGURES
from conftest import SMOKE, job_counts, snakemake


@pytest.mark.xdist_group("smoke_run")  # one worker makes the shared smoke run, and reads it
def test_smoke_suite_end_to_end(smoke_run):
    workflow_copy, out, _ = smoke_run  # the run, killed once and finished by the same command (test_resume.py)
    assert out.returncode == 0, out.stderr[-3000:]
    results = workflow_copy / "results"

    summary = pd.read_csv(results / "summary.csv")
    assert list(summary.columns) == SUMMARY_COLUMNS
    # methods x (memory + throughput + 2 learning rates of a tuning grid + 2 seeds at the rate
    # chosen + 2 memory sizes of capacity + 1 of model capacity), then a pre-training run and
    # adamw fine-tuning from it
    assert len(summary) == 2 * (1 + 1 + 2 + 2 + 2 + 1) + 2
    assert sorted(summary.phase) == ["finetune", "pretrain"] + ["scratch"] * 18
    conv = summary[(summary.kind == "convergence") & (summary.phase == "scratch")]
    assert sorted(conv.tuning) == ["grid"] * 4 + ["tuned"] * 4
    for method, runs in conv.groupby("method"):  # the tuned seeds ran at the grid's best rate
        grid, tuned = runs[runs.tuning == "grid"], runs[runs.tuning == "tuned"]
        assert set(tuned.lr) == {grid.loc[grid.final_loss.idxmin(), "lr"]}, method
    assert (summary.status == "ok").all(), summary[["result_file", "message"]]
    assert set(summary.kind) == {"memory", "throughput", "convergence", "capacity", "model_capacity"}
    assert summary.loc[summary.kind == "capacity", "largest_batch"].gt(0).all()
    assert summary.loc[summary.kind == "model_capacity", "n_params"].gt(0).all()
    assert summary.loc[summary.kind == "memory", "peak_bytes"].gt(0).all()
    assert summary.loc[summary.kind == "throughput", "tokens_per_s"].gt(0).all()
    assert summary.loc[summary.kind == "throughput", "throughput_ratio"].gt(0).all()

    curves = pd.read_csv(results / "curves.csv")
    assert len(curves) == 2 * 4 * 8 + 4 + 4  # methods x (grid + seeds) x steps; pre-training, fine-tuning
    pretrained = next((results / "runs" / "smoke" / "convergence").rglob("*-pretrain.pt"))
    assert set(summary.loc[summary.phase == "finetune", "init"]) == {str(pretrained.relative_to(workflow_copy))}

    for name in FIGURES:
        for ext in ("png", "pdf"):
            assert (results / "figures" / f"{name}.{ext}").stat().st_size > 1000
    assert (workflow_copy / "paper" / "results.md").stat().st_size > 500

    record = json.loads(next((results / "runs" / "smoke").rglob("*.json")).read_text())
    assert record["job"]["seed"] in (0, 1) and record["provenance"]["torch_version"]

    # a result the suite no longer plans (its list was shortened) is left alone
    orphan = next((results / "runs" / "smoke" / "memory").rglob("*.json"))
    (orphan.parent.parent / "dropped_method").mkdir()
    (orphan.parent.parent / "dropped_method" / orphan.name).write_text(orphan.read_text())
    again = snakemake(workflow_copy, "-n", *SMOKE)
    shutil.rmtree(orphan.parent.parent / "dropped_method")  # the run is shared (smoke_run)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "Nothing to be done" in again.stdout + again.stderr

    # another suite plans its own jobs and reads the smoke results as they are
    other = snakemake(workflow_copy, "-n", "--cores", "2", "--config", "suite=paper-memory")
    assert other.returncode == 0, other.stderr[-2000:]
    planned = plan.plan({**plan.load(workflow_copy / "config" / "config.yaml"), "suite": "paper-memory"})
    runs = lambda counts: sum(n for rule, n in counts.items() if rule.startswith("run_"))  # noqa: E731
    assert runs(job_counts(other.stdout)) == len(plan.groups(planned, "paper-memory"))

    # a deleted pre-training result runs the pre-training again, and the fine-tuning after it;
    # a deleted result reruns its group (the jobs that share its process), nothing else. Both
    # deleted for one dry run: the groups it plans are named, each deletion's own
    pretraining = pretrained.with_suffix(".json")
    victim = next((results / "runs" / "smoke" / "convergence").rglob("*seed1-tuned.json"))
    kept = {path: path.read_bytes() for path in (pretraining, victim)}
    for path in kept:
        path.unlink()
    rerun = snakemake(workflow_copy, "-n", *SMOKE)
    for path, data in kept.items():
        path.write_bytes(data)  # the run is shared (smoke_run): leave it whole
    groups = plan.groups(plan.plan({**plan.load(workflow_copy / "config" / "config.yaml"), "suite": "smoke"}),
                         "smoke")
    group_of = {p: gid for gid, paths in groups.items() for p in paths}
    finetune = [gid for gid, paths in groups.items() if any("-finetune" in p for p in paths)]
    expected = {plan.rule_name(group_of[str(p.relative_to(workflow_copy))]) for p in kept} | set(
        map(plan.rule_name, finetune))
    counts = job_counts(rerun.stdout)
    assert {rule: n for rule, n in counts.items() if rule.startswith("run_")} == dict.fromkeys(expected, 1)
    assert len(expected) == 3 and "finetune" in rerun.stdout
    assert str(victim.relative_to(workflow_copy)) in rerun.stdout

"""The tuning protocol (bench/tuning.py): its grid, its choice, steps to a target loss, and how
the planner, the runner and the tables use them."""
import copy
import json
import math

import numpy as np
import pandas as pd
import pytest
import yaml

from bench import suite, tuning
from bench.measure import runner
from bench.report import tables
from conftest import REPO

CONFIG = yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def test_grid_is_log_spaced_around_the_default():
    assert tuning.grid(1e-3, 3, 3.16) == [0.000316, 0.001, 0.00316]
    assert tuning.grid(0.01, 1, 2) == [0.01]
    five = tuning.grid(2e-4, 5, 10)
    assert five == pytest.approx([2e-6, 2e-5, 2e-4, 2e-3, 2e-2])
    even = tuning.grid(1e-3, 2, 4)  # the centre between the middle two
    assert even == pytest.approx([5e-4, 2e-3]) and math.isclose(math.sqrt(even[0] * even[1]), 1e-3)
    with pytest.raises(ValueError):
        tuning.grid(1e-3, 3, 1.0)


def run(lr, seed, loss, status="ok"):
    return {"lr": lr, "seed": seed, "status": status, "final_loss": loss}


def test_choose_takes_the_lowest_mean_over_the_tuning_seeds():
    runs = [run(1e-3, 10, 2.0), run(1e-3, 11, 2.2), run(3e-3, 10, 1.9), run(3e-3, 11, 2.5),
            run(1e-2, 10, 1.0, "diverged"), run(1e-2, 11, 0.5)]
    out = tuning.choose(runs)
    # 1e-3: 2.1, 3e-3: 2.2, 1e-2 has a failed run: out, however low its other run's loss
    assert out["lr"] == 1e-3
    assert [e["lr"] for e in out["grid"]] == [1e-3, 3e-3, 1e-2]
    assert out["grid"][0]["final_loss_mean"] == pytest.approx(2.1)
    assert out["grid"][2]["final_loss_mean"] is None and out["grid"][2]["statuses"] == ["diverged", "ok"]


def test_every_rate_failed_is_reported_not_dropped():
    out = tuning.choose([run(1e-3, 10, None, "diverged"), run(1e-2, 10, float("nan"), "ok")])
    assert out["lr"] is None and len(out["grid"]) == 2


def test_steps_to_target_on_a_synthetic_curve():
    # loss = 1 + 4 exp(-k/50): the running mean of 10 steps crosses 1.5 a few steps after
    # the curve itself does (k = 50 ln 8 = 104)
    losses = [1 + 4 * math.exp(-k / 50) for k in range(1, 301)]
    crossing = next(i + 1 for i in range(len(losses)) if np.mean(losses[max(0, i - 9):i + 1]) <= 1.5)
    assert tuning.steps_to_target(losses, 1.5) == crossing
    assert 104 < crossing < 104 + 10
    assert tuning.steps_to_target(losses, 0.9) is None  # never
    assert tuning.steps_to_target([3.0, 0.5, 3.0], 1.0, window=1) == 2
    assert tuning.steps_to_target([3.0, float("nan"), 0.1], 1.0, window=1) is None


def tuned_config(**section):
    config = copy.deepcopy(CONFIG)
    quick = config["suites"]["quick"]
    quick["convergence"].update(methods=["adamw", "galore"], tuning={"points": 3, "factor": 3.16, "seeds": [100]},
                                seeds=[0, 1], **section)
    return config


def test_the_baseline_is_tuned_by_the_same_code_path_as_every_method():
    jobs = suite.check(tuned_config())[1]
    conv = {p: j for p, j in jobs.items() if j.kind == "convergence" and not j.init and not j.save_weights}
    for method, default in (("adamw", 1e-3), ("galore", 0.01)):
        grid = sorted(j.lr for j in conv.values() if j.method == method and j.lr is not None)
        assert grid == tuning.grid(default, 3, 3.16)  # each around its own default
        assert all(j.seed == 100 for j in conv.values() if j.method == method and j.lr is not None)
        tuned = [j for j in conv.values() if j.method == method and j.tuned_from]
        assert sorted(j.seed for j in tuned) == [0, 1] and all(j.lr is None for j in tuned)
        assert set(tuned[0].tuned_from) == {p for p, j in conv.items() if j.method == method and j.lr}
        assert all(p.endswith("-tuned.json") for p, j in conv.items() if j.tuned_from)


@pytest.mark.parametrize("change, says", [
    (lambda c: c["suites"]["quick"]["convergence"]["tuning"].update(seeds=[1]),
     "suites/quick/convergence/tuning/seeds: a learning rate is chosen on seeds other than the reported"),
    (lambda c: c["suites"]["quick"]["convergence"].update(methods=["adamw@lr=0.01"]),
     "suites/quick/convergence: adamw@lr=0.01 fixes its learning rate"),
    (lambda c: c["suites"]["quick"]["convergence"]["tuning"].update(factor=1),
     "suites/quick/convergence/tuning/factor"),
])
def test_bad_tuning_names_the_key(change, says):
    config = tuned_config()
    change(config)
    with pytest.raises(suite.ConfigError) as err:
        suite.check(config)
    assert says in str(err.value)


def test_a_tuned_job_runs_at_the_rate_its_grid_chose(tiny_job, tmp_path):
    files = []
    for lr, loss, status in ((1e-3, 3.0, "ok"), (3e-3, 2.5, "ok"), (1e-2, None, "diverged")):
        path = tmp_path / f"lr{lr}.json"
        path.write_text(json.dumps({"job": tiny_job(kind="convergence", lr=lr, seed=100).to_dict(),
                                    "status": status, "final_loss": loss}))
        files.append(str(path))
    record = runner.run(tiny_job(kind="convergence", steps=2, log_every=0, tuned_from=files))
    assert record["status"] == "ok", record["message"]
    assert record["hparams"]["lr"] == 3e-3 and record["tuning"]["lr"] == 3e-3
    assert record["tuning"]["files"] == files and record["tuning"]["rule"] == tuning.RULE
    fixed = runner.run(tiny_job(kind="convergence", steps=1, log_every=0, lr=2e-3))
    assert fixed["hparams"]["lr"] == 2e-3


def test_a_tuned_job_whose_grid_all_failed_is_a_diverged_row(tiny_job, tmp_path):
    path = tmp_path / "lr.json"
    path.write_text(json.dumps({"job": tiny_job(kind="convergence", lr=0.1, seed=100).to_dict(),
                                "status": "diverged", "final_loss": None}))
    record = runner.run(tiny_job(kind="convergence", steps=2, tuned_from=[str(path)]))
    assert record["status"] == "diverged" and "every learning rate of the tuning grid failed" in record["message"]
    assert record["tuning"]["lr"] is None
    missing = runner.run(tiny_job(kind="convergence", steps=2, tuned_from=[str(tmp_path / "none.json")]))
    assert missing["status"] == "error" and "none.json: no such file" in missing["message"]


def summary_rows():
    """Two methods, tuned on seed 100 over two rates, reported on seeds 0-2."""
    rows = []
    base = dict(kind="convergence", model="gpt2-tiny", task="markov", phase="scratch", status="ok",
                loss_floor=1.2, target_loss=1.3)
    for method, best, losses in (("adamw", 3e-3, [1.50, 1.52, 1.49]), ("adama", 1e-3, [1.60, 1.61, 1.60])):
        for lr, loss in ((1e-3, 1.7 if method == "adamw" else 1.62), (3e-3, 1.55 if method == "adamw" else 1.9)):
            rows.append({**base, "method": method, "seed": 100, "lr": lr, "tuning": "grid", "final_loss": loss})
        for seed, loss in enumerate(losses):
            rows.append({**base, "method": method, "seed": seed, "lr": best, "tuning": "tuned", "final_loss": loss,
                         "steps_to_target": None if seed == 2 else 50 + seed})
    return tables._tidy(pd.DataFrame(rows), tables.SUMMARY_COLUMNS)


def test_tables_report_the_tuned_runs_and_show_the_grid_beside():
    summary = summary_rows()
    conv = tables.convergence_table(summary)
    assert list(conv["tuning"]) == ["tuned", "tuned"] and conv["n_jobs"].tolist() == [3, 3]  # no grid run
    adama = conv[conv["method"] == "adama"].iloc[0]
    diffs = np.array([0.10, 0.09, 0.11])
    half = 4.303 * diffs.std(ddof=1) / np.sqrt(3)
    assert adama["gap_vs_baseline"] == pytest.approx(diffs.mean())
    assert (adama["gap_lo"], adama["gap_hi"]) == pytest.approx((diffs.mean() - half, diffs.mean() + half))
    assert adama["lr"] == 1e-3 and adama["n_reached"] == 2 and adama["steps_to_target"] == pytest.approx(50.5)
    grid = tables.tuning_table(summary)
    assert len(grid) == 4
    chosen = grid[grid["chosen"]].set_index("method")["lr"].to_dict()
    assert chosen == {"adamw": 3e-3, "adama": 1e-3}

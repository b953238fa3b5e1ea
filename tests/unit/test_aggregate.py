"""Aggregation leaves out a result file it cannot read, names it, and makes the tables
(and so the figures) from the rest."""
import json

import pandas as pd
import pytest

from bench.measure.records import SCHEMA_VERSION
from bench.report import aggregate

JOB = {"kind": "convergence", "method": "adamw", "model": "gpt2-tiny", "batch_size": 4,
       "seq_len": 32, "dtype": "float32", "device": "cpu", "task": "markov", "steps": 2,
       "seed": 0}


def result(method: str) -> dict:
    return {"schema_version": SCHEMA_VERSION, "job": {**JOB, "method": method}, "status": "ok",
            "message": None, "n_params": 1000, "final_loss": 4.5, "loss_floor": 1.2,
            "curve": [{"step": 1, "wall_s": 0.1, "loss": 5.0}, {"step": 2, "wall_s": 0.2, "loss": 4.5}],
            "provenance": {"commit": "abc"}, "wall_time_s": 0.3}


@pytest.fixture
def files(tmp_path):
    good = {m: tmp_path / f"runs/{m}.json" for m in ("adamw", "grad_accum")}
    text = json.dumps(result("adamw"), indent=1)
    bad = {
        "truncated": (text[: len(text) // 2], "not whole JSON"),
        "foreign": (json.dumps({"title": "my notes"}), "no schema_version"),
        "older": (json.dumps({**result("lomo"), "schema_version": 0}), "schema_version 0"),
        "missing_field": (json.dumps({**result("came"), "job": {"kind": "memory"}}),
                          "not a whole result (KeyError"),
    }
    for method, path in good.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result(method)))
    paths = {}
    for name, (content, _) in bad.items():
        paths[name] = tmp_path / f"runs/{name}.json"
        paths[name].write_text(content)
    return good, paths, {name: why for name, (_, why) in bad.items()}


def test_unreadable_files_are_left_out_and_named(files, capsys):
    good, bad, why = files
    left_out = []
    summary, curves = aggregate.aggregate([*good.values(), *bad.values()], left_out)
    assert sorted(summary.method) == ["adamw", "grad_accum"]
    assert len(curves) == 4 and set(curves.method) == {"adamw", "grad_accum"}
    assert sorted(p for p, _ in left_out) == sorted(map(str, bad.values()))
    err = capsys.readouterr().err.splitlines()
    for name, path in bad.items():
        [line] = [x for x in err if str(path) in x]
        assert line.startswith(f"aggregate: left out {path}: ") and why[name] in line


def test_the_command_writes_the_tables_from_the_rest(files, tmp_path, capsys):
    good, bad, _ = files
    out = [str(tmp_path / "summary.csv"), str(tmp_path / "curves.csv")]
    assert aggregate.main(["--summary", out[0], "--curves", out[1],
                           *map(str, [*good.values(), *bad.values()])]) == 0
    summary = pd.read_csv(out[0])
    assert list(summary.columns) == aggregate.SUMMARY_COLUMNS and len(summary) == 2
    assert len(pd.read_csv(out[1])) == 4
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.endswith(f"; {len(bad)} unreadable files left out (named above)")

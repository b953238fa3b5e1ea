"""The runner: result records, failure statuses, the command line."""
import json
import subprocess
import sys

import pytest
import torch

from bench import data
from bench.measure import runner
from bench.method import Method
from conftest import REPO

PROVENANCE_KEYS = {"commit", "torch_version", "transformers_version", "python_version",
                   "hostname", "date", "device_name"}


def test_memory_record_is_complete_and_adds_up(tiny_job):
    record = runner.run(tiny_job())
    assert record["status"] == "ok", record.get("message")
    assert record["schema_version"] == 1
    assert PROVENANCE_KEYS <= set(record["provenance"])
    mem = record["memory"]
    parts = ("param", "grad", "optimizer", "activation", "other")
    assert sum(mem[f"{c}_bytes"] for c in parts) == mem["peak_bytes"]
    assert mem["param_bytes"] == 4 * record["n_params"]
    # AdamW state: two float32 moments per parameter plus one float32 step per tensor
    n_tensors = sum(1 for _ in torch.nn.Module.parameters(_tiny_model()))
    assert mem["optimizer_bytes"] == 2 * mem["param_bytes"] + 4 * n_tensors
    assert mem["tier"] == "tracked"
    json.dumps(record, allow_nan=False)


def test_cpu_id_tells_hosts_of_one_model_name_apart():
    from bench.measure import records

    info = {"model name": "AMD EPYC", "cpu family": "26", "model": "2", "stepping": "1",
            "cpu MHz": "2596.100"}
    assert records.cpu_id(info) == "cpu family 26, model 2, stepping 1, 2596 MHz"
    assert records.cpu_id({"model name": "AMD EPYC"}) is None  # nothing to tell them apart by
    if records.cpu_fields():  # a Linux host: the record carries it
        assert records.device_info("cpu")["cpu_id"] == records.cpu_id(records.cpu_fields())


def _tiny_model():
    from bench import models
    return models.build("gpt2-tiny")


def test_throughput_and_convergence_records(tiny_job):
    thr = runner.run(tiny_job(kind="throughput", method="grad_accum", steps=4, rounds=2,
                              warmup_steps=1))
    assert thr["status"] == "ok", thr.get("message")
    t = thr["throughput"]
    assert t["baseline"] == "adamw" and thr["n_params"] > 0
    assert len(t["round_step_times_s"]) == len(t["baseline_round_step_times_s"]) == 2
    a, b = t["round_step_times_s"], t["baseline_round_step_times_s"]
    assert t["round_ratios"] == [tb / ta for ta, tb in zip(a, b)]
    assert t["step_time_median_s"] == pytest.approx(sum(a) / 2)  # even count
    assert t["tokens_per_s"] == pytest.approx(4 * 32 / t["step_time_median_s"])
    assert t["baseline_tokens_per_s"] == pytest.approx(4 * 32 / (sum(b) / 2))
    assert t["throughput_ratio_lo"] <= t["throughput_ratio"] <= t["throughput_ratio_hi"]
    # the job's between-runs spread is the one its interval adds (docs/speed.md)
    from bench.measure import timing
    assert t["between_runs_sd"] == 0.045
    for b_sd in (0.0, 0.2):
        expected = timing.segment_interval(t["round_ratios"], t["round_segments"], between_runs=b_sd)
        assert timing.summary(timing.Side("m", None, times=a, base_times=b, segments=t["round_segments"]),
                              timing.Side("adamw", None), 4 * 32, between_runs=b_sd)["throughput_ratio_hi"] \
            == expected[2]
    quiet = runner.run(tiny_job(kind="throughput", method="grad_accum", steps=4, rounds=2, warmup_steps=1,
                                between_runs_sd=0.0))
    assert quiet["throughput"]["between_runs_sd"] == 0.0

    conv = runner.run(tiny_job(kind="convergence", steps=5))
    assert conv["status"] == "ok", conv.get("message")
    assert [p["step"] for p in conv["curve"]] == [1, 2, 3, 4, 5]
    assert conv["loss_floor"] == pytest.approx(data.MarkovTask().loss_floor)


def test_same_seed_same_curve_other_seed_other_curve(tiny_job):
    a = runner.run(tiny_job(kind="convergence", steps=3, seed=1))
    b = runner.run(tiny_job(kind="convergence", steps=3, seed=1))
    c = runner.run(tiny_job(kind="convergence", steps=3, seed=2))
    loss = lambda r: [p["loss"] for p in r["curve"]]
    assert loss(a) == loss(b)
    assert loss(a) != loss(c)


class Raises(Method):
    paper = "test"

    def train_step(self, model, optimizer, batch):
        raise RuntimeError("deliberate failure")


class GoesNaN(Method):
    paper = "test"

    def train_step(self, model, optimizer, batch):
        super().train_step(model, optimizer, batch)
        return torch.tensor(float("nan"))


@pytest.mark.parametrize("kind", ["memory", "throughput", "convergence"])
def test_failures_are_results(tiny_job, kind):
    err = runner.run(tiny_job(kind=kind, steps=2), method=Raises())
    assert err["status"] == "error" and "deliberate failure" in err["message"]
    assert "traceback" in err and "provenance" in err

    nan = runner.run(tiny_job(kind=kind, steps=2), method=GoesNaN())
    assert nan["status"] == "diverged" and "nan" in nan["message"]


def test_capacity_gives_oom(tiny_job):
    record = runner.run(tiny_job(capacity_gb=1e-3))  # ~1 MiB: the parameters alone need ~2 MiB
    assert record["status"] == "oom"
    assert "capacity" in record["message"]


def test_bad_job_is_an_error_record(tiny_job):
    record = runner.run(tiny_job(batch_size=6, method="grad_accum"))
    assert record["status"] == "error" and "not divisible" in record["message"]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "bench", "run", *args], cwd=REPO,
                          capture_output=True, text=True)


def rejected(capsys, *args) -> str:
    """`membench run`'s main in this process (no second start-up of torch; the command's
    own process: test_cli_help_explains, test_cli_writes_one_result...) on arguments it
    must reject: asserts exit status 2, returns its stderr."""
    from bench.run import main

    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_cli_help_explains():
    out = run_cli("--help")
    assert out.returncode == 0
    for word in ("--kind", "memory", "throughput", "convergence", "grad_accum", "--capacity-gb"):
        assert word in out.stdout


def test_cli_writes_one_result_and_rejects_unknown_names(tmp_path, capsys):
    out = tmp_path / "r.json"
    args = ["--kind", "memory", "--model", "gpt2-tiny", "--batch-size", "2", "--seq-len", "16"]
    ok = run_cli(*args, "--method", "adamw", "--out", str(out))
    assert ok.returncode == 0, ok.stderr
    assert json.loads(out.read_text())["status"] == "ok"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left

    bad = rejected(capsys, *args, "--method", "adamx", "--out", str(tmp_path / "bad.json"))
    assert "available:" in bad and "adamw" in bad
    assert not (tmp_path / "bad.json").exists()


@pytest.mark.parametrize("change, says", [
    (["--batch-size", "-1"], "job field batch_size: -1 is less than the minimum of 1"),
    (["--hparam", "lr=fast"], "option 'lr' takes a float"),
    (["--method", "adama+galore"], "adama and galore both provide"),
])
def test_cli_rejects_bad_arguments_before_any_work(tmp_path, capsys, change, says):
    args = {"--kind": "memory", "--model": "gpt2-tiny", "--batch-size": "2", "--seq-len": "16",
            "--method": "adamw", "--out": str(tmp_path / "r.json")}
    extra = []
    for key, value in zip(change[::2], change[1::2]):
        if key in args:
            args[key] = value
        else:
            extra += [key, value]
    err = rejected(capsys, *[x for kv in args.items() for x in kv], *extra)
    assert says in err, err
    assert not (tmp_path / "r.json").exists()


def test_a_pretraining_run_saves_its_weights_and_a_finetuning_job_starts_from_them(tiny_job, tmp_path):
    from bench import models
    from bench.measure import records, step
    from bench.method import lm_loss
    from bench.run import run_one

    pre = tiny_job(kind="convergence", steps=3, save_weights=True, log_every=0)
    out = tmp_path / "pre.json"
    run_one(pre, str(out))
    weights = records.weights_path(out)
    assert records.read(out)["status"] == "ok"
    saved = torch.load(weights, weights_only=True)
    # what the fine-tuning job's first step sees: the saved weights, the job's own batch
    model = models.build(pre.model, pre.attn_implementation, dropout=0.0)
    model.load_state_dict(saved)
    _, stream = step.setup(tiny_job(kind="convergence", task="markov_shift", seed=5), load_method("adamw"))
    with torch.no_grad():
        expected = float(lm_loss(model, stream.next()))
    record = runner.run(tiny_job(kind="convergence", steps=1, task="markov_shift", seed=5, init=weights,
                                 dropout=0.0, log_every=0))
    assert record["status"] == "ok", record["message"]
    assert record["curve"][0]["loss"] == pytest.approx(expected, rel=1e-6)
    scratch = runner.run(tiny_job(kind="convergence", steps=1, task="markov_shift", seed=5, dropout=0.0,
                                  log_every=0))
    assert abs(scratch["curve"][0]["loss"] - expected) > 0.1  # the weights made the difference
    assert "weights" not in records.read(out)


def test_a_missing_or_foreign_checkpoint_is_an_error_row(tiny_job, tmp_path):
    record = runner.run(tiny_job(kind="convergence", steps=1, init=str(tmp_path / "none.pt")))
    assert record["status"] == "error" and "none.pt: no such file" in record["message"]
    torch.save({"w": torch.zeros(2)}, tmp_path / "other.pt")
    record = runner.run(tiny_job(kind="convergence", steps=1, init=str(tmp_path / "other.pt")))
    assert record["status"] == "error" and "another model's weights" in record["message"]


def load_method(name):
    from bench.method import load

    return load(name)

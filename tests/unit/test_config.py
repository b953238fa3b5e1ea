"""Config validation: bad input is rejected before any job, naming the key."""
import copy

import pytest
import yaml

from bench import suite as plan
from bench.suite import ConfigError
from conftest import REPO, job_counts, snakemake

CONFIG = yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def checked(config):
    plan.validate_schema(config)
    return plan.plan(config)


def test_default_config_plans_every_method_module():
    jobs = checked(copy.deepcopy(CONFIG))
    methods = {path.split("/")[5] for path in jobs}
    assert set(plan.available_methods()) <= methods
    assert any("+" in m for m in methods)  # a stack is part of the default sweep
    kinds = {path.split("/")[3] for path in jobs}
    assert kinds == {"memory", "throughput", "convergence", "capacity", "model_capacity"}


@pytest.mark.parametrize("profile", ["quick", "full", "paper-memory", "gpu-capacity", "tempo", "roam",
                                     "galore-ranks", "microadam", "smoke"])
def test_every_profile_plans(profile):
    config = copy.deepcopy(CONFIG)
    config["profile"] = profile
    assert checked(config)


def mutate(fn):
    config = copy.deepcopy(CONFIG)
    fn(config)
    return config


BAD = {
    "unknown method": (lambda c: c["profiles"]["quick"].update(methods=["adamx"]),
                       "profiles/quick/methods: unknown method 'adamx'; available: all, adama, "),
    "unknown method in a stack": (lambda c: c["profiles"]["quick"].update(methods=["adamw+nope"]),
                                  "profiles/quick/methods: unknown method 'nope'"),
    "unknown model": (lambda c: c["profiles"]["quick"]["memory"].update(models=["gpt5"]),
                      "profiles/quick/memory/models: unknown model 'gpt5'; known: gpt2-tiny"),
    "shape of a width no head divides": (
        lambda c: c["profiles"]["quick"]["memory"].update(models=["llama-d100-l2"]),
        "profiles/quick/memory/models: unknown model 'llama-d100-l2'"),
    "model capacity without its batch": (
        lambda c: c["profiles"]["quick"]["model_capacity"].pop("batch_sizes"),
        "profiles/quick/model_capacity: 'batch_sizes' is a required property"),
    "unknown profile": (lambda c: c.update(profile="huge"),
                        "profile: unknown profile 'huge'; defined: quick"),
    "wrong type": (lambda c: c["profiles"]["quick"]["memory"].update(batch_sizes="8"),
                   "profiles/quick/memory/batch_sizes"),
    "unknown key": (lambda c: c["profiles"]["quick"]["memory"].update(batchsize=[8]),
                    "profiles/quick/memory"),
    "bad device": (lambda c: c["profiles"]["quick"].update(device="tpu"),
                   "profiles/quick/device"),
    "sequence too long": (lambda c: c["profiles"]["quick"]["memory"].update(seq_len=4096),
                          "profiles/quick/memory/seq_len: 4096 exceeds gpt2-tiny's 512 positions"),
    "unknown task": (lambda c: c["profiles"]["quick"]["convergence"].update(tasks=["c4"]),
                     "profiles/quick/convergence/tasks/0"),
    "unknown hyperparameter": (lambda c: c.update(method_params={"grad_accum": {"microbatches": 8}}),
                               "method_params/grad_accum: grad_accum has no option 'microbatches'"),
    "unknown hyperparameter in a variant": (
        lambda c: c["profiles"]["quick"].update(methods=["galore@rnk=8"]),
        "profiles/quick/methods/galore@rnk=8: galore@rnk=8 has no option 'rnk'"),
    "unknown hyperparameter in a profile": (
        lambda c: c["profiles"]["quick"].update(method_params={"adama": {"vnorm": "mean"}}),
        "profiles/quick/method_params/adama: adama has no option 'vnorm'"),
}


def test_profile_method_params_override_the_top_level():
    config = mutate(lambda c: (c.update(method_params={"grad_accum": {"micro_batches": 2, "lr": 0.1}}),
                               c["profiles"]["quick"].update(method_params={"grad_accum": {"micro_batches": 8}})))
    jobs = checked(config)
    args = next(a for p, a in jobs.items() if "/memory/gpt2-tiny/checkpointing+grad_accum/" in p)
    hparams = [args[i + 1] for i, a in enumerate(args) if a == "--hparam"]
    assert hparams == ["micro_batches=8", "lr=0.1"]


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_names_the_key(case):
    change, expected = BAD[case]
    with pytest.raises(ConfigError) as err:
        checked(mutate(change))
    assert expected in str(err.value)


def test_dry_run_lists_jobs(workflow_copy):
    out = snakemake(workflow_copy, "-n", "--cores", "2")
    assert out.returncode == 0, out.stderr
    assert job_counts(out.stdout)["run_job"] == len(checked(copy.deepcopy(CONFIG)))


def test_a_new_method_module_joins_the_dag(workflow_copy):
    (workflow_copy / "methods" / "my_new_method.py").write_text(
        '"""A new method."""\nfrom bench.method import Method\n\n'
        'class Mine(Method):\n    paper = "me"\n\nMETHOD = Mine\n')
    out = snakemake(workflow_copy, "-n", "--cores", "2")
    assert out.returncode == 0, out.stderr
    assert "results/runs/quick/memory/gpt2-tiny/my_new_method/" in out.stdout


def test_snakemake_rejects_a_bad_config_before_any_job(workflow_copy):
    out = snakemake(workflow_copy, "--cores", "2", "--config", "profile=huge")
    assert out.returncode != 0
    assert "unknown profile 'huge'" in out.stdout + out.stderr
    assert not (workflow_copy / "results").exists()

"""Config validation: bad input is rejected before any job, naming the key."""
import copy
import re
import importlib

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


@pytest.mark.parametrize("suite", ["quick", "full", "gpu", "gpu-twins", "paper-memory", "gpu-capacity", "tempo",
                                   "roam", "optimizers", "optimizers-memory", "optimizers-paper",
                                   "optimizers-7b", "lomo", "activations", "fewbit", "galore-ranks",
                                   "microadam", "smoke"])
def test_every_suite_plans(suite):
    config = copy.deepcopy(CONFIG)
    config["suite"] = suite
    assert checked(config)


def mutate(fn):
    config = copy.deepcopy(CONFIG)
    fn(config)
    return config


BAD = {
    "unknown method": (lambda c: c["suites"]["quick"].update(methods=["adamx"]),
                       "suites/quick/methods: unknown method 'adamx'; available: all, ours, adafactor, "),
    "unknown method in a stack": (lambda c: c["suites"]["quick"].update(methods=["adamw+nope"]),
                                  "suites/quick/methods: unknown method 'nope'"),
    "unknown model": (lambda c: c["suites"]["quick"]["memory"].update(models=["gpt5"]),
                      "suites/quick/memory/models: unknown model 'gpt5'; known: gpt2-tiny"),
    "shape of a width no head divides": (
        lambda c: c["suites"]["quick"]["memory"].update(models=["llama-d100-l2"]),
        "suites/quick/memory/models: unknown model 'llama-d100-l2'"),
    "model capacity without its batch": (
        lambda c: c["suites"]["quick"]["model_capacity"].pop("batch_sizes"),
        "suites/quick/model_capacity: 'batch_sizes' is a required property"),
    "unknown suite": (lambda c: c.update(suite="huge"),
                        "suite: unknown suite 'huge'; defined: quick"),
    "wrong type": (lambda c: c["suites"]["quick"]["memory"].update(batch_sizes="8"),
                   "suites/quick/memory/batch_sizes"),
    "unknown key": (lambda c: c["suites"]["quick"]["memory"].update(batchsize=[8]),
                    "suites/quick/memory"),
    "bad device": (lambda c: c["suites"]["quick"].update(device="tpu"),
                   "suites/quick/device"),
    "sequence too long": (lambda c: c["suites"]["quick"]["memory"].update(seq_len=4096),
                          "suites/quick/memory/seq_len: 4096 exceeds gpt2-tiny's 512 positions"),
    "unknown task": (lambda c: c["suites"]["quick"]["convergence"].update(tasks=["c4"]),
                     "suites/quick/convergence/tasks/0"),
    "unknown hyperparameter": (lambda c: c.update(method_params={"grad_accum": {"microbatches": 8}}),
                               "method_params/grad_accum: grad_accum has no option 'microbatches'"),
    "unknown hyperparameter in a variant": (
        lambda c: c["suites"]["quick"].update(methods=["galore@rnk=8"]),
        "suites/quick/methods/galore@rnk=8: galore@rnk=8 has no option 'rnk'"),
    "a stack of two optimizers": (lambda c: c["suites"]["quick"].update(methods=["adama+galore"]),
                                  "suites/quick/methods/adama+galore: adama and galore both provide"),
    "a hyperparameter of the wrong type": (
        lambda c: c.update(method_params={"adamw": {"lr": "fast"}}),
        "method_params/adamw: adamw: option 'lr' takes a float like 0.001, not \"fast\""),
    "a simulated job of a method that cannot simulate": (
        lambda c: c["suites"]["paper-memory"].update(methods=["adamw_8bit"]) or c.update(suite="paper-memory"),
        "suites/paper-memory/memory/methods: adamw_8bit cannot run on fake tensors"),
    "more micro-batches than a method takes": (
        lambda c: c["suites"]["quick"].update(method_params={"galore_layerwise": {"micro_batches": 4}}),
        "galore_layerwise"),
    "a fine-tuning section without its pre-training": (
        lambda c: c["suites"]["quick"]["finetune"].pop("pretrain"), "suites/quick/finetune"),
    "a pre-training run of an unknown method": (
        lambda c: c["suites"]["quick"]["finetune"]["pretrain"].update(method="adamx"),
        "suites/quick/finetune/pretrain/method: unknown method 'adamx'"),
    "unknown hyperparameter in a suite": (
        lambda c: c["suites"]["quick"].update(method_params={"adama": {"vnorm": "mean"}}),
        "suites/quick/method_params/adama: adama has no option 'vnorm'"),
}


def test_suite_method_params_override_the_top_level():
    config = mutate(lambda c: (c.update(method_params={"grad_accum": {"micro_batches": 2, "lr": 0.1}}),
                               c["suites"]["quick"].update(method_params={"grad_accum": {"micro_batches": 8}})))
    jobs = checked(config)
    job = next(j for p, j in jobs.items() if "/memory/gpt2-tiny/checkpointing+grad_accum/" in p)
    assert job.hparams == {"micro_batches": 8, "lr": 0.1}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_names_the_key(case):
    change, expected = BAD[case]
    with pytest.raises(ConfigError) as err:
        checked(mutate(change))
    assert expected in str(err.value)


def test_dry_run_lists_jobs(workflow_copy):
    out = snakemake(workflow_copy, "-n", "--cores", "2")
    assert out.returncode == 0, out.stderr
    jobs = checked(copy.deepcopy(CONFIG))
    counts = job_counts(out.stdout)
    assert sum(n for rule, n in counts.items() if rule.startswith("run_")) == len(plan.groups(jobs, "quick"))
    # every job is in exactly one group, and the groups are what share a process
    grouped = [p for paths in plan.groups(jobs, "quick").values() for p in paths]
    assert sorted(grouped) == sorted(jobs)
    by_group = plan.groups(jobs, "quick")
    memory = [g for g in by_group if g.startswith("quick/memory-")]
    assert all(len({p.split("/")[4] for p in by_group[g]}) == 1 for g in memory)  # one model each
    convergence = [g for g in by_group if g.startswith("quick/convergence-gpt2-tiny")]
    assert "quick/convergence-gpt2-tiny-finetune-1" in convergence  # chunks
    assert all(len(by_group[g]) <= plan.GROUP_BY["convergence"][1] for g in convergence)
    # a tuned run never shares a process with the grid it reads its learning rate from
    for g in convergence:
        tuned = {bool(jobs[p].tuned_from) for p in by_group[g]}
        assert len(tuned) == 1 and (tuned == {True}) == bool(re.search(r"-tuned(-\d+)?$", g)), g


def test_a_new_method_module_joins_the_dag(workflow_copy):
    (workflow_copy / "methods" / "my_new_method.py").write_text(
        '"""A new method."""\nfrom bench.method import Method\n\n'
        'class Mine(Method):\n    paper = "me"\n\nMETHOD = Mine\n')
    out = snakemake(workflow_copy, "-n", "--cores", "2")
    assert out.returncode == 0, out.stderr
    assert "results/runs/quick/memory/gpt2-tiny/my_new_method/" in out.stdout


def test_snakemake_rejects_a_bad_config_before_any_job(workflow_copy):
    out = snakemake(workflow_copy, "--cores", "2", "--config", "suite=huge")
    assert out.returncode != 0
    assert "unknown suite 'huge'" in out.stdout + out.stderr
    assert not (workflow_copy / "results").exists()


def test_a_method_module_that_fails_at_import_stops_planning(workflow_copy):
    (workflow_copy / "methods" / "broken.py").write_text("import no_such_package\n")
    out = snakemake(workflow_copy, "-n", "--cores", "2")
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "method 'broken' cannot be loaded" in text and "no_such_package" in text


def test_all_leaves_out_what_a_method_cannot_do():
    config = mutate(lambda c: c.update(suite="paper-memory"))
    methods = {path.split("/")[5] for path in checked(config)}
    assert "adamw_8bit" not in methods and "adamw" in methods  # simulated: bitsandbytes cannot


# Declared option values (a method's `choices` and `ranges`) are checked by the config
# check itself: a bad value fails before any job, naming the option and what it allows.
def test_a_variant_outside_its_declared_choices_is_rejected_naming_the_key():
    config = mutate(lambda c: c["suites"]["quick"].update(methods=["adamw", "galore@proj_type=bogus"]))
    with pytest.raises(ConfigError) as err:
        plan.check(config)
    message = str(err.value)
    assert "suites/quick/methods/galore@proj_type=bogus" in message
    assert "option 'proj_type' must be one of \"std\", \"reverse_std\", \"left\", \"right\", \"full\"" in message
    assert "not \"bogus\"" in message


@pytest.mark.parametrize("where, method, params, expected", [
    ("method_params", "galore", {"proj_type": "bogus"},
     "option 'proj_type' must be one of \"std\", \"reverse_std\", \"left\", \"right\", \"full\", "
     "not \"bogus\""),
    ("method_params", "roam", {"planner": "magic"}, "option 'planner' must be one of \"default\""),
    ("suites/quick/method_params", "microadam", {"k": 0.0}, "option 'k' must be in (0, 1], not 0.0"),
    ("suites/quick/method_params", "adama", {"v_norm": "median"}, "option 'v_norm' must be one of"),
    ("suites/quick/method_params", "lomo", {"micro_batches": 2},
     "micro_batches=2 is not supported: lomo takes at most 1 micro-batch"),
])
def test_method_params_outside_their_declared_values_are_rejected_naming_the_key(
        where, method, params, expected):
    def change(c):
        target = c if where == "method_params" else c["suites"]["quick"]
        target.update(method_params={method: params})

    with pytest.raises(ConfigError) as err:
        plan.check(mutate(change))
    assert f"config key {where}/{method}: " in str(err.value)
    assert expected in str(err.value)


def test_a_stack_member_outside_its_declared_values_is_rejected():
    config = mutate(lambda c: c["suites"]["quick"].update(
        methods=["adamw", "checkpointing+galore@rank=0"]))
    with pytest.raises(ConfigError, match=r"checkpointing\+galore@rank=0: option 'rank' must be in "
                                          r"\[1, inf\), not 0"):
        plan.check(config)


def test_a_finetune_section_pretrains_once_per_model_and_starts_every_job_from_its_weights():
    config = mutate(lambda c: c["suites"]["quick"]["finetune"].update(models=["gpt2-tiny", "llama-tiny"]))
    jobs = checked(config)
    saving = {p: j for p, j in jobs.items() if j.save_weights}
    assert sorted(j.model for j in saving.values()) == ["gpt2-tiny", "llama-tiny"]
    section = config["suites"]["quick"]["finetune"]
    for path, pre in saving.items():
        assert path.endswith("-pretrain.json") and pre.kind == "convergence" and pre.init is None
        assert (pre.task, pre.steps, pre.batch_size) == (section["pretrain"]["task"], section["pretrain"]["steps"],
                                                         section["pretrain"]["batch_size"])
        tuned = [j for j in jobs.values() if j.init == path.removesuffix(".json") + ".pt"]
        assert {j.model for j in tuned} == {pre.model}
        # each method: its tuning grid's runs, then the section's seeds
        tuning = section["tuning"]
        runs = tuning["points"] * len(tuning["seeds"]) + len(section["seeds"])
        assert len(tuned) == len(section["methods"]) * runs
        assert all(j.task == "markov_shift" and not j.save_weights for j in tuned)
    tuned = [p for p, j in jobs.items() if j.init]
    assert all("-finetune" in p for p in tuned)
    # a pre-training run never shares a process with the jobs that wait for its weights
    for paths in plan.groups(jobs, "quick").values():
        assert len({(jobs[p].save_weights, jobs[p].init is not None) for p in paths}) == 1
    # the jobs of the other sections are as they were: no weights in, none out
    assert sum(1 for j in jobs.values() if not j.init and not j.save_weights) == \
        len(checked(mutate(lambda c: c["suites"]["quick"].pop("finetune"))))


def test_ours_is_every_module_but_the_peers():
    from methods import available

    every = plan.resolve_methods(["all"], "x")
    # a peer's module says so first (its docstring starts with "Peer:"), independently of peer_of
    peers = {m for m in available() if (importlib.import_module(f"methods.{m}").__doc__ or "").startswith("Peer:")}
    assert {"galore_torch", "lora_peft"} <= peers
    assert plan.resolve_methods(["ours"], "x") == [m for m in every if m not in peers]

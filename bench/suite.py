"""Config -> the list of jobs, after checking everything in it.

`check(config)` is the one validation: the JSON schema (config/schema.yaml) checks shapes
and types, then the defaults it states are filled in, then what a schema cannot check:
that the suite, methods and models exist, that every method module imports, that stacks
can be built, that hyperparameter overrides name real options with values of the right
type, that sequences fit the models, that a method can do what its jobs ask (run on
fake tensors, split a batch into micro-batches, run sharded), and that a data-parallel
setting (`world_size`, `sharding`) is one a job of that kind can measure. Every error
names the key.
`check` returns the filled config and its jobs (`plan`). Nothing here runs a job.
"""
from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import yaml

from bench.job import JOB_DEFAULTS, KINDS, PROPERTIES, SCHEMA, Job, cell_suffix
from bench.measure.records import weights_path
from bench.method import member_names, parse_variant
from bench.models import MODELS, is_known, max_positions


_SUITE = yaml.safe_load(SCHEMA.read_text())["$defs"]["suite"]


class ConfigError(ValueError):
    """The config asks for something that does not exist; the message names the key."""


def available_methods() -> list[str]:
    from methods import available

    return available()


def validate_schema(config: dict) -> None:
    """Check `config` against config/schema.yaml, naming the bad key."""
    import jsonschema

    schema = yaml.safe_load(SCHEMA.read_text())
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(config))
    if errors:
        e = max(errors, key=lambda e: len(e.absolute_path))  # the deepest names the exact key
        where = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise ConfigError(f"config key {where}: {e.message}")


def fill_defaults(config: dict) -> dict:
    """The config with the defaults `plan` reads filled in (a copy): the grid's lists (one
    seed, one task), a capacity search's `max_batch`, a throughput baseline. Every other job
    field a suite leaves out takes the `Job`'s own default (config/schema.yaml `$defs/job`)."""
    config = copy.deepcopy(config)
    config.setdefault("method_params", {})
    for suite in config["suites"].values():
        suite.setdefault("method_params", {})
        for key, kind in SECTIONS.items():
            section = suite.get(key)
            if section is None:
                continue
            section.setdefault("seeds", [JOB_DEFAULTS["seed"]])
            section.setdefault("tasks", [JOB_DEFAULTS["task"]])
            if kind == "capacity":
                section.setdefault("max_batch", _SUITE["properties"]["capacity"]["properties"]
                                   ["max_batch"]["default"])
            if kind == "throughput":
                section.setdefault("baseline", JOB_DEFAULTS["baseline"])
            if key == "sharded_memory":
                section.setdefault("tiers", _SUITE["properties"]["sharded_memory"]["properties"]
                                   ["tiers"]["default"])
    return config


def check(config: dict) -> tuple[dict, dict[str, Job]]:
    """Validate `config` (schema, then names and capabilities; ConfigError naming the key)
    and return it with its defaults filled, and its jobs (`plan`)."""
    validate_schema(config)
    config = fill_defaults(config)
    return config, plan(config)


def _load_method(name: str, overrides: dict, where: str):
    from bench.method import MethodError, load

    try:
        return load(name, overrides)
    except MethodError as e:
        raise ConfigError(f"config key {where}: {e}") from None
    except Exception as e:  # a method module that fails at import: name the file
        raise ConfigError(f"config key {where}: method {name!r} cannot be loaded: "
                          f"{type(e).__name__}: {e}") from None


def resolve_methods(entries: list[str], where: str) -> list[str]:
    """The method names an entry list stands for (`all` = every module; `ours` = every
    module but the peers, the published packages run to check one of ours), each loaded
    once to check it exists, imports, and (for a stack) can be built."""
    known = available_methods()
    out: list[str] = []
    for entry in entries:
        names = known if entry in SELECTORS else [entry]
        for name in names:
            for base in member_names(name):
                if base not in known:
                    raise ConfigError(f"config key {where}: unknown method {base!r}; "
                                      f"available: {', '.join(SELECTORS)}, {', '.join(known)}")
            if name not in out:
                method = _load_method(name, {}, f"{where}/{name}" if entry not in SELECTORS or "@" in name else where)
                if entry == "ours" and method.peer_of:
                    continue
                out.append(name)
    return out


SELECTORS = ("all", "ours")  # method-list entries that stand for several modules


def _check_models(models: list[str], where: str) -> None:
    for m in models:
        if not is_known(m):
            raise ConfigError(f"config key {where}: unknown model {m!r}; known: {', '.join(MODELS)}, "
                              f"or a shape <family>-d<width>-l<layers>[-v<vocab>]")


def _check_method_params(params: dict, where: str) -> None:
    for method, overrides in params.items():
        if "@" not in method:
            resolve_methods([method], f"{where}/{method}")
        _load_method(method, overrides, f"{where}/{method}")


def _check_precision(suite: dict, where: str) -> None:
    """A ConfigError naming the key if the suite's `precision` and `dtype` cannot go
    together (mixed precision computes in bfloat16 or float16)."""
    from bench.measure.step import precision_error

    problem = precision_error(suite.get("dtype", JOB_DEFAULTS["dtype"]),
                              suite.get("precision", JOB_DEFAULTS["precision"]))
    if problem:
        raise ConfigError(f"config key {where}/precision: {problem}")


def method_params(config: dict, suite: dict, method: str) -> dict:
    """Overrides for one method (stack members each get theirs): the top level's, then the
    suite's on top."""
    params: dict = {}
    for base in member_names(method):  # a variant's own values win later, in load()
        for source in (config.get("method_params", {}), suite.get("method_params", {})):
            params.update(source.get(base, {}))
    return params


def _capable(config, suite, method: str, settings: dict, where: str, named: bool) -> bool:
    """Whether `method` can do jobs of these settings (declared capabilities; loading it
    with its settings checks their declared values, micro-batches included): a method that
    cannot run on fake tensors (`simulates`) in a simulated section, or sharded under the
    section's scheme (`shards`), is left out if it came with `all`, and is an error if it
    is named."""
    from bench.measure.kinds import can_shard

    m = _load_method(method, method_params(config, suite, method), f"{where}/methods")
    members = getattr(m, "members", [m])
    if settings.get("simulate") and not all(x.simulates for x in members):
        if named:
            raise ConfigError(f"config key {where}/methods: {method} cannot run on fake "
                              f"tensors (simulate: true)")
        return False
    scheme = settings.get("sharding", JOB_DEFAULTS["sharding"])
    if not can_shard(m, scheme):
        if named:
            raise ConfigError(f"config key {where}/methods: {method} cannot run sharded (sharding "
                              f"{scheme}; its `shards` declaration, docs/sharding.md)")
        return False
    return True


def section_axes(key: str, section: dict) -> list[dict]:
    """The job fields a section varies beside its grid's lists: for `sharded_memory`, each
    world size x scheme x tier (`simulate`) of its lists, in that order; for
    `sharded_model_capacity` (or a `model_capacity` section given them), each world size x
    scheme (a search per GPU count); the others, nothing ([{}])."""
    if key == "sharded_memory":
        return [{"world_size": n, "sharding": scheme, "simulate": tier == "simulated"}
                for n in section["world_sizes"] for scheme in section["shardings"] for tier in section["tiers"]]
    if "world_sizes" in section or "shardings" in section:
        return [{"world_size": n, "sharding": scheme} for n in section.get("world_sizes", [JOB_DEFAULTS["world_size"]])
                for scheme in section.get("shardings", [JOB_DEFAULTS["sharding"]])]
    return [{}]


# The section key that sets a job field through a list (`sharded_memory`'s axes).
AXIS_KEYS = {"world_size": "world_sizes", "sharding": "shardings", "simulate": "tiers"}


def _check_sharding(name: str, key: str, section: dict, kind: str, settings: dict) -> None:
    """A ConfigError naming the key if a job of these settings cannot have its data-parallel
    setting (`bench.measure.kinds.sharding_problem`: another kind than memory, a scheme not
    wired yet, a real run over MAX_REAL_RANKS processes, a device other than cpu)."""
    from bench.measure.kinds import sharding_problem

    problem = sharding_problem(kind, settings.get("world_size", JOB_DEFAULTS["world_size"]),
                               settings.get("sharding", JOB_DEFAULTS["sharding"]),
                               settings.get("simulate", JOB_DEFAULTS["simulate"]),
                               settings.get("device", JOB_DEFAULTS["device"]))
    if problem:
        field, why = problem
        for k in (field, AXIS_KEYS.get(field)):
            if k in section:
                raise ConfigError(f"config key suites/{name}/{key}/{k}: {why}")
        raise ConfigError(f"config key suites/{name}/{field}: {why} (the {key} section's jobs)")


def plan(config: dict) -> dict[str, Job]:
    """Every job of the selected suite: result path -> Job. `config` must have passed the
    schema (`check` does both)."""
    config = fill_defaults(config)
    name = config["suite"]
    suites = config["suites"]
    if name not in suites:
        raise ConfigError(f"config key suite: unknown suite {name!r}; defined: {', '.join(suites)}")
    suite = suites[name]
    _check_precision(suite, f"suites/{name}")
    methods = resolve_methods(suite["methods"], f"suites/{name}/methods")
    _check_method_params(config["method_params"], "method_params")
    _check_method_params(suite["method_params"], f"suites/{name}/method_params")
    jobs: dict[str, Job] = {}
    for key, kind in SECTIONS.items():
        section = suite.get(key)
        if not section:
            continue
        where = f"suites/{name}/{key}"
        entries = section.get("methods", suite["methods"])
        candidates = (resolve_methods(section["methods"], f"{where}/methods")
                      if "methods" in section else methods)
        settings = job_settings(suite, section)
        axes = []  # per axis: its settings and the methods that can do its jobs
        for axis in section_axes(key, section):
            _check_sharding(name, key, section, kind, {**settings, **axis})
            axes.append((axis, [m for m in candidates if _capable(config, suite, m, {**settings, **axis},
                                                                  where, named=m in entries)]))
        if kind == "throughput":
            base = section["baseline"]
            resolve_methods([base] if isinstance(base, str) else list(base.values()),
                            f"{where}/baseline")
        _check_models(section["models"], f"{where}/models")
        for model in section["models"]:
            if section["seq_len"] > max_positions(model):
                raise ConfigError(f"config key {where}/seq_len: {section['seq_len']} exceeds "
                                  f"{model}'s {max_positions(model)} positions")
        # a capacity job searches batch sizes up to max_batch
        batches = [section["max_batch"]] if kind == "capacity" else section["batch_sizes"]
        for axis, kind_methods in axes:
            for task in section["tasks"]:
                for model in section["models"]:
                    if "pretrain" in section:  # fine-tuning: every job starts from its weights
                        path, pretrain = pretrain_job(config, name, section["pretrain"], model,
                                                      f"{where}/pretrain")
                        jobs[path] = pretrain
                        settings["init"] = weights_path(path)
                    for method in kind_methods:
                        for batch in batches:
                            job = Job(**{**settings, **axis, "kind": kind, "method": method, "model": model,
                                         "batch_size": batch, "task": task,
                                         "hparams": method_params(config, suite, method)})
                            if kind == "throughput":
                                job.baseline = baseline_of(section, method)
                            jobs.update(seeded(name, job, section, where))
    return jobs


def seeded(name: str, job: Job, section: dict, where: str) -> dict[str, Job]:
    """`job` once per seed of the section, by result path. A section with `tuning` gets
    the protocol of bench/tuning.py instead: the learning-rate grid around the method's
    own default on the tuning seeds, then the section's seeds at the rate it chooses
    (`tuned_from`: the grid's result files)."""
    tuning = section.get("tuning")
    if not tuning:
        return {result_path(name, j): j for j in (_with(job, seed=s) for s in section["seeds"])}
    from bench.tuning import grid

    if set(tuning["seeds"]) & set(section["seeds"]):
        raise ConfigError(f"config key {where}/tuning/seeds: a learning rate is chosen on seeds other "
                          f"than the reported ones; {sorted(set(tuning['seeds']) & set(section['seeds']))} "
                          f"are in both")
    if any("lr" in parse_variant(m)[1] for m in job.method.split("+")):
        raise ConfigError(f"config key {where}: {job.method} fixes its learning rate, which the "
                          f"section's tuning chooses (leave lr out)")
    center = _load_method(job.method, job.hparams, f"{where}/methods").hp["lr"]
    grid_jobs = {result_path(name, j): j for j in (_with(job, seed=s, lr=lr)
                                                   for lr in grid(center, tuning["points"], tuning["factor"])
                                                   for s in tuning["seeds"])}
    tuned = {result_path(name, j): j for j in (_with(job, seed=s, tuned_from=list(grid_jobs))
                                               for s in section["seeds"])}
    return {**grid_jobs, **tuned}


def _with(job: Job, **fields) -> Job:
    """A copy of `job` (nothing shared) with `fields` changed."""
    return dataclasses.replace(copy.deepcopy(job), **fields)


# A suite's sections and the kind of job each plans: one per kind, `finetune`, whose
# convergence jobs start from a model pre-trained by a job of its own (`pretrain_job`), and
# `sharded_memory` and `sharded_model_capacity`, jobs at each of their data-parallel settings
# (`section_axes`).
SECTIONS = {**{kind: kind for kind in KINDS}, "finetune": "convergence", "sharded_memory": "memory",
            "sharded_model_capacity": "model_capacity"}


def pretrain_job(config: dict, name: str, pretrain: dict, model: str, where: str) -> tuple[str, Job]:
    """The result path and job of the run that pre-trains `model` for a `finetune` section:
    a convergence job of `pretrain`'s method, task, steps, batch and length (seed 0 unless
    set) under the suite's settings, that saves the model's weights beside its result."""
    suite = config["suites"][name]
    method = pretrain.get("method", "adamw")
    resolve_methods([method], f"{where}/method")
    job = Job(**{**job_settings(suite, {}), "kind": "convergence", "method": method, "model": model,
                 "task": pretrain["task"], "steps": pretrain["steps"], "batch_size": pretrain["batch_size"],
                 "seq_len": pretrain["seq_len"], "seed": pretrain.get("seed", JOB_DEFAULTS["seed"]),
                 "save_weights": True, "hparams": method_params(config, suite, method)})
    return result_path(name, job), job


# Section keys named otherwise than the job field they set (the grid's lists, `models`,
# `batch_sizes`, `seeds`, `tasks`, are iterated by `plan`).
RENAMED = {"timed_steps": "steps", "max_batch": "batch_size"}


def job_settings(suite: dict, section: dict) -> dict:
    """The job fields a suite sets for one kind's jobs: the suite's own (device, dtype,
    ...), the section's on top; any field of config/schema.yaml's `$defs/job` reaches the
    job under its own name."""
    out = {k: v for k, v in suite.items() if k in PROPERTIES}
    for key, value in section.items():
        key = RENAMED.get(key, key)
        if key in PROPERTIES:
            out[key] = value
    return out


def baseline_of(section: dict, method: str) -> str:
    """The method a throughput job times `method` beside."""
    base = section["baseline"]
    return base if isinstance(base, str) else base.get(method, JOB_DEFAULTS["baseline"])


def result_path(suite: str, job: Job) -> str:
    """Where a job of `suite` writes its result: results/runs/<suite>/<kind>/<model>/
    <method>/<cell>.json, the cell naming the task, batch, length, seed and the fields the
    schema marks `x-cell` that are set."""
    cell = f"{job.task}-bs{job.batch_size}-seq{job.seq_len}-seed{job.seed}"
    if job.kind == "capacity":
        cell = f"upto{job.batch_size}-seq{job.seq_len}-seed{job.seed}"
    return f"results/runs/{suite}/{job.kind}/{job.model}/{job.method}/{cell}{cell_suffix(job)}.json"


# Jobs that run in one process (one start-up of torch and transformers, about 8 s on a
# 2-core machine, for them all): the fields that key a group, and the most jobs a group
# holds (so groups still run in parallel on several cores and a deleted result reruns few).
GROUP_BY = {"memory": (("kind", "model"), 32), "convergence": (("kind", "model"), 18),
            "throughput": (("kind", "model"), 32), "capacity": (("kind", "model"), 16),
            "model_capacity": (("kind", "model"), 16)}
# The longest groups start first, so the last to end is a short one (Snakemake `priority`).
PRIORITY = {"convergence": 4, "capacity": 3, "model_capacity": 2, "throughput": 1, "memory": 0}


def groups(jobs: dict[str, Job], suite: str) -> dict[str, list[str]]:
    """Group id -> the result paths of the jobs one `membench many` process runs, in plan
    order: by the kind's key (GROUP_BY), in chunks of at most its size. Deleting one
    result reruns its group (what shares its process)."""
    keyed: dict[str, list[str]] = {}
    for path, job in jobs.items():
        key, _ = GROUP_BY[job.kind]
        # a pre-training run and the fine-tuning that waits for its weights never share one
        # (nor a tuned run and the grid it reads its learning rate from)
        # (and data-parallel jobs keep to their own, the others' groups unchanged)
        sharded = job.world_size > 1 or job.sharding != "none"
        role = (["pretrain"] if job.save_weights else ["finetune"] if job.init else []) + (
            ["tuned"] if job.tuned_from else []) + (["sharded"] if sharded else []) + (
            # a model search of several GPUs takes minutes to an hour: each its own group,
            # so that the cores share them
            [job.method, f"x{job.world_size}", job.sharding] if sharded and job.kind == "model_capacity" else [])
        keyed.setdefault(f"{suite}/" + "-".join([getattr(job, k) for k in key] + role), []).append(path)
    out: dict[str, list[str]] = {}
    for gid, paths in keyed.items():
        size = GROUP_BY[jobs[paths[0]].kind][1]
        chunks = [paths[i:i + size] for i in range(0, len(paths), size)]
        for i, chunk in enumerate(chunks):
            out[gid if len(chunks) == 1 else f"{gid}-{i + 1}"] = chunk
    return out


def rule_name(gid: str) -> str:
    """The Snakefile's rule of a group (and the name SLURM jobs are labelled with)."""
    return "run_" + re.sub(r"\W", "_", gid)


def load(path: str | Path) -> dict:
    """Read and check a config file (what the Snakefile does), defaults filled."""
    return check(yaml.safe_load(Path(path).read_text()))[0]

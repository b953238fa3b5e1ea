"""Config -> the list of jobs, after checking every name in it.

The JSON schema (config/schema.yaml) checks shapes and types; this module checks what
a schema cannot: that the profile, methods and models exist, that sequences fit the
models, and that `method_params` name real hyperparameters (the only check that imports
the method modules, and so torch, and only when overrides are given).
"""
from __future__ import annotations

from pathlib import Path

import yaml

from bench.job import KINDS
from bench.models import MODELS, is_known, max_positions

REPO = Path(__file__).resolve().parent.parent
METHODS_DIR = REPO / "methods"
SCHEMA = REPO / "config" / "schema.yaml"


class ConfigError(ValueError):
    """The config asks for something that does not exist; the message names the key."""


def available_methods() -> list[str]:
    from methods import available

    return available()


def validate_schema(config: dict) -> None:
    """Check `config` against config/schema.yaml (fills defaults), naming the bad key."""
    import jsonschema

    schema = yaml.safe_load(SCHEMA.read_text())
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(config))
    if errors:
        e = max(errors, key=lambda e: len(e.absolute_path))  # the deepest names the exact key
        where = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise ConfigError(f"config key {where}: {e.message}")


def resolve_methods(entries: list[str], where: str) -> list[str]:
    known = available_methods()
    out: list[str] = []
    for entry in entries:
        names = known if entry == "all" else [entry]
        for name in names:
            for part in name.split("+"):
                base = part.partition("@")[0]
                if base not in known:
                    raise ConfigError(f"config key {where}: unknown method {base!r}; "
                                      f"available: all, {', '.join(known)}")
            if "@" in name:  # a variant: its hyperparameters must exist
                _check_method_params({name: {}}, where.rsplit("/", 1)[0] + "/methods")
            if name not in out:
                out.append(name)
    return out


def _check_models(models: list[str], where: str) -> None:
    for m in models:
        if not is_known(m):
            raise ConfigError(f"config key {where}: unknown model {m!r}; known: {', '.join(MODELS)}, "
                              f"or a shape <family>-d<width>-l<layers>[-v<vocab>]")


def _check_method_params(params: dict, where: str) -> None:
    if not params:
        return
    from bench.method import MethodError, load

    for method, overrides in params.items():
        if "@" not in method:
            resolve_methods([method], f"{where}/{method}")
        try:
            load(method, overrides)
        except MethodError as e:
            raise ConfigError(f"config key {where}/{method}: {e}") from None


def method_params(config: dict, profile: dict, method: str) -> dict:
    """Overrides for one method (stack members each get theirs): the top level's, then the
    profile's on top."""
    params: dict = {}
    for part in method.split("+"):
        base = part.partition("@")[0]  # a variant's own values win later, in load()
        for source in (config.get("method_params", {}), profile.get("method_params", {})):
            params.update(source.get(base, {}))
    return params


def plan(config: dict) -> dict[str, list[str]]:
    """Every job of the selected profile: result path -> `python -m bench` arguments."""
    name = config["profile"]
    profiles = config["profiles"]
    if name not in profiles:
        raise ConfigError(f"config key profile: unknown profile {name!r}; defined: {', '.join(profiles)}")
    prof = profiles[name]
    methods = resolve_methods(prof["methods"], f"profiles/{name}/methods")
    _check_method_params(config.get("method_params", {}), "method_params")
    _check_method_params(prof.get("method_params", {}), f"profiles/{name}/method_params")
    jobs: dict[str, list[str]] = {}
    for kind in KINDS:
        section = prof.get(kind)
        if not section:
            continue
        where = f"profiles/{name}/{kind}"
        kind_methods = (resolve_methods(section["methods"], f"{where}/methods")
                        if "methods" in section else methods)
        _check_models(section["models"], f"{where}/models")
        for model in section["models"]:
            if section["seq_len"] > max_positions(model):
                raise ConfigError(f"config key {where}/seq_len: {section['seq_len']} exceeds "
                                  f"{model}'s {max_positions(model)} positions")
        for task in section.get("tasks", ["markov"]):
            for model in section["models"]:
                for method in kind_methods:
                    # a capacity job searches batch sizes up to max_batch
                    batches = ([section.get("max_batch", 1024)] if kind == "capacity"
                               else section["batch_sizes"])
                    for batch in batches:
                        for seed in section.get("seeds", [0]):
                            path, args = _job(config, prof, name, kind, section, task, method,
                                              model, batch, seed)
                            jobs[path] = args
    return jobs


def _job(config, prof, profile, kind, section, task, method, model, batch, seed):
    cell = f"{task}-bs{batch}-seq{section['seq_len']}-seed{seed}"
    if kind == "capacity":
        cell = f"upto{batch}-seq{section['seq_len']}-seed{seed}"
    args = ["--kind", kind, "--method", method, "--model", model, "--batch-size", str(batch),
            "--seq-len", str(section["seq_len"]), "--seed", str(seed), "--device", prof["device"],
            "--dtype", prof.get("dtype", "float32"),
            "--attn-implementation", prof.get("attn_implementation", "sdpa"), "--task", task]
    if section.get("capacity_gb"):
        args += ["--capacity-gb", str(section["capacity_gb"])]
        cell += f"-cap{section['capacity_gb']}g"
    if section.get("simulate"):
        args += ["--simulate"]
        cell += "-sim"
    if kind == "throughput":
        args += ["--steps", str(section["timed_steps"]), "--warmup-steps", str(section["warmup_steps"])]
    if kind == "convergence":
        args += ["--steps", str(section["steps"])]
    if kind in ("capacity", "model_capacity"):
        args += ["--memory-gb", *(f"{gb:g}" for gb in section["memory_gb"])]
    for key, value in method_params(config, prof, method).items():
        args += ["--hparam", f"{key}={_json(value)}"]
    return f"results/runs/{profile}/{kind}/{model}/{method}/{cell}.json", args


def _json(value) -> str:
    import json

    return json.dumps(value, separators=(",", ":"))


def load(path: str | Path) -> dict:
    """Read, schema-check and plan a config file (what the Snakefile does, for tests)."""
    config = yaml.safe_load(Path(path).read_text())
    validate_schema(config)
    plan(config)
    return config

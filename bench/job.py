"""A job: one method on one model, one kind of measurement. Plain data; imports no other
bench module, so the config layer, the command line and the runner all share it.

Every default a job field has is stated once, in config/schema.yaml (`$defs/job`):
`JOB_DEFAULTS` reads them from there, the `Job` dataclass and `python -m bench` take
them from `JOB_DEFAULTS`, and the suite's config check fills them before planning.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "config" / "schema.yaml"

KINDS = ("memory", "throughput", "convergence", "capacity", "model_capacity")
# memory categories of a peak (bench.measure.tracker says what goes in each)
CATEGORIES = ("param", "grad", "optimizer", "activation", "other")
# parameter dtypes by name (bench.measure.step maps them to torch dtypes)
DTYPE_NAMES = ("float32", "bfloat16", "float64")


def _schema_defaults() -> dict:
    props = yaml.safe_load(SCHEMA.read_text())["$defs"]["job"]["properties"]
    return {k: v["default"] for k, v in props.items() if "default" in v}


JOB_DEFAULTS = _schema_defaults()


def _default(name: str):
    value = JOB_DEFAULTS[name]
    if isinstance(value, (list, dict)):
        return field(default_factory=lambda: type(value)(value))
    return value


@dataclass
class Job:
    kind: str
    method: str
    model: str
    batch_size: int
    seq_len: int
    seed: int = _default("seed")
    device: str = _default("device")
    dtype: str = _default("dtype")
    task: str = _default("task")
    attn_implementation: str = _default("attn_implementation")
    dropout: float | None = _default("dropout")
    hparams: dict = field(default_factory=dict)
    capacity_gb: float | None = _default("capacity_gb")
    steps: int = _default("steps")  # convergence: training steps; throughput: timed steps
    warmup_steps: int = _default("warmup_steps")  # throughput only
    rounds: int = _default("rounds")  # throughput: interleaved rounds of method and baseline
    baseline: str = _default("baseline")  # throughput: the method timed beside it
    threads: int | None = None
    log_every: int = _default("log_every")
    simulate: bool = _default("simulate")  # memory and capacity kinds: fake tensors (tier `simulated`)
    memory_gb: list[float] = _default("memory_gb")  # capacity kinds: memory sizes, GiB


JOB_FIELDS = tuple(f.name for f in fields(Job))

"""A job: one method on one model, one kind of measurement. Plain data; imports no other
bench module, so the config layer, the command line and the runner all share it.

Its fields are stated once, in config/schema.yaml (`$defs/job`: name, type, default,
meaning, in order): the `Job` dataclass is built from that list, `membench run` makes its
flags from it, the suite check fills a suite's defaults from it, and `Job.from_dict`
checks a job read back from JSON against it. A job travels between processes as the JSON
of its fields (`to_dict`/`from_dict`), nothing else.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, field, make_dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "config" / "schema.yaml"
JOB_SCHEMA = yaml.safe_load(SCHEMA.read_text())["$defs"]["job"]
PROPERTIES: dict[str, dict] = JOB_SCHEMA["properties"]

KINDS = tuple(PROPERTIES["kind"]["enum"])
# memory categories of a peak (bench.measure.tracker says what goes in each)
CATEGORIES = ("param", "grad", "optimizer", "activation", "other")
# parameter dtypes by name (bench.measure.step maps them to torch dtypes)
DTYPE_NAMES = tuple(PROPERTIES["dtype"]["enum"])
JOB_DEFAULTS = {k: v["default"] for k, v in PROPERTIES.items() if "default" in v}


class JobError(ValueError):
    """A job's fields are not what config/schema.yaml says; the message names the field."""


_TYPES = {"integer": int, "number": float, "string": str, "boolean": bool, "array": list,
          "object": dict, "null": type(None)}


def _python_type(prop: dict):
    if "enum" in prop:
        return str
    names = prop["type"] if isinstance(prop["type"], list) else [prop["type"]]
    out = _TYPES[names[0]]
    for name in names[1:]:
        out = out | _TYPES[name]
    return out


def _field(name: str, prop: dict):
    if "default" not in prop:
        return name, _python_type(prop)
    value = prop["default"]
    default = (field(default_factory=lambda v=value: copy.deepcopy(v))
               if isinstance(value, (list, dict)) else field(default=value))
    return name, _python_type(prop), default


def _from_dict(cls, data: dict) -> "Job":
    """The job `data` describes (the JSON of `to_dict`), checked against the schema: an
    unknown field, a missing one or a value of the wrong type is a JobError naming it."""
    import jsonschema

    errors = list(jsonschema.Draft202012Validator(JOB_SCHEMA).iter_errors(data))
    if errors:
        e = max(errors, key=lambda e: len(e.absolute_path))
        where = "/".join(str(p) for p in e.absolute_path) or "(job)"
        raise JobError(f"job field {where}: {e.message}")
    return cls(**copy.deepcopy(data))


def _time_limit(self) -> float:
    """Seconds the job may run: `time_limit_s`, or its kind's limit (the schema's x-by-kind)."""
    return self.time_limit_s or PROPERTIES["time_limit_s"]["x-by-kind"][self.kind]


def _to_dict(self) -> dict:
    """The job's fields as JSON-ready data, in the schema's order."""
    return asdict(self)


# required fields first (no default), then the rest, each in the schema's order
_ORDER = sorted(PROPERTIES, key=lambda k: "default" in PROPERTIES[k])
Job = make_dataclass(
    "Job", [_field(k, PROPERTIES[k]) for k in _ORDER],
    namespace={"__doc__": "One job; its fields are config/schema.yaml's `$defs/job`.",
               "__module__": __name__,
               "from_dict": classmethod(_from_dict), "to_dict": _to_dict,
               "time_limit": _time_limit})

JOB_FIELDS = tuple(_ORDER)


def cell_suffix(job) -> str:
    """What a job's result file name says of the fields marked `x-cell` in the schema
    that are set (not at their default), e.g. `-cap0.02g-sim`."""
    out = ""
    for name, prop in PROPERTIES.items():
        value = getattr(job, name)
        if "x-cell" in prop and value not in (None, False) and value != prop.get("default"):
            out += prop["x-cell"].format(value)
    return out


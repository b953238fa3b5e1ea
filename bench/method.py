"""The method contract: what a module in `methods/` provides, and how methods stack.

A method module defines one subclass of `Method` named `METHOD`. It overrides only what
it changes; the defaults are plain AdamW training with optional gradient accumulation:

- `defaults`: its hyperparameters (the paper's values). Config can override any of them
  and nothing else: an unknown key is an error naming the known ones.
- `transform_model(model)`: change the model (swap layers, wrap blocks). Default: none.
- `make_optimizer(model)`: the optimizer. Default: `torch.optim.AdamW`.
- `train_step(model, optimizer, batch)`: one optimizer step over `micro_batches`
  micro-batches; returns the mean loss as a detached tensor. Override to own the step
  (fold gradients during backward, run a planned graph).
- `loss_scaling`: whether the step scales a float16 loss (see Precision below). The
  default step does (True); a method that overrides `train_step` states it in its own
  class (a contract test checks that it does).
- `state_tensors(optimizer)`: the persistent optimizer state, counted as `optimizer`
  memory. Default: every tensor in `optimizer.state`.
- `loss(model, batch)`: the batch's training loss. Default: the mean cross-entropy of the
  model's logits (`logits_loss`). A method that computes it otherwise (chunked_ce, which
  never makes the whole logits) overrides it and, in `transform_model`, calls
  `use_loss(model, self.loss)`: `lm_loss`, the loss of every step whoever owns the step
  (`accumulate`, LOMO's, ...), then computes it.
- `paper`: the citation (authors, title, venue, year, arXiv id); required.
- `incompatible`: names of methods it cannot be stacked with.
- `simulates`: False if the step needs tensor values (bitsandbytes reads one), so it
  cannot run on fake tensors; the suite then plans no simulated job for it.
- `shards`: whether the method runs under data-parallel sharding (a memory job's
  `sharding`, docs/sharding.md): True (the default), False, or a tuple of the schemes it
  runs under (`("fsdp",)`); the suite plans no sharded job for a method that cannot
  (an error if the method is named).
- `max_micro_batches`: the most micro-batches the method can split a batch into (None:
  any; 1: no gradient accumulation, e.g. an update fused into backward); `load` rejects
  more (so the config check does, before any job).
- `report`: what the method found worth saying about this run (e.g. which layers it
  replaced); stored in the result as `method_report`.
- `plans_per_shape`: True if the first step at a new batch shape is a planning step
  (ROAM traces and plans it), so a measurement must warm up at each shape.
- `choices`: option -> the values it may take, e.g. `{"proj_type": ("std", "left")}`.
- `ranges`: option -> the interval its number (each number, for a list option) must lie
  in, written as in mathematics: `{"rank": "[1, inf)", "k": "(0, 1]"}`. None passes a
  range only where the option's default is None (an option that is off unless set).
- `peer_of`: for a peer, the name of our method it is compared against, else None; and
  `package`: the pip requirement it runs (`require_package` imports it).

`load` checks every declaration before any job (so does the config check, which loads
each method with its overrides): an unknown option, a value of the wrong type, one
outside its `choices` or `ranges` (the error names the option and what it allows), or
more micro-batches than `max_micro_batches`. A method checks at run time only what
depends on the model or the installed packages (e.g. fp16 parameters, a missing package).

A peer is a module that runs a published package's implementation (the authors', or a
library's) to compare with one of ours on the same models and settings: its docstring
starts with "Peer:" and it sets `peer_of` and `package`; where it runs the same
algorithm as that method, it takes its defaults and declarations. It is named after the package's
import name (`galore_torch`, `apollo_torch`, `came_pytorch`), followed by what of the
package it runs where that is not the whole package (`torchao_adamw8bit`,
`optimi_accum`); where that name is our method's, `_pkg` is added (`adam_mini_pkg`).
(`adamw_8bit`, bitsandbytes' AdamW8bit, predates the rule and keeps its name: result rows
are keyed by the module name.)

What a method may use of the measuring tool (the memory tracker, while it measures) is
in `bench.hooks`; a method imports the contract (this module, `bench.hooks`,
`bench.job`) and nothing else of `bench`.

Methods stack with `+` (`checkpointing+grad_accum`): model transforms apply left to
right; at most one member may provide the optimizer, at most one the step and at most one
the loss; their hyperparameters merge and must not disagree; each member's declarations hold.

Precision (the job's `dtype` and `precision`; `bench.measure.step.setup` builds the model
and attaches a `Precision` to it, `precision_of(model)` reads it back):

- pure: parameters, gradients, optimizer state and compute in `dtype`.
- mixed: parameters (the master copy), gradients and optimizer state in float32; the
  forward and the loss run under `torch.autocast(device_type, dtype)` (bfloat16 or
  float16), as trainers (accelerate, Lightning, DeepSpeed's torch_autocast) run it.
  Where: in `lm_loss`, the one function every step computes its loss with (the default
  `accumulate`, LOMO's, the layer-wise GaLore's, the step ROAM traces): so a method that
  owns its step gets the same autocast without doing anything, and only the forward is
  under it (backward outside autocast, as torch.amp recommends; backward ops run in the
  dtypes the forward chose). Wrapping `train_step` instead would also put backward and
  the optimizer's update under autocast.
- float16 (pure or mixed) needs loss scaling (its gradients underflow otherwise): the
  model's `Precision.scaler` is a `LossScaler` (dynamic, GradScaler's defaults). The
  default step multiplies each micro-batch's loss by its scale, then `scaler.step`
  unscales the gradients, skips the update on an inf/nan gradient (halving the scale)
  and doubles the scale after `growth_interval` clean steps. A method whose update
  runs inside backward (LOMO, layer-wise GaLore, AdamA) cannot unscale before it has
  updated: it declares `loss_scaling = False` and runs float16 unscaled; a loss that goes
  inf/nan is then a `diverged` row. The result states which (`loss_scaler`).
  torch.amp.GradScaler is not used: its `unscale_` refuses float16 gradients (pure
  float16), and it reads its found-inf flag with `.item()`, which fake tensors (the
  simulated tier) cannot answer.
"""
from __future__ import annotations

import importlib
import json
import math
import re
from dataclasses import dataclass

import torch

from methods import available

BASE_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, micro_batches=1)


class MethodError(ValueError):
    """A method cannot be built as asked (unknown name or option, bad stack)."""


class Method:
    paper: str = ""
    defaults: dict = {}
    incompatible: frozenset = frozenset()
    plans_per_shape: bool = False
    simulates: bool = True
    shards: bool | tuple = True
    max_micro_batches: int | None = None
    choices: dict = {}
    ranges: dict = {}
    peer_of: str | None = None
    package: str = ""
    loss_scaling: bool = True

    def __init__(self):
        self.name = _module_name(type(self).__module__)
        self.hp = {**BASE_DEFAULTS, **self.defaults}
        self.report: dict = {}

    # -- what a method may override ---------------------------------------------
    def transform_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), **self.adam_args)

    @property
    def adam_args(self) -> dict:
        """The Adam hyperparameters every Adam-like optimizer takes, as keyword arguments."""
        hp = self.hp
        return dict(lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"],
                    weight_decay=hp["weight_decay"])

    def train_step(self, model, optimizer, batch: dict) -> torch.Tensor:
        scaler = precision_of(model).scaler  # float16 only
        loss = accumulate(model, batch, self.hp["micro_batches"],
                          loss_scale=scaler.scale if scaler else 1.0)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return loss

    def state_tensors(self, optimizer) -> list[torch.Tensor]:
        return [v for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor)]

    def loss(self, model, batch: dict) -> torch.Tensor:
        return logits_loss(model, batch)


# The attribute of a model that holds the loss a method set (`use_loss`).
LOSS_ATTRIBUTE = "membench_loss"


def use_loss(model: torch.nn.Module, loss) -> None:
    """Make `loss(model, batch)` the loss `lm_loss` computes for `model` (a method that
    overrides `Method.loss` calls this in `transform_model`). A wrapper that forwards
    attributes to the model it wraps (peft's) keeps it."""
    setattr(model, LOSS_ATTRIBUTE, loss)


def lm_loss(model, batch: dict) -> torch.Tensor:
    """The training loss of `batch`: the loss a method set on the model (`use_loss`), else
    `logits_loss`; under mixed precision, computed under autocast (the one place it is
    entered: see the module docstring)."""
    loss = getattr(model, LOSS_ATTRIBUTE, None) or logits_loss
    precision = precision_of(model)
    if not precision.mixed:
        return loss(model, batch)
    with torch.autocast(precision.device_type, dtype=precision.dtype):
        return loss(model, batch)


def logits_loss(model, batch: dict) -> torch.Tensor:
    """Mean cross-entropy over the labelled positions (labels aligned with the inputs,
    -100 unlabelled), in the logits' precision (half precisions are upcast to float32, as
    Hugging Face does)."""
    logits = model(input_ids=batch["input_ids"]).logits
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                             ignore_index=-100)


def accumulate(model, batch: dict, n: int, before_backward=None,
               loss_scale: float = 1.0) -> torch.Tensor:
    """Forward and backward over `n` equal micro-batches of `batch`, each loss scaled by
    1/n so the gradients sum to the batch's; `before_backward(i)` runs before micro-batch
    i's backward (a method that acts inside backward sets itself up there). Backward runs
    on the loss times `loss_scale` (a float16 step's `LossScaler.scale`; the gradients
    are then that many times the loss's). Returns the batch's mean loss (unscaled),
    detached. The one micro-batch loop of the suite."""
    total = None
    for i, micro in enumerate(split_batch(batch, n)):
        loss = lm_loss(model, micro) / n
        if before_backward is not None:
            before_backward(i)
        (loss * loss_scale if loss_scale != 1.0 else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    return total


class LossScaler:
    """Dynamic loss scaling for float16 steps, with torch.amp.GradScaler's defaults and
    rule: the loss is multiplied by `scale` before backward; `step(optimizer)` divides the
    gradients by it in place (torch's fused check-and-unscale kernel, per device and
    dtype, as GradScaler does) and, if one of them holds an inf or nan, skips the update
    and multiplies `scale` by `backoff_factor`; after `growth_interval` clean steps in a
    row it multiplies `scale` by `growth_factor`.

    Unlike GradScaler it unscales float16 gradients (pure float16 parameters) and runs on
    fake tensors (there no value is known: every step counts as clean). What it holds
    between steps: two Python numbers (the scale, the clean steps in a row), no tensor;
    each step makes two 0-d float32 tensors per device (the found-inf flag and 1/scale),
    temporaries (`other`)."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self.clean_steps = 0  # clean steps in a row since the scale last changed
        self.skipped_steps = 0  # updates skipped over the run (an inf/nan gradient)

    def unscale_(self, params) -> bool:
        """Divide the gradients of `params` by the scale in place; whether all are finite."""
        from torch._subclasses.fake_tensor import is_fake

        groups: dict = {}
        for p in params:
            if p.grad is not None:
                groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
        finite = True
        for (device, _), grads in groups.items():
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
            inv_scale = torch.full((), 1.0 / self.scale, dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            if not is_fake(found_inf) and bool(found_inf):
                finite = False
        return finite

    def step(self, optimizer) -> bool:
        """Unscale the gradients of `optimizer`'s parameters, update unless one is inf or
        nan, then adjust the scale (`update`); whether it updated."""
        finite = self.unscale_(p for group in optimizer.param_groups for p in group["params"])
        if finite:
            optimizer.step()
        self.update(finite)
        return finite

    def update(self, finite: bool) -> None:
        """The scale after a step whose gradients were (not) all finite."""
        if not finite:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.skipped_steps += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state(self) -> dict:
        """What a result records of it: the scale now and the updates skipped."""
        return {"scale": self.scale, "skipped_steps": self.skipped_steps}


@dataclass
class Precision:
    """How a model trains (the job's `dtype` and `precision`): `dtype` is the compute
    dtype (the parameters' too, unless `mixed`); `mixed` runs the loss under autocast
    (`lm_loss`) with float32 parameters; `scaler` is the float16 loss scaler (None for
    other dtypes)."""

    dtype: torch.dtype
    mixed: bool = False
    device_type: str = "cpu"
    scaler: LossScaler | None = None


# The attribute of a model that holds its Precision (`use_precision`).
PRECISION_ATTRIBUTE = "membench_precision"


def use_precision(model: torch.nn.Module, precision: Precision) -> None:
    """Attach `precision` to `model` (bench.measure.step.setup does, after the method's
    `transform_model`); `lm_loss` and the default step read it with `precision_of`."""
    setattr(model, PRECISION_ATTRIBUTE, precision)


def precision_of(model) -> Precision:
    """The model's Precision; a model built without one (a unit test's) trains pure in
    its parameters' dtype, unscaled."""
    precision = getattr(model, PRECISION_ATTRIBUTE, None)
    if precision is not None:
        return precision
    param = next(iter(model.parameters()), None) if isinstance(model, torch.nn.Module) else None
    return Precision(dtype=param.dtype if param is not None else torch.get_default_dtype())


def require_package(module: str, pip_spec: str, method: str):
    """Import a peer's package, or raise a MethodError saying what to install (the suite
    then records the job with status error and this message). Any failure of the import
    counts (a package that imports bitsandbytes can fail loading its library)."""
    try:
        return importlib.import_module(module)
    except Exception as e:
        raise MethodError(f"{method} needs `pip install {pip_spec}` "
                          f"({type(e).__name__}: {e})") from None


def split_batch(batch: dict, n: int) -> list[dict]:
    """Split a batch into `n` equal micro-batches along the first dimension."""
    size = len(next(iter(batch.values())))
    if n < 1 or size % n:
        raise MethodError(f"batch size {size} cannot be split into {n} equal micro-batches")
    chunks = {k: v.chunk(n) for k, v in batch.items()}
    return [{k: chunks[k][i] for k in batch} for i in range(n)]


def _module_name(module: str) -> str:
    """`methods.roam` or `methods.roam.method` -> `roam`; a class outside methods/ (a
    test's) is named after its own module."""
    parts = module.split(".")
    return parts[1] if parts[0] == "methods" and len(parts) > 1 else parts[-1]


def _overrides(member: Method, name: str) -> bool:
    return getattr(type(member), name) is not getattr(Method, name)


class Stack(Method):
    """Several methods applied together; see the module docstring."""

    def __init__(self, members: list[Method]):
        self.members = members
        self.name = "+".join(m.name for m in members)
        names = [m.name for m in members]
        for m in members:
            clash = m.incompatible.intersection(names)
            if clash:
                raise MethodError(f"{m.name} cannot be stacked with {', '.join(sorted(clash))}")
        self._owner = {}
        for part in ("make_optimizer", "train_step", "state_tensors", "loss"):
            owners = [m for m in members if _overrides(m, part)]
            if len(owners) > 1:
                raise MethodError(f"{' and '.join(o.name for o in owners)} both provide {part}; "
                                  f"they cannot be stacked")
            self._owner[part] = owners[0] if owners else members[0]
        hp, set_by = dict(BASE_DEFAULTS), {}
        for m in members:
            for key, value in m.defaults.items():
                if key in set_by and hp[key] != value:
                    raise MethodError(f"stack {self.name}: {set_by[key]} and {m.name} disagree on {key}")
                hp[key], set_by[key] = value, m.name
        self.hp = hp
        for m in members:
            m.hp = hp  # one shared dict: an override reaches every member

    @property
    def report(self) -> dict:
        return {m.name: m.report for m in self.members if m.report}

    @property
    def plans_per_shape(self) -> bool:
        return any(m.plans_per_shape for m in self.members)

    @property
    def loss_scaling(self) -> bool:
        return self._owner["train_step"].loss_scaling

    def transform_model(self, model):
        for m in self.members:
            model = m.transform_model(model)
        return model

    def make_optimizer(self, model):
        return self._owner["make_optimizer"].make_optimizer(model)

    def train_step(self, model, optimizer, batch):
        return self._owner["train_step"].train_step(model, optimizer, batch)

    def state_tensors(self, optimizer):
        return self._owner["state_tensors"].state_tensors(optimizer)

    def loss(self, model, batch):
        return self._owner["loss"].loss(model, batch)


def member_names(spec: str) -> list[str]:
    """The methods a spec stacks: `checkpointing+galore@rank=8` -> ["checkpointing", "galore"]."""
    return [member.partition("@")[0] for member in spec.split("+")]


def parse_variant(member: str) -> tuple[str, dict]:
    """`galore@rank=8,update_proj_gap=50` -> ("galore", {"rank": 8, "update_proj_gap": 50}):
    a method with some hyperparameters fixed, named in configs and results as written."""
    name, _, variant = member.partition("@")
    overrides = {}
    for item in filter(None, variant.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise MethodError(f"{member}: expected name@key=value[,key=value], got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return name, overrides


def load(spec: str, overrides: dict | None = None) -> Method:
    """Build the method (or `a+b` stack) named `spec`, with hyperparameter overrides; a
    member written `name@key=value` fixes those hyperparameters over `overrides`."""
    known = available()
    members, fixed = [], {}
    for member in spec.split("+"):
        name, variant = parse_variant(member)
        if name not in known:
            raise MethodError(f"unknown method {name!r}; available: {', '.join(known)}")
        module = importlib.import_module(f"methods.{name}")
        members.append(module.METHOD())
        fixed.update(variant)
    method = members[0] if len(members) == 1 else Stack(members)
    for key, value in {**(overrides or {}), **fixed}.items():
        if key not in method.hp:
            raise MethodError(f"{spec} has no option {key!r}; options: {', '.join(sorted(method.hp))}")
        method.hp[key] = _typed(spec, key, value, method.hp[key])
    _check_declared(spec, members)
    return method


def _check_declared(spec: str, members: list[Method]) -> None:
    """A MethodError if an option of the (stacked) method `spec` is outside what one of
    its members declares (`choices`, `ranges`, `max_micro_batches`), naming the option."""
    for m in members:
        for key, allowed in m.choices.items():
            value = m.hp[key]
            if value not in tuple(allowed):
                raise MethodError(f"{spec}: option {key!r} must be one of "
                                  f"{', '.join(json.dumps(a) for a in allowed)}, not {json.dumps(value)}")
        for key, interval in m.ranges.items():
            value = m.hp[key]
            if value is None and {**BASE_DEFAULTS, **m.defaults}.get(key) is None:
                continue
            many = isinstance(value, (list, tuple))
            if not all(_within(x, interval) for x in (value if many else [value])):
                raise MethodError(f"{spec}: option {key!r} must {'have every element' if many else 'be'} "
                                  f"in {interval}, not {json.dumps(value)}")
    n = members[0].hp["micro_batches"]
    limits = [m for m in members if m.max_micro_batches is not None]
    owner = min(limits, key=lambda m: m.max_micro_batches, default=None)
    if n is None or n < 1:
        raise MethodError(f"{spec}: micro_batches={json.dumps(n)} is not supported: a step has "
                          f"at least one micro-batch")
    if owner is not None and n > owner.max_micro_batches:
        limit = owner.max_micro_batches
        raise MethodError(f"{spec}: micro_batches={n} is not supported: {owner.name} takes at "
                          f"most {limit} micro-batch{'es' if limit > 1 else ''} per step "
                          f"(max_micro_batches={limit})")


_INTERVAL = re.compile(r"^([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])])$")


def _within(x, interval: str) -> bool:
    """Whether the number `x` lies in `interval` ("[1, inf)", "(0, 1]", "(-inf, 0)")."""
    match = _INTERVAL.match(interval)
    if match is None:
        raise ValueError(f"bad interval {interval!r}: write it as [a, b], (a, b], [a, inf) ...")
    left, lo, hi, right = match.group(1), float(match.group(2)), float(match.group(3)), match.group(4)
    if isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x):
        return False
    return (x >= lo if left == "[" else x > lo) and (x <= hi if right == "]" else x < hi)


def _typed(spec: str, key: str, value, default):
    """`value` if it has the type of the option's default (an int where a float is
    expected is taken as that float; a list where a tuple is); else a MethodError."""
    if default is None or value is None:
        return value
    if isinstance(default, bool) or isinstance(value, bool):
        ok = isinstance(value, bool) and isinstance(default, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float))
        value = float(value) if ok else value
    elif isinstance(default, (tuple, list)):
        ok = isinstance(value, (tuple, list)) and len(value) == len(default)
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise MethodError(f"{spec}: option {key!r} takes a {type(default).__name__} like "
                          f"{json.dumps(default)}, not {json.dumps(value)}")
    return value

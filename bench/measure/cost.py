"""The exact compute cost of one training step: FLOPs, bytes moved and operator count per
aten operator, split by phase; on real tensors (CPU, CUDA) and on fake tensors alike.

`StepCost` is a `TorchDispatchMode`: every aten operator the step runs passes through it
once (after autograd, so what it sees is what a device runs, one kernel per operator in
eager mode). It stacks with the `MemoryTracker` (another dispatch mode) and with
`FakeTensorMode`: it reads shapes and dtypes only, never a value.

What is counted, per operator call:

- ``flops``: the formulas of `torch.utils.flop_counter` (the registry FlopCounterMode
  uses: matmuls, convolutions, fused attention, forward and backward), plus those added
  here: the CPU's fused attention (`_scaled_dot_product_flash_attention_for_cpu` and its
  backward, the same counts as the CUDA kernels) and the SVD (GaLore's projector). A
  multiply-add is 2 FLOPs. Elementwise operators, reductions and the like count 0 FLOPs,
  as in FlopCounterMode: their cost is their bytes.
- ``bytes_moved``: bytes read plus bytes written, the sizes of the tensors as the operator
  sees them (numel x element size of each tensor argument and each tensor result, not of
  their storages). Rules: (1) a view or alias operator (`transpose`, `view`, `split`,
  `detach`, `_unsafe_view`, ...) and an allocation without a fill (`empty*`) move 0 bytes
  and are not counted as operators; (2) an in-place operator reads its inputs (the
  destination among them) and writes its destination once: `add_(a, b)` moves 3 x |a|;
  (3) the operators that only write their destination (`copy_`, `fill_`, `zero_`, the
  random fills) do not read it; (4) an `out=` argument is written, not read.
- ``ops``: the operator calls that move bytes (views, aliases and bare allocations excluded).

Phases (what the step was doing when the operator ran):

- ``forward``: outside backward and outside `optimizer.step()` (below).
- ``backward``: inside `loss.backward()` (autograd's graph task). It includes the forward
  recomputed inside backward (checkpointing: ops inside backward with grad mode on, also
  kept on their own as ``recompute``), and any update a method runs inside backward from
  a gradient hook (AdamA's folding of each gradient into its moments, GaLore per layer's
  whole update): those methods have no separate optimizer phase to speak of.
- ``optimizer``: inside `optimizer.step()` of any `torch.optim.Optimizer` (global step hooks).
- ``forward`` is everything else: the forward pass (its parts under `no_grad` too, such
  as LLaMA's rotary tables) and whatever a method runs on its own outside autograd and
  outside `optimizer.step()`: ROAM's planned step runs forward, backward and update as one
  graph without autograd, so all of ROAM's step counts as forward.
- ``periodic``: not run by the measured step but by every T-th step (GaLore's SVD
  refresh of its projectors, every `update_proj_gap` steps): counted by running it once
  beside the step (`add_periodic`) and divided by T, so it is the amortized cost per step.
  The measured step is the second one, where GaLore does no SVD. Totals include it.

`per_op` keeps the whole step, aggregated per (phase, operator, dtype, flops, bytes) with
a count, so a step time can be estimated for any GPU after the fact (`bench.estimate`).
"""
from __future__ import annotations

import math
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

PHASES = ("forward", "backward", "optimizer", "periodic")

# Rule (1): no data moved, not an operator launch (beside every `is_view` operator).
_NO_DATA = {aten._unsafe_view, aten.detach, aten.alias, aten.lift_fresh, aten.empty,
            aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided,
            aten.set_, aten.resize_, aten._reshape_alias, aten.is_contiguous, aten.sym_size,
            aten.sym_stride, aten.sym_numel, aten.sym_storage_offset, aten.stride,
            aten.size, aten.dim, aten.numel, aten.is_same_size, aten._has_compatible_shallow_copy_type,
            torch.ops.profiler._record_function_enter_new, torch.ops.profiler._record_function_exit,
            torch.ops.prim.device, torch.ops.prim.layout}
# Rule (3): in-place operators that write their destination without reading it.
_WRITE_ONLY = {aten.copy_, aten.fill_, aten.zero_, aten.normal_, aten.uniform_,
               aten.bernoulli_, aten.random_, aten.exponential_}


def _svd_flops(a_shape, full_matrices=True, compute_uv=True, *args, out_shape=None, **kwargs) -> int:
    """A thin SVD of each m x n matrix (k = min(m, n), l = max(m, n)): 6 l k^2 + 20 k^3
    with both singular-vector sets (R-SVD), 4 l k^2 - 4 k^3 / 3 for the values alone
    (Golub & Van Loan, Matrix Computations, 4th ed., the SVD work counts); LAPACK's
    divide-and-conquer routine does about this much."""
    *batch, m, n = a_shape
    k, l = min(m, n), max(m, n)
    each = 6 * l * k * k + 20 * k ** 3 if compute_uv else 4 * l * k * k - 4 * k ** 3 // 3
    return math.prod(batch) * each


def _cpu_sdpa_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_sdpa_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


def _shapes(f):
    def counted(*args, out_val=None, **kwargs):
        shape = lambda x: x.shape if isinstance(x, torch.Tensor) else x  # noqa: E731
        return f(*[shape(a) for a in args], out_shape=None,
                 **{k: shape(v) for k, v in kwargs.items()})
    return counted


FLOP_FORMULAS = {
    **flop_registry,
    aten._linalg_svd: _shapes(_svd_flops),
    aten._scaled_dot_product_flash_attention_for_cpu: _shapes(_cpu_sdpa_flops),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _shapes(_cpu_sdpa_backward_flops),
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dtype_of(tensors) -> str:
    for t in tensors:
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return str(tensors[0].dtype).removeprefix("torch.") if tensors else "none"


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class StepCost(TorchDispatchMode):
    """Count FLOPs, bytes moved and operators of what runs inside it; see the module
    docstring. Use around one training step (`with StepCost() as cost: ...`), then
    `cost.result()`."""

    def __init__(self):
        super().__init__()
        self._counts: Counter = Counter()  # (phase, op, dtype, flops, bytes) -> calls
        self._periodic: Counter = Counter()  # (op, dtype, flops, bytes) -> calls per step
        self._in_step = 0
        self._hooks: list = []

    # -- the optimizer phase ------------------------------------------------------
    def _pre_step(self, optimizer, args, kwargs):
        self._in_step += 1

    def _post_step(self, optimizer, args, kwargs):
        self._in_step -= 1

    def __enter__(self):
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)

        self._hooks = [register_optimizer_step_pre_hook(self._pre_step),
                       register_optimizer_step_post_hook(self._post_step)]
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks.clear()

    def phase(self) -> str:
        if _in_backward():
            return "recompute" if torch.is_grad_enabled() else "backward"
        if self._in_step:
            return "optimizer"
        return "forward"

    # -- counting -----------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.count(func, args, kwargs, out, self.phase())
        return out

    def count(self, func, args, kwargs, out, phase: str) -> None:
        packet = func._overloadpacket
        if func.is_view or packet in _NO_DATA:
            return
        kw = {k: v for k, v in kwargs.items() if k != "out"}
        inputs = [t for t in tree_flatten((args, kw))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        read = sum(_nbytes(t) for t in inputs)
        if packet in _WRITE_ONLY and inputs:
            read -= _nbytes(inputs[0])
        moved = read + sum(_nbytes(t) for t in outputs)
        formula = FLOP_FORMULAS.get(packet)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        self._counts[(phase, packet.__name__, _dtype_of(inputs or outputs), flops, moved)] += 1

    def add_periodic(self, optimizer) -> None:
        """Count the work an optimizer does every T-th step only, divided by T (see the
        module docstring); call it outside any fake mode. Known today: GaLore's projector refresh (an SVD of each
        projected weight's gradient every `update_proj_gap` steps); other optimizers
        have none."""
        refresh = getattr(type(optimizer), "_refresh_projector", None)
        if refresh is None:
            return
        from torch._subclasses.fake_tensor import FakeTensorMode

        periodic = StepCost()
        # on fake tensors of its own (outside any other fake mode): the work depends on
        # shapes only, and a real CUDA job's memory is not touched
        with FakeTensorMode(), torch.no_grad(), periodic:
            for group in optimizer.param_groups:
                if group.get("rank") is None or "update_proj_gap" not in group:
                    continue
                for p in group["params"]:
                    # the refresh from a gradient of the weight's shape and dtype
                    refresh({}, torch.zeros(p.shape, dtype=p.dtype), group)
                    gap = group["update_proj_gap"]
                    for (_, op, dtype, flops, moved), n in periodic._counts.items():
                        self._periodic[(op, dtype, flops, moved)] += n / gap
                    periodic._counts.clear()

    # -- results --------------------------------------------------------------------
    def per_op(self) -> list[list]:
        """[phase, operator, dtype, flops, bytes, calls] per distinct operator call
        (phase `recompute` is part of `backward`; `periodic` calls are fractions: 1/T)."""
        rows = [[phase, op, dtype, flops, moved, n]
                for (phase, op, dtype, flops, moved), n in self._counts.items()]
        rows += [["periodic", op, dtype, flops, moved, n]
                 for (op, dtype, flops, moved), n in self._periodic.items()]
        return sorted(rows, key=lambda r: (PHASES.index(r[0]) if r[0] in PHASES else 1.5,
                                           -r[3] * r[5], -r[4] * r[5], r[1]))

    def result(self) -> dict:
        """`{"flops", "bytes_moved", "ops", "phases": {phase: {...}}, "recompute": {...},
        "per_op": [...]}`; a phase appears if anything ran in it."""
        def totals(rows):
            return {"flops": _num(sum(r[3] * r[5] for r in rows)),
                    "bytes_moved": _num(sum(r[4] * r[5] for r in rows)),
                    "ops": _num(sum(r[5] for r in rows))}

        rows = self.per_op()
        phase_of = lambda r: "backward" if r[0] == "recompute" else r[0]  # noqa: E731
        phases = {p: totals([r for r in rows if phase_of(r) == p]) for p in PHASES
                  if any(phase_of(r) == p for r in rows)}
        out = {**totals(rows), "phases": phases}
        recompute = [r for r in rows if r[0] == "recompute"]
        if recompute:
            out["recompute"] = totals(recompute)
        out["per_op"] = rows
        return out


def _num(x):
    """An int where the sum is whole (periodic calls are fractions)."""
    return int(x) if float(x).is_integer() else round(float(x), 4)

"""ROAM: run the training step with its operators in a memory-optimised order.

Shu, Wang, Shi, Zhao, Li, Lu, "ROAM: memory-efficient large DNN training via optimized
operator ordering and memory layout", arXiv 2310.19295. Official code: HuiyaoShu/ROAM
(a planner and a simulator; it has no runtime). This is our implementation, with an
executor: the planned order runs for real.

    first step for a batch shape (and after the shape changes):
        G <- trace the whole step: forward, lm_loss, backward, AdamW update       (make_fx)
             (tracing runs the step, in PyTorch's eager order: the default order)
        tensors, sizes <- storages of every value (views and in-place share)
        order_0 <- PyTorch's eager order
        candidates <- order_0; weight updates early (each parameter's update right
                      after its gradient and its last reader); greedy list schedules
        order <- the candidate with the least simulated peak
        repeat until the solver's budget is spent:                (decomposition)
            W <- a window of the order around its peak
            re-solve W exactly (CP-SAT: one op per step, minimise the window's peak)
            keep it if the window's peak went down, else grow the window
        (graphs with <= exact_max_ops allocating ops: one exact solve of the whole graph)
        layout <- best-fit offsets for that order (reported, not executed)
        module <- the fx graph with its nodes in that order (fx frees every value after
                  its last use, so the order sets the lifetimes the plan predicts)
    every later step:
        step += 1; set the step's AdamW scalars (bias corrections, lr, eps)
        loss <- module(params, exp_avg, exp_avg_sq, scalars, buffers, batch)    (no autograd)

The update is torch's AdamW (decoupled weight decay) in its `capturable` form
(p <- p + m / (sqrt(v) / (sqrt(bc2) * -lr/bc1) + eps / (-lr/bc1))), so parameters match
eager AdamW to rounding; the state lives in a `torch.optim.AdamW` in its usual format.
The learning rate, eps and weight decay are read from the optimizer at every step;
betas and whether weight decay is on are traced in (a change re-traces). Dropout draws
from the same generator in the same op order as the eager step (random ops keep their
order). A parameter that gets no gradient keeps zero moments and is not updated (torch's
AdamW would keep no state for it; the suite's models have none).

Hyperparameters: `planner` (`roam`, `exact`, `greedy`, `update_early`, `default`),
`time_limit` (the solver's budget per plan, in CP-SAT's deterministic time: a count of
its work, the same on any machine and under any load, so a plan is reproducible; a unit
took 2-3 s of wall clock on a 2-core CPU), `window` (allocating ops per first
window), `exact_max_ops`, `layout` (`best_fit`, `first_fit`, `exact`, `none`), `workers`
(solver threads). One micro-batch per step (`max_micro_batches = 1`).

Memory categories: the runner's tracker sees every storage, as for eager training;
inside the captured graph nothing is saved by autograd and no `.grad` is set, so the
step labels them itself (when a tracker is active): what the forward pass makes and
the backward reads is `activation`, a parameter's gradient is `grad`, the rest of what
the step makes is `other`. The first step for a batch shape is the trace (eager order),
and it runs outside the tracker together with the planning: tracing keeps a fake copy
of every value, which the tracker would count. So a memory job's first-step peak shows
only the state it creates; the measured step is a planned one. Under a memory cap the
first step is checked against the cap with the default order's predicted peak: the
traced step really needs the eager order's memory (a limit of tracing by running).

Differences from the paper: windows of the order instead of the nested forward/backward
subtask tree; the order and the layout are solved one after the other, not jointly;
single stream only. Works on fake tensors (`simulate=True`): the trace and the planned
step run on the fake tensors.
"""
from __future__ import annotations

import time

import torch

from methods.roam import graph as stepgraph
from methods.roam import planners
from bench.hooks import CapacityExceeded, active_tracker, untracked
from bench.method import Method, MethodError, require_package

LAYOUTS = ("best_fit", "first_fit", "exact", "none")


class _Compiled:
    """A captured step, its plan, and the modules that run it."""

    def __init__(self, step: stepgraph.AdamWStep, plan: planners.Plan, key):
        self.step, self.plan, self.key = step, plan, key
        self._module = self._labelled = None  # each built when first run
        self.scalars: list = []
        self.inputs: list = []

    @property
    def module(self):
        """The planned module."""
        if self._module is None:
            self._module = stepgraph.reorder(self.step.capture, self.plan.order)
        return self._module

    def labelled(self):
        """The planned module, labelling grads and activations for the tracker."""
        if self._labelled is None:
            self._labelled = stepgraph.reorder(self.step.capture, self.plan.order, label=_label)
        return self._labelled


_TRACKER: list = []  # the tracker the labelled module reports to, while a step runs


def _label(value, category: str) -> None:
    if _TRACKER and isinstance(value, torch.Tensor):
        _TRACKER[-1].label([value], category)


class Roam(Method):
    paper = ("Shu, Wang, Shi, Zhao, Li, Lu, ROAM: memory-efficient large DNN training via "
             "optimized operator ordering and memory layout, arXiv 2310.19295")
    defaults = dict(planner="roam", time_limit=1.0, window=20, exact_max_ops=60,
                    layout="best_fit", workers=2)
    incompatible = frozenset({"checkpointing"})  # recomputation is not part of the traced step
    plans_per_shape = True  # the first step at a batch shape is traced and planned
    max_micro_batches = 1  # it plans one whole training step
    loss_scaling = False  # the traced step's AdamW update takes the gradients unscaled
    shards = False  # not under FSDP2: tracing the step meets the process group its hooks hold
    choices = {"planner": planners.PLANNERS, "layout": LAYOUTS}

    def __init__(self):
        super().__init__()
        self._compiled: _Compiled | None = None

    def _require_solver(self):
        hp = self.hp
        if hp["planner"] in ("roam", "exact") or hp["layout"] == "exact":
            require_package("ortools.sat.python.cp_model", "ortools==9.15.6755", "roam")

    def make_optimizer(self, model):
        self._require_solver()
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                 **self.adam_args, foreach=False)

    def state_tensors(self, optimizer):
        return [v for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor)]

    # -- the step --------------------------------------------------------------------------
    def train_step(self, model, optimizer, batch):
        params, states, values, key = self._count_step(model, optimizer, batch)
        if self._compiled is None or self._compiled.key != key:
            return self._capture_and_plan(model, batch, params, states, values, key)
        c = self._compiled
        for t, x in zip(c.scalars, values.values()):
            t.fill_(x)
        inputs = c.inputs + [batch[k] for k in c.step.batch_keys]
        tracker = active_tracker()
        module = c.labelled() if tracker is not None else c.module
        if tracker is not None:
            _TRACKER.append(tracker)
        try:
            with torch.no_grad():
                return module(*inputs)
        finally:
            if tracker is not None:
                _TRACKER.pop()

    def _count_step(self, model, optimizer, batch):
        """Count a step (AdamW's state made where it is missing, its step counts) -> the
        trained parameters, their states, the step's AdamW scalars, and the key of the
        plan that runs it."""
        self._require_solver()
        group = optimizer.param_groups[0]
        if len(optimizer.param_groups) != 1:
            raise MethodError("roam: the optimizer must have one parameter group")
        params = {k: p for k, p in model.named_parameters() if p.requires_grad}
        states = [self._state(optimizer, p) for p in params.values()]
        for st in states:
            st["step"] += 1
        count = getattr(optimizer, "_roam_step", 0) + 1
        optimizer._roam_step = count
        beta1, beta2 = group["betas"]
        values = stepgraph.adamw_scalars(float(group["lr"]), float(beta1), float(beta2),
                                         float(group["eps"]), float(group["weight_decay"]), count)
        key = (id(model), id(optimizer), tuple(values), (beta1, beta2),
               tuple((k, tuple(v.shape), v.dtype, str(v.device)) for k, v in batch.items()))
        return params, states, values, key

    @staticmethod
    def _scalars(values: dict) -> dict:
        return {k: torch.tensor(v, dtype=torch.float64) for k, v in values.items()}

    @staticmethod
    def _state(optimizer, p):
        state = optimizer.state[p]
        if not state:  # as torch's AdamW initialises it
            from torch.optim.optimizer import _get_scalar_dtype

            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _capture_and_plan(self, model, batch, params, states, values, key):
        hp = self.hp
        self._compiled = None
        tracker = active_tracker()
        scalars = self._scalars(values)
        result: dict = {}
        with untracked():
            t0 = time.perf_counter()
            step = stepgraph.capture_adamw_step(
                model, batch, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                scalars, key[3], params, result=result)
            capture_s = time.perf_counter() - t0
            graph = step.capture.graph
            plan = planners.plan(graph, hp["planner"], float(hp["time_limit"]),
                                 int(hp["exact_max_ops"]), int(hp["window"]), int(hp["workers"]))
            if not graph.is_topological(plan.order):
                raise RuntimeError("roam: the planner returned an order that breaks a dependency")
            layout_report = self._layout(graph, plan)
            compiled = _Compiled(step, plan, key)
        if tracker is not None and tracker.capacity_bytes is not None:
            # the traced step ran in eager order: it needed the default order's peak
            needed = tracker.current + plan.default_peak - graph.resident_bytes
            if needed > tracker.capacity_bytes:
                raise CapacityExceeded(
                    f"roam's first step (the traced eager step) needs {needed:,} bytes, over "
                    f"the capacity of {tracker.capacity_bytes:,} bytes")
        n = len(step.param_names)
        buffers = {**dict(model.named_buffers()),
                   **{k: p for k, p in model.named_parameters() if k not in params}}
        compiled.scalars = list(scalars.values())
        compiled.inputs = ([p.detach() for p in params.values()]
                           + [s["exp_avg"] for s in states] + [s["exp_avg_sq"] for s in states]
                           + compiled.scalars + [buffers[k].detach() for k in step.buffer_names])
        assert len(compiled.inputs) == 3 * n + len(scalars) + len(step.buffer_names)
        self._compiled = compiled
        summary = graph.summary()
        self.report = {
            "graph_ops": summary["ops"],
            "graph_tensors": summary["tensors"],
            "graph_temporaries": summary["temporaries"],
            "allocating_ops": sum(not graph.is_free(i) for i in range(len(graph))),
            "planner": plan.planner,
            "plan_start": plan.stats.get("start", plan.planner),
            "plan_mode": plan.stats.get("mode", "heuristic"),
            "solver_status": plan.status,
            "capture_s": round(capture_s, 3),
            "plan_s": round(plan.seconds, 3),
            "plan_work": plan.stats.get("work"),  # the solver's deterministic time
            "predicted_default_peak_bytes": plan.default_peak,
            "predicted_peak_bytes": plan.peak,
            **{f"predicted_{k}_peak_bytes": v for k, v in plan.candidates.items() if k != "default"},
            **layout_report,
        }
        if step.unused:
            self.report["params_without_grad"] = len(step.unused)
        return result["loss"]

    def _layout(self, graph, plan) -> dict:
        kind = self.hp["layout"]
        if kind == "none":
            return {}
        t0 = time.perf_counter()
        first = planners.first_fit_layout(graph, plan.order)
        if kind == "first_fit":
            chosen = first
        elif kind == "best_fit":
            chosen = planners.best_fit_layout(graph, plan.order)
        else:
            chosen, _ = planners.exact_layout(graph, plan.order, float(self.hp["time_limit"]),
                                              int(self.hp["workers"]))
        return {"layout": chosen.method, "layout_peak_address_bytes": chosen.peak_address,
                "first_fit_peak_address_bytes": first.peak_address,
                "layout_fragmentation": round(chosen.fragmentation, 6),
                "layout_s": round(time.perf_counter() - t0, 3)}


METHOD = Roam

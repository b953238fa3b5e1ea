"""LOMO: LOw-Memory Optimization, plain SGD fused into backward, each gradient freed at once.

Lv, Yang, Liu, Gao, Guo, Qiu, "Full Parameter Fine-tuning for Large Language Models with
Limited Resources", ACL 2024, arXiv 2306.09782. Code: OpenLMLab/LOMO (PyPI `lomo-optim`
0.1.1, `lomo_optim.Lomo`). This is our implementation of the paper's Algorithm 1, on the
suite's gradient release (methods/_common/release.py, shared with AdamA and per-layer
GaLore):

    for t = 1..T:
        loss <- L(f(x; theta))
        backward; for each parameter theta_i, as soon as its gradient g_i is complete:
            theta_i <- theta_i - lr g_i              (SGD: no optimizer state at all)
            g_i <- None                              (freed before the next one exists)

So at most one parameter's gradient is alive (AdamW keeps all of them) and there is no
optimizer state: the persistent memory is the parameters alone. As in `lomo-optim`, the
update runs in float32 for half-precision parameters (the weight is upcast, updated and
rounded back) and decoupled weight decay `p <- p (1 - lr wd)` comes first.

Gradient clipping. `clip_grad_value` clamps each element (free: it needs one gradient).
`clip_grad_norm` (global norm, the authors' configs use 1.0) needs every gradient's norm
before the first update, so, as the paper does, the step runs backward twice:
a first pass with `retain_graph=True` that only sums the squared norms of the released
gradients, then the update pass with every gradient scaled by
min(1, clip_grad_norm / (||g|| + 1e-6)). The cost: one more backward (about 1 + 2 + 2 = 5
forward-units of compute per step instead of 3: ~1.7x the step time, an estimate from
operation counts, not a measurement), and the
activations saved for backward stay alive until the second pass ends (a single backward
frees them as it goes), so the peak is held over both passes; the gradients are still
released one at a time in both passes. Default None: the method's memory row is LOMO's
own; `lomo@clip_grad_norm=1.0` is the authors' setting (list both in a suite's `methods`
to measure them side by side).

Left out: the fp16 dynamic loss scaler of `lomo-optim` (the suite trains in float32 or
bfloat16, where scaling the loss by a power of two changes no gradient), and DeepSpeed
ZeRO-3 partitioning (one process here).

Gradient accumulation is impossible in this form: the update runs inside every backward,
so `micro_batches` > 1 is refused (`max_micro_batches = 1`).
"""
from __future__ import annotations

import torch

from bench.method import Method, lm_loss
from methods._common.release import GradientRelease


def compute_dtype(p: torch.Tensor) -> torch.dtype:
    """The update's precision: float32 for half-precision parameters (as `lomo-optim`
    does), the parameter's own dtype otherwise (float64 stays float64)."""
    return torch.promote_types(p.dtype, torch.float32)


class LomoOptimizer(torch.optim.Optimizer):
    """SGD whose per-parameter update runs inside backward (a gradient-release hook).

    Call `fused_backward(loss)` instead of `loss.backward()` + `step()`: the hooks update
    every parameter and free its gradient; there is nothing left to step afterwards.
    Subclasses (AdaLomo) replace `_update`.
    """

    def __init__(self, params, lr=1e-2, weight_decay=0.0, clip_grad_norm=None,
                 clip_grad_value=None):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.clip_grad_norm, self.clip_grad_value = clip_grad_norm, clip_grad_value
        self._group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        self._gather_norm = False  # True during the norm-only first pass
        self._sq_norms: list[torch.Tensor] = []
        self._clip_coef: torch.Tensor | None = None
        self._release = GradientRelease(
            [p for g in self.param_groups for p in g["params"]], self._on_grad)

    # -- the step ----------------------------------------------------------------------
    def fused_backward(self, loss: torch.Tensor) -> None:
        """Backward with every update fused into it (twice with global-norm clipping)."""
        self._begin_step()
        if self.clip_grad_norm is not None:
            self._gather_norm, self._sq_norms = True, []
            loss.backward(retain_graph=True)  # only the norms; gradients are released
            self._gather_norm = False
            total = torch.stack(self._sq_norms).sum().sqrt()
            self._sq_norms = []
            self._clip_coef = (self.clip_grad_norm / (total + 1e-6)).clamp(max=1.0)
        try:
            loss.backward()  # the hooks update and release every gradient
        finally:
            self._clip_coef = None

    def _begin_step(self) -> None:
        pass

    def _on_grad(self, p: torch.Tensor) -> None:  # a GradientRelease hook: no_grad, then p.grad = None
        g = p.grad.to(compute_dtype(p))  # the same tensor when p is float32/float64
        if self._gather_norm:
            self._sq_norms.append(g.square().sum())
            return
        if self.clip_grad_value is not None:
            g.clamp_(-self.clip_grad_value, self.clip_grad_value)
        if self._clip_coef is not None:
            g.mul_(self._clip_coef)
        self._update(p, g, self._group_of[id(p)])

    def _update(self, p: torch.Tensor, g: torch.Tensor, group: dict) -> None:
        """theta <- theta (1 - lr wd) - lr g, in `compute_dtype(p)`."""
        w = p.to(compute_dtype(p))  # p itself unless p is half precision
        if group["weight_decay"]:
            w.mul_(1 - group["lr"] * group["weight_decay"])
        w.add_(g, alpha=-group["lr"])
        if w is not p:
            p.copy_(w)

    @torch.no_grad()
    def step(self, closure=None):
        return None  # every update already ran inside backward

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # gradients are released inside backward


class Lomo(Method):
    paper = ("Lv et al., Full Parameter Fine-tuning for Large Language Models with Limited "
             "Resources (LOMO), ACL 2024, arXiv 2306.09782")
    # lr 0.03 with a linear schedule in the authors' SuperGLUE configs; SGD from scratch
    # needs a sweep (config). weight_decay 0 as there.
    defaults = dict(lr=3e-2, weight_decay=0.0, clip_grad_norm=None, clip_grad_value=None)
    max_micro_batches = 1  # the update runs inside every backward
    # float16 runs unscaled: each update is applied inside backward, before an overflow
    # could be seen (the authors' two-pass overflow check is not built); inf/nan: diverged
    loss_scaling = False
    ranges = {"clip_grad_norm": "(0, inf)"}  # or None: no clipping

    def make_optimizer(self, model):
        hp = self.hp
        return LomoOptimizer(model.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"],
                             clip_grad_norm=hp["clip_grad_norm"],
                             clip_grad_value=hp["clip_grad_value"])

    def train_step(self, model, optimizer, batch):
        loss = lm_loss(model, batch)
        optimizer.fused_backward(loss)
        return loss.detach()

    def state_tensors(self, optimizer):
        return []  # SGD: no state


METHOD = Lomo

"""Adafactor: a rank-1 factored second moment (row and column means of G^2) and no first
moment; about m + n state elements per m x n weight instead of Adam's 2 m n.

Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
ICML 2018, arXiv 1804.04235. This method is torch's `torch.optim.Adafactor` (the
algorithm, its state and its defaults), with one change that lets it run on fake tensors.
torch's algorithm box, for a weight W, G in R^{n x m} (factored over the last two
dimensions; vectors keep a full V):

    b2_t  <- 1 - t^tau                          (tau = beta2_decay = -0.8)
    rho_t <- min(lr, 1 / sqrt(t))               (relative step size; the paper's 1e-2 = lr)
    a_t   <- max(eps2, RMS(W_{t-1})) rho_t      (parameter-scale step)
    W     <- W - lr wd W                        (decoupled weight decay)
    R_t   <- b2_t R_{t-1} + (1 - b2_t) mean_cols(G^2)            (n x 1)
    C_t   <- b2_t C_{t-1} + (1 - b2_t) mean_rows(G^2)            (1 x m)
    V_t   <- R_t C_t / max(mean(R_t), eps1)     (vectors: V_t <- b2_t V_{t-1} + (1 - b2_t) G^2)
    U_t   <- G / sqrt(max(V_t, eps1^2))
    U^_t  <- U_t / max(1, RMS(U_t) / d)         (update clipping, d = 1)
    W     <- W - a_t U^_t

This is the paper's Algorithm 4 (factored) / 2 (vectors) with its recommended settings
(no first moment, b2_t = 1 - t^-0.8, relative step min(1e-2, 1/sqrt(t)), parameter
scaling with eps2 = 1e-3, clipping d = 1), except where torch places eps1: the paper adds
eps1 (1e-30) to G^2 before factoring; torch clamps mean(R) and V (default eps1 = the
dtype's machine epsilon, so that eps1^2 is representable). The row and column means
(torch) equal the paper's sums up to the constant that cancels in R C / sum(R).

What breaks on fake tensors (checked with torch 2.13): not the step count (a 0-d tensor
made by `torch.tensor`, whose value fake tensors track as a constant) but the two
`.item()` calls of `_single_tensor_adafactor`: RMS(W) for a_t and RMS(U) for the
clipping, which fake tensors do not have (DataDependentOutputException on
aten._local_scalar_dense). `ValueFreeAdafactor` below computes both as 0-d tensors and
scales U^ in place (the same temporaries as torch's step), and keeps the step count as a
Python int (torch's is a 0-d float32 tensor per parameter: 4 bytes per parameter tensor
that this version does not keep). Its update is torch's (tests/methods/test_adafactor.py
checks it against torch.optim.Adafactor to rounding, and against the formula above in
float64).

State per parameter, in the parameter's dtype: an n x m weight keeps R (n) and C (m);
a vector of n keeps V (n). No first moment.
"""
from __future__ import annotations

import math

import torch

from bench.method import Method


def state_elements(shape) -> int:
    """Optimizer-state elements of one parameter of `shape`."""
    if len(shape) >= 2:
        lead = math.prod(shape[:-2])
        return lead * (shape[-2] + shape[-1])
    return math.prod(shape)


def _wide(scalar: torch.Tensor) -> torch.Tensor:
    """A half-precision 0-d result in float32 (torch reads these into Python floats)."""
    return scalar.float() if scalar.dtype in (torch.float16, torch.bfloat16) else scalar


class ValueFreeAdafactor(torch.optim.Adafactor):
    """torch.optim.Adafactor whose step reads no tensor value (see the module docstring).
    Same constructor; `foreach` and `maximize` are not supported."""

    def __init__(self, params, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0,
                 weight_decay=0.0):
        super().__init__(params, lr=lr, beta2_decay=beta2_decay, eps=tuple(eps), d=d,
                         weight_decay=weight_decay)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = 0
            if p.dim() > 1:  # torch's shapes: R is (..., n, 1), C is (..., 1, m)
                state["row_var"] = p.new_zeros(p.shape[:-1] + (1,))
                state["col_var"] = p.new_zeros(p.shape[:-2] + (1,) + p.shape[-1:])
            else:
                state["variance"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, d = group["lr"], group["weight_decay"], group["d"]
            eps1, eps2 = group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self._state(p)
                state["step"] += 1
                t = state["step"]
                e1 = torch.finfo(p.dtype).eps if eps1 is None else eps1
                one_minus_beta2 = t ** group["beta2_decay"]
                rho = min(lr, 1 / t ** 0.5)
                alpha = (_wide(p.norm()) / math.sqrt(p.numel())).clamp_(min=eps2).mul_(rho)
                if wd != 0:
                    p.mul_(1 - lr * wd)
                if grad.dim() > 1:
                    row_var, col_var = state["row_var"], state["col_var"]
                    row_var.lerp_(torch.norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1)),
                                  one_minus_beta2)
                    col_var.lerp_(torch.norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2)),
                                  one_minus_beta2)
                    var = row_var @ col_var
                    var.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=e1))
                else:
                    state["variance"].lerp_(grad * grad, one_minus_beta2)
                    var = state["variance"].clone()
                update = var.clamp_(min=e1 * e1).rsqrt_().mul_(grad)
                clip = (_wide(update.norm()) / (math.sqrt(update.numel()) * d)).clamp_(min=1.0)
                update.mul_(alpha.div_(clip))
                p.sub_(update)
        return loss


class Adafactor(Method):
    shards = False  # not under FSDP2: its factored update squares a DTensor in place (aten.pow_: no placement)
    paper = ("Shazeer & Stern, Adafactor: Adaptive Learning Rates with Sublinear Memory Cost, "
             "ICML 2018, arXiv 1804.04235 (torch.optim.Adafactor)")
    # torch's defaults = the paper's recommended settings (lr is the cap of rho_t)
    defaults = dict(lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0, weight_decay=0.0)

    def make_optimizer(self, model):
        hp = self.hp
        return ValueFreeAdafactor(model.parameters(), lr=hp["lr"], beta2_decay=hp["beta2_decay"],
                                  eps=tuple(hp["eps"]), d=hp["d"], weight_decay=hp["weight_decay"])


METHOD = Adafactor

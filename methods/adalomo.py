"""AdaLomo: LOMO with an adaptive learning rate from a factored second moment.

Lv, Yan, Guo, Yan, Zhou, Qiu, "AdaLomo: Low-memory Optimization with Adaptive Learning
Rate", Findings of ACL 2024, arXiv 2310.10195. Code: OpenLMLab/LOMO (PyPI `lomo-optim`
0.1.1, `lomo_optim.AdaLomo`). Our implementation of the paper's Algorithm 1, fused into
backward on the suite's gradient release exactly as methods/lomo.py (one gradient alive
at a time). For a weight theta in R^{n x m} with gradient g, at step t (1, 2, ...):

    beta_t <- 1 - t^(-0.8)                          (Adafactor's decay; beta_1 = 0)
    u <- g^2 + eps1                                 (eps1 = 1e-30)
    r_t <- beta_t r_{t-1} + (1 - beta_t) mean_cols(u)       (n: the row statistic)
    c_t <- beta_t c_{t-1} + (1 - beta_t) mean_rows(u)       (m: the column statistic)
    v_t <- r_t c_t^T / mean(r_t)                    (rank-1 estimate of E[g^2])
    u_t <- g / sqrt(v_t)
    u_t <- u_t / max(1, RMS(u_t) / d)               (grouped update normalisation: per
                                                     parameter, not a global norm; d = 1)
    alpha_t <- lr max(eps2, RMS(theta_{t-1}))       (relative step size; eps2 = 1e-3)
    theta_t <- theta_{t-1} (1 - alpha_t wd) - alpha_t u_t
    g <- None                                       (released at once)

A 1-D parameter (bias, norm) keeps an unfactored v_t <- beta_t v_{t-1} + (1 - beta_t) u
and u_t = g / sqrt(v_t). A tensor with more than two dimensions is factored over its last
two (rows = all leading dimensions), as Adafactor does; `lomo-optim` handles only 1-D and
2-D weights, which is all a transformer has.

State: r (n) and c (m) per matrix, v (n) per vector, in float32 (float64 for a float64
model), i.e. 4 (n + m) bytes for an n x m weight instead of AdamW's 8 n m; no first
moment. The grouped normalisation replaces LOMO's global-norm clipping, so AdaLomo needs
no second backward (the paper's point; `clip_grad_norm` is still available and costs
what methods/lomo.py says). The step counter is a Python int and no value is read, so the
step runs on fake tensors.

Left out of `lomo-optim`'s AdaLomo: its fixed loss scale (2^10: multiply the loss,
divide each gradient; a power of two, so it changes nothing in float32/bfloat16, and it
exists for fp16, which the suite does not train in), DeepSpeed ZeRO-3, and its `.cuda()`
state allocation (which is why the package cannot run on a CPU: our state lives on the
parameter's device). One micro-batch per step, as LOMO.
"""
from __future__ import annotations

import math

import torch

from methods.lomo import Lomo, LomoOptimizer, compute_dtype


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.norm(2) / math.sqrt(x.numel())


class AdaLomoOptimizer(LomoOptimizer):
    """AdaLomo's update (module docstring) from the gradient-release hook."""

    def __init__(self, params, lr=1e-3, weight_decay=0.0, eps1=1e-30, eps2=1e-3,
                 clip_threshold=1.0, decay_rate=-0.8, clip_grad_norm=None, clip_grad_value=None):
        super().__init__(params, lr=lr, weight_decay=weight_decay, clip_grad_norm=clip_grad_norm,
                         clip_grad_value=clip_grad_value)
        self.eps1, self.eps2 = eps1, eps2
        self.clip_threshold, self.decay_rate = clip_threshold, decay_rate
        self.t = 0  # a Python int: nothing to read back (and none on fake tensors)
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._init_state(p)

    def _init_state(self, p: torch.Tensor) -> None:
        state, dtype = self.state[p], compute_dtype(p)
        if p.dim() >= 2:
            state["exp_avg_sq_row"] = torch.zeros(p.shape[:-1], dtype=dtype, device=p.device)
            state["exp_avg_sq_col"] = torch.zeros(p.shape[:-2] + p.shape[-1:], dtype=dtype,
                                                  device=p.device)
        else:
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=dtype, device=p.device)

    def _begin_step(self) -> None:
        self.t += 1

    def _update(self, p: torch.Tensor, g: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        beta = 1.0 - self.t ** self.decay_rate
        u = g.square().add_(self.eps1)
        if p.dim() >= 2:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            row.mul_(beta).add_(u.mean(dim=-1), alpha=1 - beta)
            col.mul_(beta).add_(u.mean(dim=-2), alpha=1 - beta)
            del u
            r = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
            update = r * col.rsqrt().unsqueeze(-2)
            update.mul_(g)
        else:
            v = state["exp_avg_sq"]
            v.mul_(beta).add_(u, alpha=1 - beta)
            del u
            update = v.rsqrt().mul_(g)
        update.div_((_rms(update) / self.clip_threshold).clamp_(min=1.0))
        w = p.to(compute_dtype(p))
        alpha = group["lr"] * _rms(w).clamp(min=self.eps2)  # a 0-d tensor: no value is read
        if group["weight_decay"]:
            w.mul_(1 - alpha * group["weight_decay"])
        w.sub_(update.mul_(alpha))
        if w is not p:
            p.copy_(w)


class AdaLomo(Lomo):
    shards = False  # not under FSDP2: its fused update mixes the sharded gradient (a DTensor) with plain-tensor state
    paper = ("Lv et al., AdaLomo: Low-memory Optimization with Adaptive Learning Rate, "
             "Findings of ACL 2024, arXiv 2310.10195")
    defaults = dict(lr=1e-3, weight_decay=0.0, eps1=1e-30, eps2=1e-3, clip_threshold=1.0,
                    decay_rate=-0.8, clip_grad_norm=None, clip_grad_value=None)
    ranges = {**Lomo.ranges, "decay_rate": "(-inf, 0)"}  # beta_t = 1 - t^decay_rate

    def make_optimizer(self, model):
        hp = self.hp
        return AdaLomoOptimizer(model.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"],
                                eps1=hp["eps1"], eps2=hp["eps2"],
                                clip_threshold=hp["clip_threshold"], decay_rate=hp["decay_rate"],
                                clip_grad_norm=hp["clip_grad_norm"],
                                clip_grad_value=hp["clip_grad_value"])

    def state_tensors(self, optimizer):
        return [v for state in optimizer.state.values() for v in state.values()]


METHOD = AdaLomo

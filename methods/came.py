"""CAME: Adafactor's factored second moment, plus a full first moment whose update is
scaled by the factored "instability" (confidence) of that moment; state about m n + 2 (m + n)
per m x n weight instead of Adam's 2 m n.

Luo, Ren, Zheng, Jiang, Jiang, You, "CAME: Confidence-guided Adaptive Memory Efficient
Optimization", ACL 2023, arXiv 2307.02047. Code: yangluo7/CAME (PyPI came-pytorch 0.1.3,
run as the peer methods/came_pytorch.py). This is our implementation of the paper's
Algorithm 1. For a weight G, W in R^{n x m} (factored over its last two dimensions), with
1_m a vector of m ones:

    r_t <- b2 r_{t-1} + (1 - b2) (G_t^2 + eps1 1_n 1_m^T) 1_m          (n: row sums)
    c_t <- b2 c_{t-1} + (1 - b2) 1_n^T (G_t^2 + eps1 1_n 1_m^T)        (m: column sums)
    v_t <- r_t c_t / (1_n^T r_t)                                      (rank-1 second moment)
    u_t <- G_t / sqrt(v_t)
    u^_t <- u_t / max(1, RMS(u_t) / d)                                (update clipping)
    m_t <- b1 m_{t-1} + (1 - b1) u^_t
    U_t <- (u^_t - m_t)^2                                             (instability)
    R_t <- b3 R_{t-1} + (1 - b3) (U_t + eps2 1_n 1_m^T) 1_m
    C_t <- b3 C_{t-1} + (1 - b3) 1_n^T (U_t + eps2 1_n 1_m^T)
    S_t <- R_t C_t / (1_n^T R_t)                                      (factored confidence)
    W_t <- W_{t-1} - lr wd W_{t-1}                                    (decoupled weight decay)
    W_t <- W_t - lr m_t / sqrt(S_t)

No bias correction (as the paper and the package). The factors are kept as means, not sums
(r / m and c / n): v_t and S_t are the same, as the package does. Vectors (biases, norms,
1-D parameters) are not factored: v_t is a full EMA of G^2 + eps1, u^_t as above, and the
step is W <- W - lr m_t (no confidence term), as in the package.

Defaults: the authors' README (lr 2e-4, weight decay 1e-2, betas (0.9, 0.999, 0.9999),
eps (1e-30, 1e-16)) and d = 1 (`clip_threshold`); `betas` and `eps` are the three betas
and the two epsilons, as the package names them.

State, in the parameter's dtype (the arithmetic runs in float32 for half-precision
parameters): an n x m weight keeps m_t (n m), r, R (n each), c, C (m each): n m + 2 (n + m)
elements; a vector of n keeps m_t and v_t: 2 n. The step count is a Python int. Nothing
in the step reads a tensor's value, so it runs on fake tensors (the simulated tier).

Where this differs from came-pytorch 0.1.3: the package keeps float32 state for bfloat16
and float16 parameters (we keep the parameter's dtype, as torch's AdamW and the suite's
baseline do; for float32 parameters the two keep the same state); it also stores an
unused 0-d tensor `RMS` (the parameter's RMS) per parameter, which we do not.
"""
from __future__ import annotations

import math

import torch

from bench.method import Method
from methods._common.optim import PerParameterOptimizer

HALF = (torch.float16, torch.bfloat16)


def state_elements(shape) -> int:
    """Optimizer-state elements of one parameter of `shape` (see the module docstring)."""
    numel = math.prod(shape)
    if len(shape) >= 2:
        rows, cols = math.prod(shape[:-1]), math.prod(shape[:-2]) * shape[-1]
        return numel + 2 * (rows + cols)
    return 2 * numel


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.norm() / math.sqrt(x.numel())


def _factored_rsqrt(row: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """1 / sqrt(row col / mean(row)) as an outer product (row: ... x n, col: ... x m)."""
    r = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
    return r * col.unsqueeze(-2).rsqrt()


class CAMEOptimizer(PerParameterOptimizer):
    """CAME; see the module docstring. State keys as came-pytorch's: `exp_avg`,
    `exp_avg_sq_row`, `exp_avg_sq_col`, `exp_avg_res_row`, `exp_avg_res_col` (matrices),
    `exp_avg_sq` (vectors), `step` (a Python int)."""

    def __init__(self, params, lr=2e-4, betas=(0.9, 0.999, 0.9999), eps=(1e-30, 1e-16),
                 clip_threshold=1.0, weight_decay=0.0):
        # three betas and two eps (the option's type); their values: CAME.ranges
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=tuple(eps),
                                      clip_threshold=clip_threshold, weight_decay=weight_decay))

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        if p.dim() >= 2:
            rows, cols = p.shape[:-1], p.shape[:-2] + p.shape[-1:]
            for key, shape in (("exp_avg_sq_row", rows), ("exp_avg_sq_col", cols),
                               ("exp_avg_res_row", rows), ("exp_avg_res_col", cols)):
                state[key] = p.new_zeros(shape)
        else:
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return state

    def _update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p] or self._init_state(p)
        state["step"] += 1
        b1, b2, b3 = group["betas"]
        eps1, eps2 = group["eps"]
        lr = group["lr"]
        half = p.dtype in HALF
        # the arithmetic in float32 for half precisions; the state stays in p's dtype
        work = {k: v.float() if half else v for k, v in state.items() if isinstance(v, torch.Tensor)}
        g = p.grad.float() if half else p.grad
        factored = p.dim() >= 2

        sq = g * g + eps1
        if factored:
            work["exp_avg_sq_row"].mul_(b2).add_(sq.mean(dim=-1), alpha=1 - b2)
            work["exp_avg_sq_col"].mul_(b2).add_(sq.mean(dim=-2), alpha=1 - b2)
            del sq
            u = _factored_rsqrt(work["exp_avg_sq_row"], work["exp_avg_sq_col"]).mul_(g)
        else:
            work["exp_avg_sq"].mul_(b2).add_(sq, alpha=1 - b2)
            del sq
            u = work["exp_avg_sq"].rsqrt().mul_(g)
        u.div_((_rms(u) / group["clip_threshold"]).clamp_(min=1.0))
        m = work["exp_avg"]
        m.mul_(b1).add_(u, alpha=1 - b1)
        if factored:
            res = u.sub_(m).square_().add_(eps2)  # u is not needed any more: reuse it
            work["exp_avg_res_row"].mul_(b3).add_(res.mean(dim=-1), alpha=1 - b3)
            work["exp_avg_res_col"].mul_(b3).add_(res.mean(dim=-2), alpha=1 - b3)
            del res, u
            step = _factored_rsqrt(work["exp_avg_res_row"], work["exp_avg_res_col"]).mul_(m)
        else:
            del u
            step = m
        if group["weight_decay"]:
            p.mul_(1 - lr * group["weight_decay"])
        p.add_(step, alpha=-lr)  # a float32 step into a half-precision p rounds once
        if half:
            for key, value in work.items():
                state[key].copy_(value)


class CAME(Method):
    paper = ("Luo et al., CAME: Confidence-guided Adaptive Memory Efficient Optimization, "
             "ACL 2023, arXiv 2307.02047")
    defaults = dict(lr=2e-4, betas=(0.9, 0.999, 0.9999), eps=(1e-30, 1e-16), weight_decay=0.01,
                    clip_threshold=1.0)
    ranges = {"betas": "[0, 1)", "eps": "[0, inf)"}  # each of the three betas, both eps

    def make_optimizer(self, model):
        hp = self.hp
        return CAMEOptimizer(model.parameters(), lr=hp["lr"], betas=tuple(hp["betas"]),
                             eps=tuple(hp["eps"]), clip_threshold=hp["clip_threshold"],
                             weight_decay=hp["weight_decay"])


METHOD = CAME

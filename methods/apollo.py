"""APOLLO: AdamW moments kept only in a random rank-r projection of the gradient, used
to compute a channel-wise scaling of the raw gradient; state 2 r max(m, n) per m x n
weight (the projection is regenerated from a seed, not stored).

Zhu, Zhang, Cong, Liu, Park, Chandra, Long, Pan, Wang, Lee, "APOLLO: SGD-like Memory,
AdamW-level Performance", MLSys 2025, arXiv 2412.05270. Code: zhuhanqing/APOLLO (PyPI
apollo-torch 1.0.3, run as the peer methods/apollo_torch.py). This is our implementation
of the paper's Algorithm 1 (AdamW with APOLLO), with the details of the authors' code.
For a targeted weight W, G in R^{m x n}, the smaller side projected (m >= n: from the
right; the case m < n is the transpose: R = P^T G, P of m x r, factors per column):

    t <- 0;  M, V <- 0 in R^{m x r};  seed <- the parameter's index (1, 2, ... in order)
    for each step:
        if t mod T = 0 and t > 0:  seed <- next(seed)          (T = update_proj_gap)
        Q <- N(0, 1/r)^{r x n} drawn from `seed`               (regenerated every step)
        R <- G Q^T                                             (m x r)
        M <- b1 M + (1 - b1) R ;  V <- b2 V + (1 - b2) R^2 ;  t <- t + 1
        R~ <- M / (sqrt(V) + eps)
        s_i <- ||R~[i, :]|| / (||R[i, :]|| + 1e-8)             (channel: one per row i)
        s   <- ||R~|| / (||R|| + 1e-8)                         (tensor: APOLLO-Mini)
        G~ <- G diag(s)  (rows scaled by s_i; tensor: G s)
        norm-growth limiter (Fira): if t > 1,
            G~ <- G~ / max(||G~|| / (N + 1e-8), gamma) * gamma,  gamma = 1.01
        N <- ||G~||                                            (after the limiter)
        W <- W - lr sqrt(alpha) sqrt(1 - b2^t) / (1 - b1^t) G~  (alpha = `scale`)
        W <- W - lr wd W                                       (decoupled, after the update)

`scale` is the authors' `apollo_scale` and enters as sqrt(scale), as in their code: 1 for
APOLLO (rank 256, channel-wise), 128 for APOLLO-Mini (rank 1, tensor-wise; the paper's
"scale the update by sqrt(128)"). The bias correction multiplies the whole step (the
code's step size), not R~. Every other parameter (embeddings, norms, LM head, biases) is
AdamW with the code's formula: W <- W - lr sqrt(1 - b2^t) / (1 - b1^t) M / (sqrt(V) + eps),
then W <- W - lr wd W.

Which weights: those GaLore projects (methods/_common/lowrank.py `split_params`:
`nn.Linear` and GPT-2's `Conv1D` in attention and MLP blocks), as the authors'
pre-training script. The rank is not clamped (as the authors' random projector): a rank
above min(m, n) keeps a projected space larger than the weight, i.e. more state than
AdamW; the tiny models (width 128) need a smaller rank than 256 to save anything (the
optimizers-memory suite runs `apollo@rank=32` beside the default).

The seeds: the first period's projection is the package's (its seed is the parameter's
1-based index and its matrix `torch.randn(..., generator=Generator().manual_seed(seed))`
in float32, / sqrt(r), cast to the parameter's dtype), so the two run the same first
T steps. `next(seed)` here is Python's `random.Random(seed).getrandbits(63)` (the
package draws it with torch's generator and reads it back with `.tolist()`, which fake
tensors cannot do); any independent seed serves the algorithm.

Defaults: the authors' LLaMA pre-training scripts (lr 0.01, rank 256, T = 200, scale 1,
channel-wise, weight decay 0) and their code's AdamW defaults (betas (0.9, 0.999),
eps 1e-6).

State, in the parameter's dtype: a projected m x n weight keeps M and V (r x max(m, n)
each) and N (a 0-d tensor): 2 r max(m, n) + 1 elements; the step and the seed are Python
ints. Other parameters keep AdamW's 2 numel. Nothing in the step reads a tensor's value
(the limiter's max is a clamp), so it runs on fake tensors. Transient: Q (r x min(m, n),
float32 then the parameter's dtype), R, R~ and G~ (the size of G).
"""
from __future__ import annotations

import math
import random

import torch

from bench.method import Method, MethodError
from methods._common.lowrank import TARGET_MODULES, split_params
from methods._common.optim import PerParameterOptimizer

SCALE_TYPES = ("channel", "tensor")
LIMITER_GAMMA = 1.01


def next_seed(seed: int) -> int:
    return random.Random(seed).getrandbits(63)


def projected_shape(shape, rank: int) -> tuple[int, int]:
    m, n = shape
    return (m, rank) if m >= n else (rank, n)


def state_elements(shape, rank: int | None) -> int:
    """Optimizer-state elements of one parameter (rank None: not projected, AdamW)."""
    if rank is None:
        return 2 * math.prod(shape)
    m, n = projected_shape(shape, rank)
    return 2 * m * n + 1


class APOLLOAdamW(PerParameterOptimizer):
    """AdamW; a parameter group with a `rank` (not None) runs APOLLO on its 2-D weights.
    Group keys as apollo-torch's: `rank`, `update_proj_gap`, `scale`, `scale_type`."""

    def __init__(self, params, lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                 rank=None, update_proj_gap=200, scale=1.0, scale_type="channel"):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      rank=rank, update_proj_gap=update_proj_gap, scale=scale,
                                      scale_type=scale_type))
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                self.state[p]["seed"] = index  # as the package: 1, 2, ... over all groups
            if group["rank"] is None:  # rank, update_proj_gap, scale_type: APOLLO.choices/ranges
                continue
            for p in group["params"]:
                if p.dim() != 2:
                    raise MethodError(f"apollo: only 2-D weights can be projected, got shape "
                                      f"{tuple(p.shape)}")

    @staticmethod
    def projection(shape, rank: int, seed: int, like: torch.Tensor) -> torch.Tensor:
        """Q (r x n, m >= n) or P (m x r, m < n), N(0, 1/r), drawn from `seed`."""
        m, n = shape
        size = (rank, n) if m >= n else (m, rank)
        gen = torch.Generator(device=like.device).manual_seed(seed)
        q = torch.randn(size, generator=gen, device=like.device, dtype=torch.float32) / math.sqrt(rank)
        return q if like.dtype == torch.float32 else q.to(like.dtype)

    def _update(self, p: torch.Tensor, group: dict) -> None:
        g = p.grad
        state = self.state[p]
        projected = group["rank"] is not None
        if "step" not in state:
            state["step"] = 0
            shape = projected_shape(p.shape, group["rank"]) if projected else p.shape
            state["exp_avg"] = p.new_zeros(shape)
            state["exp_avg_sq"] = p.new_zeros(shape)
        t = state["step"]
        b1, b2 = group["betas"]
        lr, m, v = group["lr"], state["exp_avg"], state["exp_avg_sq"]
        if projected:
            if t > 0 and t % group["update_proj_gap"] == 0:
                state["seed"] = next_seed(state["seed"])
            q = self.projection(p.shape, group["rank"], state["seed"], g)
            right = p.shape[0] >= p.shape[1]
            r = g @ q.T if right else q.T @ g
            del q
        else:
            r = g
        m.mul_(b1).add_(r, alpha=1 - b1)
        v.mul_(b2).addcmul_(r, r, value=1 - b2)
        t += 1
        state["step"] = t
        step_size = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        denom = v.sqrt().add_(group["eps"])
        normalized = m / denom  # then p.add_, as the authors' code (not addcdiv: the same rounding)
        if not projected:
            p.add_(normalized, alpha=-step_size)
        else:
            if group["scale_type"] == "channel":
                dim = 1 if right else 0  # the projected (rank) side
                s = normalized.norm(dim=dim) / (r.norm(dim=dim) + 1e-8)
                s = s.unsqueeze(1) if right else s
            else:
                s = normalized.norm() / (r.norm() + 1e-8)
            del normalized, r
            scaled = g * s
            if "scaled_grad_norm" in state:  # the norm-growth limiter
                norm = scaled.norm()
                limiter = (norm / (state["scaled_grad_norm"] + 1e-8)).clamp_(min=LIMITER_GAMMA) / LIMITER_GAMMA
                scaled.div_(limiter)
                state["scaled_grad_norm"] = norm / limiter
            else:
                state["scaled_grad_norm"] = scaled.norm()
            scaled.mul_(math.sqrt(group["scale"]))
            p.add_(scaled, alpha=-step_size)
        if group["weight_decay"] > 0:
            p.add_(p, alpha=-lr * group["weight_decay"])


def param_groups(model: torch.nn.Module, hp: dict) -> list[dict]:
    """The rest (AdamW), then the projected weights (as the authors' script)."""
    projected, rest = split_params(model, hp["target_modules"])
    groups = [{"params": rest}] if rest else []
    if projected:
        groups.append({"params": projected, "rank": hp["rank"], "update_proj_gap": hp["update_proj_gap"],
                       "scale": hp["scale"], "scale_type": hp["scale_type"]})
    return groups


class APOLLO(Method):
    shards = False  # not under FSDP2: its random projection, a plain tensor, meets a sharded (DTensor) gradient
    paper = ("Zhu et al., APOLLO: SGD-like Memory, AdamW-level Performance, MLSys 2025, "
             "arXiv 2412.05270")
    defaults = dict(lr=0.01, eps=1e-6, rank=256, update_proj_gap=200, scale=1.0,
                    scale_type="channel", target_modules=list(TARGET_MODULES))
    choices = {"scale_type": SCALE_TYPES}
    ranges = {"rank": "[1, inf)", "update_proj_gap": "[1, inf)"}

    def make_optimizer(self, model):
        return APOLLOAdamW(param_groups(model, self.hp), **self.adam_args)


METHOD = APOLLO

"""GaLore: Adam on gradients projected to rank r; per-weight state m·r + 2·n·r, not 2·m·n.

Zhao, Zhang, Chen, Wang, Anandkumar, Tian, "GaLore: Memory-Efficient LLM Training by
Gradient Low-Rank Projection", ICML 2024, arXiv 2403.03507. Code: jiaweizzhao/GaLore
(PyPI galore-torch, run as the peer methods/galore_torch.py). This is our implementation
of the paper's Algorithm 1 (Adam with GaLore). For a targeted weight W in R^{m x n} with
m <= n (proj_type "std"; m > n projects from the right, below):

    t <- 0 ;  M, V <- 0 in R^{r x n}
    for each step:
        G <- dL/dW                                 (the full gradient, computed as usual)
        if t mod T = 0:                            (t = 0, T, 2T, ...; T = update_proj_gap)
            U, S, V' <- SVD(G)                     (float32 for half-precision gradients)
            P <- U[:, :r]                          (m x r, orthonormal: P^T P = I)
        R <- P^T G                                 (r x n: the gradient in the subspace)
        t <- t + 1
        M <- b1 M + (1 - b1) R ;  V <- b2 V + (1 - b2) R^2
                                                   (M, V are kept when P changes)
        N <- (M / (1 - b1^t)) / (sqrt(V / (1 - b2^t)) + eps)
        W <- W - lr wd W                           (decoupled weight decay, as AdamW)
        W <- W - lr alpha P N                      (alpha = scale: project back)

m > n:  Q <- V'[:r, :] (r x n, Q Q^T = I),  R <- G Q^T (m x r),  W <- W - lr alpha N Q.

`proj_type`: "std" projects the smaller side (the rule above: states r x max(m, n),
projector r x min(m, n)); "reverse_std" the larger; "left" always P; "right" always Q;
"full" both (R = P^T G Q^T, r x r states, projectors P and Q).

Which weights (methods/_common/lowrank.py, shared with APOLLO): the 2-D weights of
`nn.Linear` and GPT-2's `Conv1D` modules whose qualified name contains one of
`target_modules`. The authors' script takes every
`nn.Linear` named with "attn" or "mlp" (LLaMA's self_attn.*_proj and mlp.*_proj; GPT-2's
attn.c_attn/c_proj and mlp.c_fc/c_proj once Conv1D counts as a linear layer); BERT names
its blocks differently, so "attention", "intermediate" and "output.dense" are added (its
query/key/value, attention output, and feed-forward in/out). Everything else (biases,
embeddings, norms, LM heads, BERT's MLM transform) is plain AdamW with the same lr,
betas, eps and weight decay, as in the authors' runs (one lr for all).

rank >= min(m, n): the rank is clamped to min(m, n) for that weight (galore-torch does
the same, by slicing). The projector is then square and orthogonal: the update is Adam in
a basis rotated every T steps, times alpha, and the weight keeps full-size states plus
the projector, i.e. more memory than AdamW and no saving. The tiny models (hidden 128)
need a smaller rank than the default 128 to save anything: the quick suite overrides it
(e.g. rank 32, update_proj_gap 50).

Optimizer-state elements of a targeted m x n weight, r = min(rank, m, n), in the
parameter's dtype: "std" 2 r max(m, n) + r min(m, n); "full" 2 r^2 + r (m + n);
AdamW: 2 m n. The step counter is a Python int (no tensor, nothing to read back), so the
step runs on fake tensors (the simulated tier: torch.linalg.svd has a fake kernel that
gives the outputs' shapes; no value is read inside the step).

Where this differs from galore-torch 1.0 (its optimizer is transformers' old AdamW):
eps is added after the bias correction (Algorithm 1 and torch's AdamW) where galore-torch
adds it to sqrt(V) before, an effective eps / sqrt(1 - b2^t); eps defaults to the suite's
1e-8 (galore-torch's is 1e-6); weight decay comes before the update (torch's AdamW), not
after; the SVD runs in float64 for float64 gradients (galore-torch always uses float32);
the projector is a copy of the r columns/rows it needs (galore-torch's float32 projector
is a view that keeps the whole U or V' alive); the other parameters get exactly torch's
AdamW update.
"""
from __future__ import annotations

import math

import torch

from bench.method import Method, MethodError
from methods._common.lowrank import TARGET_MODULES, split_params
from methods._common.optim import PerParameterOptimizer

PROJ_TYPES = ("std", "reverse_std", "left", "right", "full")


def side(shape, proj_type: str) -> str:
    """Which projector a weight of `shape` gets: "left" (P), "right" (Q) or "full" (both)."""
    m, n = shape
    if proj_type == "std":
        return "right" if m >= n else "left"
    if proj_type == "reverse_std":
        return "left" if m >= n else "right"
    return proj_type


def state_shape(shape, rank: int, proj_type: str) -> tuple[int, int]:
    """Shape of M and V for a weight of `shape` (the rank clamped to min(m, n))."""
    m, n = shape
    r = min(rank, m, n)
    return {"left": (r, n), "right": (m, r), "full": (r, r)}[side(shape, proj_type)]


class GaLoreAdamW(PerParameterOptimizer):
    """AdamW; a parameter group with a `rank` (not None) runs GaLore on its 2-D weights.

    Group keys as galore-torch's: `rank`, `update_proj_gap`, `scale`, `proj_type`.
    State of a projected weight: `step` (int), `exp_avg`, `exp_avg_sq` (projected shape),
    `proj_left` (P, m x r) and/or `proj_right` (Q, r x n).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 rank=None, update_proj_gap=200, scale=1.0, proj_type="std"):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, rank=rank,
                        update_proj_gap=update_proj_gap, scale=scale, proj_type=proj_type)
        super().__init__(params, defaults)
        for group in self.param_groups:  # rank, update_proj_gap, proj_type: GaLore.choices/ranges
            if group["rank"] is None:
                continue
            for p in group["params"]:
                if p.dim() != 2:
                    raise MethodError(f"galore: only 2-D weights can be projected, got shape "
                                      f"{tuple(p.shape)}")

    # -- one parameter's update (also run inside backward by the per-layer variant) ------
    def _update(self, p: torch.Tensor, group: dict) -> None:
        g = p.grad
        state = self.state[p]
        projected = group["rank"] is not None
        if not state:
            state["step"] = 0
            shape = state_shape(p.shape, group["rank"], group["proj_type"]) if projected else p.shape
            state["exp_avg"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
            state["exp_avg_sq"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
        t = state["step"]
        if projected:
            if t % group["update_proj_gap"] == 0:
                self._refresh_projector(state, g, group)
            r = self._project(state, g)
        else:
            r = g
        t += 1
        state["step"] = t
        beta1, beta2 = group["betas"]
        lr, m, v = group["lr"], state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(r, 1 - beta1)
        v.mul_(beta2).addcmul_(r, r, value=1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(group["eps"])
        if group["weight_decay"]:
            p.mul_(1 - lr * group["weight_decay"])
        if projected:
            n = m / denom
            p.add_(self._project_back(state, n), alpha=-lr * group["scale"] / (1 - beta1 ** t))
        else:
            p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))

    @staticmethod
    def _refresh_projector(state: dict, g: torch.Tensor, group: dict) -> None:
        """P and/or Q from the SVD of the current gradient (LAPACK has no half precision)."""
        work = g if g.dtype in (torch.float32, torch.float64) else g.float()
        u, _, vh = torch.linalg.svd(work, full_matrices=False)
        r = min(group["rank"], *g.shape)
        which = side(g.shape, group["proj_type"])
        new = {}
        if which in ("left", "full"):
            new["proj_left"] = u[:, :r]
        if which in ("right", "full"):
            new["proj_right"] = vh[:r, :]
        for key, value in new.items():
            if key in state:
                state[key].copy_(value)  # same storage: the old projector is overwritten
            else:  # a copy of the r columns/rows, so the full U / V' can be freed
                state[key] = value.to(dtype=g.dtype, memory_format=torch.contiguous_format, copy=True)

    @staticmethod
    def _project(state: dict, g: torch.Tensor) -> torch.Tensor:
        if "proj_left" in state:
            g = state["proj_left"].T @ g
        if "proj_right" in state:
            g = g @ state["proj_right"].T
        return g

    @staticmethod
    def _project_back(state: dict, n: torch.Tensor) -> torch.Tensor:
        if "proj_left" in state:
            n = state["proj_left"] @ n
        if "proj_right" in state:
            n = n @ state["proj_right"]
        return n


def param_groups(model: torch.nn.Module, hp: dict) -> list[dict]:
    """galore-torch's layout: the rest (plain AdamW), then the projected weights."""
    projected, rest = split_params(model, hp["target_modules"])
    groups = [{"params": rest}] if rest else []
    if projected:
        groups.append({"params": projected, "rank": hp["rank"], "update_proj_gap": hp["update_proj_gap"],
                       "scale": hp["scale"], "proj_type": hp["proj_type"]})
    return groups


class GaLore(Method):
    shards = False  # not under FSDP2: its projected state is a plain tensor updated with sharded (DTensor) gradients
    paper = ("Zhao et al., GaLore: Memory-Efficient LLM Training by Gradient Low-Rank Projection, "
             "ICML 2024, arXiv 2403.03507")
    # The authors' LLaMA pre-training settings (README; rank 128 is the 60M one).
    defaults = dict(lr=0.01, rank=128, update_proj_gap=200, scale=0.25, proj_type="std",
                    target_modules=list(TARGET_MODULES))
    choices = {"proj_type": PROJ_TYPES}
    ranges = {"rank": "[1, inf)", "update_proj_gap": "[1, inf)"}

    def make_optimizer(self, model):
        return GaLoreAdamW(param_groups(model, self.hp), **self.adam_args)


METHOD = GaLore

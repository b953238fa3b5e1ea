"""Muon: the hidden weight matrices take an orthogonalized momentum step (one momentum
buffer per matrix, half of AdamW's state for them); AdamW for the rest.

Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024
(kellerjordan.github.io/posts/muon); Liu et al., "Muon is Scalable for LLM Training",
arXiv 2502.16982, 2025 (Moonlight: the learning-rate rule and the split used here).
Run as PyTorch's own `torch.optim.Muon` (torch >= 2.9) beside `torch.optim.AdamW`. For
each m x n matrix W with gradient G, momentum mu, step size lr and weight decay wd:

    B <- mu B + (1 - mu) G                     (torch: B.lerp_(G, 1 - mu))
    U <- (1 - mu) G + mu B  (nesterov)  or  B  (torch: G.lerp(B, mu))
    X <- bf16(U), transposed if m > n; X <- X / max(||X||_F, 1e-7)
    5 times: A <- X X^T; X <- a X + (b A + c A A) X    ((a, b, c) = (3.4445, -4.775, 2.0315))
    W <- (1 - lr wd) W - lr_adj X (transposed back) (lr_adj: `adjust_lr_fn` below)

The split (Keller Jordan's and Moonlight's): Muon for every trainable 2-D parameter
inside a Transformer block (the repeated layers transformers checkpoints, its
`GradientCheckpointingLayer`: the attention and MLP projections, GPT-2's Conv1D weights
among them); AdamW for the rest: embeddings, the LM head (tied or not), BERT's MLM head
transform, norms and biases. GPT-2's Conv1D keeps its weight as in x out, the transpose
of nn.Linear's: torch's Muon takes any 2-D tensor, and Newton-Schulz gives the transpose
of the transposed matrix's result, so the update is the nn.Linear layout's (up to bf16
rounding).

Defaults: torch's and the write-up's momentum 0.95, nesterov, 5 Newton-Schulz steps with
Keller Jordan's coefficients, eps 1e-7; `adjust_lr_fn` "match_rms_adamw" (Moonlight:
lr_adj = 0.2 lr sqrt(max(m, n)): an update whose RMS is about AdamW's, so Muon reuses
AdamW's lr and weight decay), not torch's default "original" (lr_adj = lr sqrt(max(1, m/n)), meant for
Keller Jordan's lr 0.02): "original" reads the layout, so a Conv1D weight (in x out)
would take another step than the same nn.Linear (out x in); Moonlight's rule is the same
for both. Hence `lr` is the suite's AdamW lr (1e-3) for both groups, as in Moonlight;
`adamw_lr` sets the AdamW group's apart (None: `lr`), e.g. for Keller Jordan's recipe
(`adjust_lr_fn=original`, lr 0.02, AdamW at 3e-4). Weight decay is the suite's 0 for
both groups (Keller Jordan's default; torch's Muon default is Moonlight's 0.1). The AdamW
group takes the suite's betas and eps.

Memory: state is `momentum_buffer` (a zeros_like of the gradient: numel x its element
size) per Muon matrix, and AdamW's exp_avg, exp_avg_sq and 0-d float32 step per other
parameter; counted as `optimizer`. The step's temporaries are `other` (the tracker labels
only the persistent state): one matrix at a time, the nesterov tensor (m n elements of
the gradient's dtype, e bytes each), its bf16 copy (the first iterate; the tensor itself
when bf16 already) and per Newton-Schulz iteration the r x r Gram matrix and polynomial
and the next r x s iterate beside the previous one (r = min(m, n), s = max(m, n)): at
most e m n + 4 r s + 4 r^2 bytes above the state (tests/methods/test_muon.py holds it);
then AdamW's temporaries (foreach: for all its parameters at once). No value is read,
so it runs on fake tensors.

torch 2.13's Muon with nesterov off on a bf16 parameter orthogonalizes the momentum
buffer in place (`.bfloat16()` of a bf16 tensor is the tensor itself) and corrupts it:
that combination is refused.
"""
from __future__ import annotations

import torch

from bench.method import Method, MethodError


def _block_types() -> tuple[type, ...]:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - transformers is a runtime requirement
        return ()
    return (GradientCheckpointingLayer,)


def split_params(model: torch.nn.Module) -> tuple[list, list]:
    """(the Muon parameters: every trainable 2-D parameter inside a Transformer block,
    the AdamW parameters: every other trainable one), each once, in model order."""
    types = _block_types()
    muon = {}
    for module in model.modules():
        if types and isinstance(module, types):
            for p in module.parameters():
                if p.requires_grad and p.dim() == 2:
                    muon[id(p)] = p
    if not muon:
        raise MethodError(f"muon found no 2-D weight inside a Transformer block of "
                          f"{type(model).__name__} (transformers' GradientCheckpointingLayer)")
    seen, adamw = set(muon), []
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            adamw.append(p)
    order = {id(p): i for i, p in enumerate(model.parameters())}
    return sorted(muon.values(), key=lambda p: order[id(p)]), adamw


class MuonWithAdamW(torch.optim.Optimizer):
    """`torch.optim.Muon` over `muon_params` and `torch.optim.AdamW` over `adamw_params`
    as one optimizer: its param_groups are theirs (Muon's first), its `state` is shared by
    both (the parameters are disjoint), `step` runs Muon's step, then AdamW's."""

    def __init__(self, muon_params, adamw_params, muon_args: dict, adamw_args: dict):
        self.muon = torch.optim.Muon(muon_params, **muon_args)
        self.adamw = torch.optim.AdamW(adamw_params, **adamw_args) if adamw_params else None
        groups = self.muon.param_groups + (self.adamw.param_groups if self.adamw else [])
        super().__init__(groups, {})  # the same group dicts: a change reaches both
        self.muon.state = self.state
        if self.adamw is not None:
            self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        if self.adamw is not None:
            self.adamw.step()
        return loss


class Muon(Method):
    paper = ("Jordan et al., Muon: An optimizer for hidden layers in neural networks, 2024; "
             "Liu et al., Muon is Scalable for LLM Training, arXiv 2502.16982, 2025")
    defaults = dict(adamw_lr=None, momentum=0.95, nesterov=True, ns_steps=5,
                    adjust_lr_fn="match_rms_adamw")
    choices = {"adjust_lr_fn": ("match_rms_adamw", "original")}
    ranges = {"lr": "(0, inf)", "adamw_lr": "(0, inf)", "momentum": "[0, 1)", "ns_steps": "[1, 100)",
              "weight_decay": "[0, inf)"}

    def make_optimizer(self, model):
        hp = self.hp
        muon, adamw = split_params(model)
        if not hp["nesterov"] and any(p.dtype == torch.bfloat16 for p in muon):
            raise MethodError("muon with nesterov=false on bfloat16 weights: torch's Muon would "
                              "orthogonalize the momentum buffer in place (torch 2.13)")
        muon_args = dict(lr=hp["lr"], weight_decay=hp["weight_decay"], momentum=hp["momentum"],
                         nesterov=hp["nesterov"], ns_steps=hp["ns_steps"],
                         adjust_lr_fn=hp["adjust_lr_fn"])
        adamw_args = dict(self.adam_args)
        if hp["adamw_lr"] is not None:
            adamw_args["lr"] = hp["adamw_lr"]
        self.report = {"muon_tensors": len(muon), "muon_params": sum(p.numel() for p in muon),
                       "adamw_tensors": len(adamw), "adamw_params": sum(p.numel() for p in adamw)}
        return MuonWithAdamW(muon, adamw, muon_args, adamw_args)


METHOD = Muon

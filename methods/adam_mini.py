"""Adam-mini: Adam with one second-moment value per Hessian block instead of one per
parameter; optimizer state about m alone, half of AdamW's m and v.

Zhang, Chen, Li, Ding, Chen, Kingma, Ye, Luo, Sun, "Adam-mini: Use Fewer Learning Rates To
Gain More", arXiv 2406.16793 (ICLR 2025). Code: zyushun/Adam-mini (PyPI adam-mini 1.1.1,
run as the peer methods/adam_mini_pkg.py). This is our implementation of the paper's
Algorithm (Adam-mini, with its partition). For each parameter tensor, split into blocks
b = 1..B by the partition below, with step t and decoupled weight decay:

    m   <- b1 m + (1 - b1) g                        (full size, as Adam)
    v_b <- b2 v_b + (1 - b2) mean(g_b * g_b)        (one value per block b)
    W   <- W - lr wd W                              (weight matrices only)
    W_b <- W_b - lr (m_b / (1 - b1^t)) / (sqrt(v_b / (1 - b2^t)) + eps)

The partition (the paper's Hessian-block principle, as the package implements it):
- embeddings and the output layer: one block per token (row);
- attention query and key: one block per head (the rows of one head, all columns);
- attention value, attention output and the MLP: one block per output neuron;
- biases: one block per element (plain Adam);
- everything else (norm weights): one block per tensor.
How we find them, on the suite's models (by module type and name, not by substrings of
parameter names as the package): every `nn.Embedding` (GPT-2 wte and wpe; BERT word,
position and token-type; LLaMA embed_tokens) and the LM head (tied to the embedding in
GPT-2 and BERT: one tensor, one treatment) per row; `nn.Linear` named q_proj/k_proj
(LLaMA) or query/key (BERT) per head (head width from the model config; grouped-query k
has its own number of heads); every other `nn.Linear` per output row (its weight's row);
GPT-2's `Conv1D` per output column (its weight is in x out), except the fused `c_attn`
(columns q | k | v): q and k per head (the head's columns, all rows), v per column; a
1-D parameter named `bias` per element; other 1-D parameters (norm weights) one block.
Weight decay applies to the parameters with 2 or more dimensions only (the package
exempts names containing "norm", "ln" or "bias": on these models the same set).

Where the package's name rules give something else on these models (it is written for
LLaMA-style names): on LLaMA, nothing (tests/methods/test_adam_mini.py checks the same
trajectory); on GPT-2, c_attn and attn.c_proj get one block per tensor, mlp.c_fc and
c_proj one per *input* row (Conv1D is transposed) and wpe one block; on BERT,
intermediate.dense, the pooler and the MLM transform get one block per tensor.

Defaults are the suite's AdamW ones (the paper: Adam-mini uses AdamW's hyperparameters).

State, in the parameter's dtype: m (numel) and v (B values) per tensor; biases 2 numel.
The step count is a Python int. Nothing in the step reads a tensor's value, so it runs
on fake tensors.
"""
from __future__ import annotations

import math

import torch

from bench.method import Method
from methods._common.optim import PerParameterOptimizer

KINDS = ("adam", "tensor", "rows", "cols", "heads", "c_attn")
QK_NAMES = ("q_proj", "k_proj", "query", "key")


def _conv1d():
    try:
        from transformers.pytorch_utils import Conv1D
        return Conv1D
    except ImportError:  # pragma: no cover - transformers is a runtime requirement
        return ()


def head_width(model) -> int:
    config = getattr(model, "config", None)
    if config is None:
        return 0
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def partition(model) -> list[dict]:
    """One entry per trainable parameter, in model order: `param`, `name`, `kind` (one
    of KINDS), `blocks` (B) and `head` (the head width, for heads and c_attn)."""
    conv1d = _conv1d()
    hd = head_width(model)
    seen, out = set(), []
    for mod_name, module in model.named_modules():
        leaf = mod_name.rsplit(".", 1)[-1]
        for p_name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            if p.dim() == 1:
                kind = "adam" if p_name == "bias" else "tensor"
            elif isinstance(module, torch.nn.Embedding):
                kind = "rows"
            elif conv1d and isinstance(module, conv1d):
                kind = "c_attn" if leaf == "c_attn" else "cols"
            elif isinstance(module, torch.nn.Linear):
                kind = "heads" if leaf in QK_NAMES and hd else "rows"
            else:
                kind = "tensor"
            out.append(dict(param=p, name=f"{mod_name}.{p_name}" if mod_name else p_name,
                            kind=kind, head=hd, blocks=n_blocks(p.shape, kind, hd)))
    return out


def n_blocks(shape, kind: str, head: int) -> int:
    numel = math.prod(shape)
    if kind == "adam":
        return numel
    if kind == "tensor":
        return 1
    if kind == "rows":
        return shape[0]
    if kind == "cols":
        return shape[-1]
    if kind == "heads":
        return shape[0] // head
    d = shape[1] // 3  # c_attn: 2 d / head heads for q and k, d columns for v
    return 2 * d // head + d


def state_elements(shape, kind: str, head: int = 0) -> int:
    """m (numel) plus v (one value per block)."""
    return math.prod(shape) + n_blocks(shape, kind, head)


def _v_shape(shape, kind: str, head: int) -> tuple:
    b = n_blocks(shape, kind, head)
    return {"adam": tuple(shape), "tensor": (), "rows": (b, 1), "cols": (1, b),
            "heads": (b, 1), "c_attn": (b,)}[kind]


def _block_mean_sq(g: torch.Tensor, kind: str, head: int) -> torch.Tensor:
    sq = g * g
    if kind == "tensor":
        return sq.mean()
    if kind == "rows":
        return sq.mean(dim=1, keepdim=True)
    if kind == "cols":
        return sq.mean(dim=0, keepdim=True)
    if kind == "heads":
        return sq.view(g.shape[0] // head, -1).mean(dim=1, keepdim=True)
    d = g.shape[1] // 3  # c_attn
    qk = sq[:, :2 * d].reshape(g.shape[0], 2 * d // head, head).mean(dim=(0, 2))
    return torch.cat([qk, sq[:, 2 * d:].mean(dim=0)])


class AdamMiniOptimizer(PerParameterOptimizer):
    """Adam-mini over the entries of `partition(model)` (each parameter with its `kind`
    and head width); two groups: weights (>= 2-D, weight decay) and the rest (none).
    State `exp_avg` (full), `exp_avg_sq` (one value per block, see `_v_shape`), `step`
    (a Python int)."""

    def __init__(self, entries: list[dict], lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0):
        decay = [e["param"] for e in entries if e["param"].dim() >= 2]
        plain = [e["param"] for e in entries if e["param"].dim() < 2]
        groups = [g for g in ({"params": decay}, {"params": plain, "weight_decay": 0.0}) if g["params"]]
        super().__init__(groups, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.layout = {id(e["param"]): (e["kind"], e["head"]) for e in entries}

    def _update(self, p: torch.Tensor, group: dict) -> None:
        kind, head = self.layout[id(p)]
        g = p.grad
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = p.new_zeros(_v_shape(p.shape, kind, head))
        b1, b2 = group["betas"]
        lr, m, v = group["lr"], state["exp_avg"], state["exp_avg_sq"]
        if kind == "adam":
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
        else:
            v.mul_(b2).add_(_block_mean_sq(g, kind, head), alpha=1 - b2)
        state["step"] += 1
        t = state["step"]
        if group["weight_decay"]:
            p.mul_(1 - lr * group["weight_decay"])
        m.lerp_(g, 1 - b1)
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
        h = (v.sqrt() / math.sqrt(bc2)).add_(group["eps"])
        if kind == "adam":
            p.addcdiv_(m, h, value=-lr / bc1)
            return
        scale = (1 / bc1) / h  # one step size per block
        if kind == "heads":
            update = (m.view(scale.shape[0], -1) * scale).view(p.shape)
        elif kind == "c_attn":
            qk_heads = 2 * (p.shape[1] // 3) // head
            scale = torch.cat([scale[:qk_heads].repeat_interleave(head), scale[qk_heads:]])
            update = m * scale
        else:
            update = m * scale
        update.mul_(lr)
        p.sub_(update)


class AdamMini(Method):
    paper = ("Zhang et al., Adam-mini: Use Fewer Learning Rates To Gain More, arXiv 2406.16793 "
             "(ICLR 2025)")

    def make_optimizer(self, model):
        entries = partition(model)
        kinds = {k: sum(e["kind"] == k for e in entries) for k in KINDS}
        self.report = {"tensors_per_kind": {k: n for k, n in kinds.items() if n},
                       "second_moment_values": sum(e["blocks"] for e in entries),
                       "parameters": sum(e["param"].numel() for e in entries)}
        return AdamMiniOptimizer(entries, **self.adam_args)


METHOD = AdamMini

"""Which weights the low-rank optimizers (GaLore, APOLLO and their peers) project.

The 2-D weights of `nn.Linear` and GPT-2's `Conv1D` modules whose qualified name contains
one of `target_modules`. The GaLore authors' script takes every `nn.Linear` named with
"attn" or "mlp" (LLaMA's self_attn.*_proj and mlp.*_proj; GPT-2's attn.c_attn/c_proj and
mlp.c_fc/c_proj once Conv1D counts as a linear layer); BERT names its blocks differently,
so "attention", "intermediate" and "output.dense" are added (its query/key/value,
attention output, and feed-forward in/out). APOLLO's script takes the same weights.
"""
from __future__ import annotations

import torch

TARGET_MODULES = ("attn", "mlp", "attention", "intermediate", "output.dense")


def _linear_types() -> tuple[type, ...]:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a runtime requirement
        return (torch.nn.Linear,)
    return (torch.nn.Linear, Conv1D)


def split_params(model: torch.nn.Module, target_modules) -> tuple[list, list]:
    """(the weights to project, every other trainable parameter), in model order."""
    types = _linear_types()
    projected = {}
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        if (isinstance(module, types) and any(k in name for k in target_modules)
                and w is not None and w.dim() == 2 and w.requires_grad):
            projected[id(w)] = w
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in projected]
    return list(projected.values()), rest

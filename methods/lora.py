"""LoRA: frozen base weights, trainable low-rank A, B beside the target linear layers.

Hu, Shen, Wallis, Allen-Zhu, Li, Wang, Wang, Chen, "LoRA: Low-Rank Adaptation of Large
Language Models", ICLR 2022, arXiv 2106.09685. Each target layer y = W x + b keeps W and b
frozen and gains a trainable rank-r update (Section 4.1):

    y = W x + b + s * B (A drop(x))      A: r x d_in,  B: d_out x r,  s = alpha / r
    A ~ U(-1/sqrt(d_in), 1/sqrt(d_in))   (nn.Linear's default init: kaiming_uniform_(a=sqrt(5)))
    B = 0                                (so the model starts as the base model)

A and B are `nn.Linear(d_in, r, bias=False)` and `nn.Linear(r, d_out, bias=False)` made
in float32 on the CPU and moved to the base weight's device and dtype, and the forward is
`base(x) + B(A(drop(x))) * s` with dropout `nn.Dropout(p)` (`nn.Identity` at p = 0):
Hugging Face peft 0.21's `LoraLayer` op for op, so the peer methods/lora_peft.py draws the
same A from the same seed. Adapters take the base weight's dtype (peft's
`autocast_adapter_dtype=False`; the suite trains in one dtype).

Every parameter of the model is frozen (`requires_grad=False`: embeddings, norms, biases,
LM head too; peft's `bias="none"`); only A and B train. Nothing else changes: the
optimizer is the contract's AdamW (or a stacked member's, e.g. `lora+adamw_8bit`), and a
torch or bitsandbytes optimizer makes no state and no update for a parameter whose grad
is None, so gradients and optimizer state exist for the adapters only. Memory stays in
its categories: base weights and adapters are `param` (the adapters' count is the result's
`trainable_params`), the adapters' gradients `grad`, their moments `optimizer`; what the
adapters save for backward is `activation` (A keeps its input x, which a frozen layer
would not keep; B keeps A's output, N x r).

Targets (`targets`, a string): "all-linear" (the default) is every `nn.Linear` and GPT-2
`Conv1D` inside the Transformer blocks (the modules under an `nn.ModuleList`): the
attention and MLP projections of any Hugging Face decoder or encoder, never the
embeddings, the LM head or BERT's MLM head transform (peft's own `"all-linear"` takes
every linear layer but the output layer, so it also takes BERT's `cls.predictions.
transform.dense`). GPT-2: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj; BERT:
attention.self.query/key/value, attention.output.dense, intermediate.dense,
output.dense; LLaMA: self_attn.q/k/v/o_proj, mlp.gate/up/down_proj. Otherwise it is
names separated by "|", each naming modules as an entry of peft's `target_modules` list
does: a linear layer whose qualified name equals it or ends with "." + it ("q_proj|v_proj"
is peft's default for LLaMA, "c_attn" for GPT-2, "query|value" for BERT; as a variant:
`lora@targets=q_proj|v_proj`). Names that select no linear layer are an error naming the
model's linear layers. `method_report` names the layers adapted.

Trainable parameters: sum over targets of r (d_in + d_out). A `Conv1D` stores its weight
as (d_in, d_out); `nn.Linear` as (d_out, d_in).
"""
from __future__ import annotations

import math

import torch

from bench.method import Method, MethodError

ALL_LINEAR = "all-linear"


def linear_types() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return (torch.nn.Linear, Conv1D)


def in_out_features(module: torch.nn.Module) -> tuple[int, int]:
    """(d_in, d_out) of an `nn.Linear` or a `Conv1D` (weight stored as (d_in, d_out))."""
    d0, d1 = module.weight.shape
    return (d1, d0) if isinstance(module, torch.nn.Linear) else (d0, d1)


def select_targets(model: torch.nn.Module, targets: str) -> list[str]:
    """Qualified names of the linear layers `targets` selects, in model order (see the
    module docstring); a MethodError when it selects none."""
    targets = [t.strip() for t in targets.split("|") if t.strip()]
    types = linear_types()
    linear = [name for name, m in model.named_modules() if isinstance(m, types)]
    if ALL_LINEAR in targets:
        if targets != [ALL_LINEAR]:
            raise MethodError(f"lora: targets {'|'.join(targets)}: {ALL_LINEAR} stands alone")
        blocks = [name for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
        chosen = [n for n in linear if any(n.startswith(b + ".") for b in blocks)]
    else:
        chosen = [n for n in linear if any(n == t or n.endswith("." + t) for t in targets)]
    if not chosen:
        raise MethodError(f"lora: targets {'|'.join(targets)} select no linear layer of {type(model).__name__}; "
                          f"its linear layers: {', '.join(linear) or 'none'}")
    return chosen


def fake_mode_of(weight: torch.Tensor):
    """The fake mode of a fake tensor (the simulated tier), else None."""
    from torch._subclasses.fake_tensor import FakeTensor

    return weight.fake_mode if isinstance(weight, FakeTensor) else None


def init_adapters(lora_A: torch.nn.Linear, lora_B: torch.nn.Linear) -> None:
    """peft's default (`init_lora_weights=True`): A as nn.Linear's default, B zero."""
    torch.nn.init.kaiming_uniform_(lora_A.weight, a=math.sqrt(5))
    torch.nn.init.zeros_(lora_B.weight)


class LoRALinear(torch.nn.Module):
    """A frozen linear layer (`base_layer`) plus s * B(A(drop(x)))."""

    def __init__(self, base_layer: torch.nn.Module, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.base_layer = base_layer
        d_in, d_out = in_out_features(base_layer)
        weight = base_layer.weight
        self.lora_dropout = torch.nn.Dropout(p=dropout) if dropout > 0 else torch.nn.Identity()
        fake = fake_mode_of(weight)
        if fake is None:
            # as peft: made on the CPU in float32 (nn.Linear's init draws once), A drawn
            # again with kaiming_uniform_(a=sqrt(5)), B zero, then moved and cast
            self.lora_A = torch.nn.Linear(d_in, rank, bias=False, device="cpu", dtype=torch.float32)
            self.lora_B = torch.nn.Linear(rank, d_out, bias=False, device="cpu", dtype=torch.float32)
            init_adapters(self.lora_A, self.lora_B)
            self.lora_A.to(weight.device, dtype=weight.dtype)
            self.lora_B.to(weight.device, dtype=weight.dtype)
        else:  # fake tensors: made where they belong (a fake parameter cannot be moved)
            with fake:
                self.lora_A = torch.nn.Linear(d_in, rank, bias=False, device=weight.device, dtype=weight.dtype)
                self.lora_B = torch.nn.Linear(rank, d_out, bias=False, device=weight.device, dtype=weight.dtype)
                init_adapters(self.lora_A, self.lora_B)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        return result + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def trainable_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def report(names: list[str], model: torch.nn.Module) -> dict:
    """What was adapted: the layers' names within a block (`attn.c_attn`), how many, and
    the trainable parameters."""
    kinds = []
    for name in names:
        parts = name.split(".")
        index = next((i for i, part in enumerate(parts) if part.isdigit()), -1)
        kind = ".".join(parts[index + 1:])
        if kind not in kinds:
            kinds.append(kind)
    return {"targets": kinds, "layers": len(names), "trainable_params": trainable_params(model)}


class LoRA(Method):
    paper = "Hu et al., LoRA: Low-Rank Adaptation of Large Language Models, ICLR 2022, arXiv 2106.09685"
    defaults = dict(rank=16, alpha=32.0, dropout=0.0, targets=ALL_LINEAR)
    ranges = {"rank": "[1, inf)", "alpha": "(0, inf)", "dropout": "[0, 1)"}

    def transform_model(self, model):
        hp = self.hp
        names = select_targets(model, hp["targets"])
        for p in model.parameters():
            p.requires_grad_(False)
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, LoRALinear(getattr(parent, child), hp["rank"], hp["alpha"], hp["dropout"]))
        self.report = report(names, model)
        return model


METHOD = LoRA

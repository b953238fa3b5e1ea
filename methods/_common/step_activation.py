"""A pointwise activation whose backward uses a step function q for f', keeping only the
b-bit code of each input element (bit-packed) for backward, never the input.

    forward:   y = f(x)                  exactly as the replaced layer computes it
               c = #{k : x_k < x}        the number of borders below x, in 0 .. 2^b - 1
               save pack(c, b)           ceil(n b / 8) bytes
    backward:  dx = levels[c] * dy

Used by `fewbit` (the optimal tables of methods/fewbit/tables.py) and `approx_bp`
(ReGELU2 and ReSiLU2, the paper's fixed 2-bit tables). Pure torch ops of static shapes:
CPU, CUDA and fake tensors. The borders are compared in x's dtype (a Python float against a bfloat16
tensor is rounded to bfloat16 first), the levels are applied in the gradient's dtype.
Temporaries beside the saved codes and the output: forward, the codes (1 byte an
element) and one comparison (1 byte); backward, the unpacked codes (1 byte); the
packing's and the gather's own, per chunk.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from methods._common import bitpack
from methods._common.chunks import chunk_size

# The backward gathers the levels into the gradient with int32 indices (4 bytes an
# element) in up to 16 pieces of at least 2^14 elements: that temporary stays near a
# sixteenth of the gradient's size, with few operations on large tensors.
BACKWARD_CHUNK = 1 << 14
BACKWARD_PIECES = 16


def codes_of(x: torch.Tensor, borders) -> torch.Tensor:
    """uint8 codes: how many of the (ascending) borders lie below each element."""
    codes = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for border in borders:
        codes.add_(x > border)
    return codes


class StepDerivativeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, borders: tuple, levels: tuple, bits: int):
        y = fn(x)
        codes = codes_of(x, borders)
        ctx.save_for_backward(bitpack.pack(codes, bits))
        ctx.shape, ctx.bits, ctx.levels = x.shape, bits, levels
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        (packed,) = ctx.saved_tensors
        codes = bitpack.unpack(packed, ctx.bits, ctx.shape).reshape(-1)
        levels = torch.tensor(ctx.levels, dtype=grad_y.dtype, device=grad_y.device)
        gy = grad_y.reshape(-1)
        grad_x = torch.empty(gy.shape, dtype=grad_y.dtype, device=grad_y.device)
        n = gy.numel()
        chunk = chunk_size(n, BACKWARD_CHUNK, BACKWARD_PIECES)
        for start in range(0, n, chunk):  # int32 indices, a piece at a time
            piece = slice(start, start + chunk)
            torch.index_select(levels, 0, codes[piece].int(), out=grad_x[piece]).mul_(gy[piece])
        return grad_x.view(ctx.shape), None, None, None, None


class StepDerivativeActivation(nn.Module):
    """y = fn(x) forward; dx = levels[code(x)] * dy backward, the code kept in `bits` bits."""

    def __init__(self, fn, borders, levels, bits: int, name: str = "", replaces: str = ""):
        super().__init__()
        borders, levels = tuple(float(b) for b in borders), tuple(float(v) for v in levels)
        if len(levels) != len(borders) + 1 or len(levels) > 2 ** bits:
            raise ValueError(f"{len(borders)} borders and {len(levels)} levels do not make a "
                             f"{bits}-bit table")
        if any(b >= c for b, c in zip(borders, borders[1:])):
            raise ValueError("borders must be strictly ascending")
        # a plain function, not a submodule: the swap never finds the replaced layer again
        self.__dict__["fn"] = fn
        self.borders, self.levels, self.bits = borders, levels, bits
        self.name, self.replaces = name, replaces

    def forward(self, x):
        return StepDerivativeFunction.apply(x, self.fn, self.borders, self.levels, self.bits)

    def extra_repr(self):
        return f"{self.name}, bits={self.bits}, replaces={self.replaces}"


# -- what the swap recognises -------------------------------------------------------------


def _transformers_activations() -> dict:
    """transformers' activation classes -> the name of their derivative's table."""
    try:
        from transformers import activations as act
    except ImportError:  # transformers is a dependency of the suite; be lenient anyway
        return {}
    table = {}
    for cls_name, name in (("NewGELUActivation", "gelu_tanh"), ("GELUTanh", "gelu_tanh"),
                           ("PytorchGELUTanh", "gelu_tanh"), ("SiLUActivation", "silu"),
                           ("MishActivation", "mish")):
        if hasattr(act, cls_name):
            table[getattr(act, cls_name)] = name
    return table


def derivative_name(module) -> str | None:
    """The table that approximates this layer's derivative, or None if there is none.

    Modules: torch's activations with default parameters and transformers' activation
    classes. Functions (a model may keep e.g. `F.gelu` as a plain attribute): the
    functional forms."""
    from transformers import activations as act

    kind = type(module)
    if kind is nn.GELU:
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    if kind is act.GELUActivation:  # F.gelu, or its erf formula in Python
        return "gelu"
    if kind in _transformers_activations():
        return _transformers_activations()[kind]
    if kind is nn.LeakyReLU:
        return "leaky_relu" if module.negative_slope == 0.01 else None
    if kind is nn.ELU or kind is nn.CELU:
        return kind.__name__.lower() if module.alpha == 1.0 else None
    if kind is nn.Softplus:
        return "softplus" if (module.beta, module.threshold) == (1.0, 20.0) else None
    simple = {nn.SiLU: "silu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid", nn.Hardswish: "hardswish",
              nn.LogSigmoid: "logsigmoid", nn.Mish: "mish", nn.SELU: "selu", nn.Softsign: "softsign",
              nn.Tanhshrink: "tanhshrink", nn.ReLU: "relu"}
    if kind in simple:
        return simple[kind]
    functions = {F.gelu: "gelu", F.silu: "silu", torch.tanh: "tanh", torch.sigmoid: "sigmoid",
                 F.mish: "mish", F.selu: "selu", F.softsign: "softsign", F.relu: "relu",
                 F.hardswish: "hardswish", F.logsigmoid: "logsigmoid", F.tanhshrink: "tanhshrink"}
    if not isinstance(module, nn.Module) and callable(module):
        try:
            return functions.get(module)
        except TypeError:  # unhashable
            return None
    return None


def _is_activation(module: nn.Module) -> bool:
    path = type(module).__module__
    return path.endswith("activations") or path == "torch.nn.modules.activation"


def swap_activations(model: nn.Module, table_for) -> dict:
    """Replace every activation whose derivative `table_for(name)` has a table for.

    `table_for(name)` returns (borders, levels, bits) or None. Returns a report: how many
    layers were replaced, by replaced class and table, and which activations were left."""
    replaced, left = {}, {}

    def visit(parent: nn.Module):
        for attr, child in list(parent.named_children()):
            if isinstance(child, StepDerivativeActivation):
                replaced[f"{child.replaces} -> {child.name}"] = replaced.get(f"{child.replaces} -> {child.name}", 0) + 1
                continue
            name = derivative_name(child)
            entry = table_for(name) if name else None
            if entry is not None:
                new = StepDerivativeActivation(child, *entry, name=name, replaces=type(child).__name__)
                setattr(parent, attr, new)
                key = f"{new.replaces} -> {name}"
                replaced[key] = replaced.get(key, 0) + 1
            elif _is_activation(child) and not list(child.children()):
                why = f"no table for {name}" if name else "no table"
                key = f"{type(child).__name__} ({why})"
                left[key] = left.get(key, 0) + 1
            else:
                visit(child)
        # plain functions kept as attributes (e.g. hidden_act given as a callable)
        if not _is_activation(parent):
            for attr, value in list(vars(parent).items()):
                if attr.startswith("_") or isinstance(value, (nn.Module, torch.Tensor)) or not callable(value):
                    continue
                name = derivative_name(value)
                entry = table_for(name) if name else None
                if entry is not None:
                    fn_name = getattr(value, "__name__", repr(value))
                    new = StepDerivativeActivation(value, *entry, name=name, replaces=fn_name)
                    delattr(parent, attr)
                    setattr(parent, attr, new)
                    key = f"{fn_name} -> {name}"
                    replaced[key] = replaced.get(key, 0) + 1

    visit(model)
    return {"replaced": replaced, "left": left}

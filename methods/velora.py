"""VeLoRA: a linear layer keeps one scalar per sub-token of its input for backward, its
projection on a fixed unit vector, instead of the input itself.

Miles, Reddy, Elezi, Deng, "VeLoRA: Memory Efficient Training using Rank-1 Sub-Token
Projections", NeurIPS 2024, arXiv 2405.17991 (official code: roymiles/VeLoRA,
`velora/velora.py`, `velora/peft_zoo/helper.py`, `scripts/*.sh`). For a wrapped layer
y = x W^T + b, x of shape [B, N, D], with G groups of sub-token size M = D / G:

    first training batch:  v = normalize(mean of all B N G sub-tokens x_{t,g} in R^M)
                           (a buffer, then frozen: the code's `batch_average_once`;
                           with micro-batches, the first micro-batch)
    forward:   y = x W^T + b                               exact (F.linear, or Conv1D's addmm)
               z_{t,g} = x_{t,g} . v                       one scalar per sub-token
               save z [B N, G] (x's dtype) and v; x is not kept by this layer
    backward:  dx = dy W                                   exact
               x^_{t,g} = z_{t,g} v                        each sub-token's projection on v
               dW = scale * sum_t dy_t^T x^_t              block g of columns: scale (dy^T z_g) v^T
               db = sum_t dy_t                             exact

dW is summed over tokens directly: [out, G] = dy^T z, times v per block (the official code
builds x^ in full and a [B, out, in] product that autograd then sums). Each M-column block of
dW has rank 1 with row space v, so dW has rank at most G; with M = 1 it is exact, and it is
exact whenever every sub-token lies on v. Eval mode, no_grad and a frozen weight run the
layer as it was (a frozen layer keeps no input for a weight gradient anyway).

Hyperparameters (the official script flags' names, which clash with none of LoRA's):
- `velora_layers` "vd" (the scripts' `--velora_layers 'vd'`): the value and the MLP down
  projection. Letters: q, k, v (attention), o (attention output), g (gate), u (MLP up / in),
  d (MLP down / out), written in that order ("vd", "qkv"); per family: LLaMA (and models
  named like it) self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj; BERT
  attention.self.{query,key,value}, attention.output.dense, intermediate.dense,
  output.dense; GPT-2 attn.c_attn for any of q, k, v (q, k and v are one fused layer
  reading one tensor, so the whole layer is wrapped, as the official code does for a ViT's
  fused qkv), attn.c_proj, mlp.c_fc, mlp.c_proj.
- `num_groups` 32 (the LLaMA-7B/13B fine-tuning scripts and the README's example; C4
  pre-training uses 64 and 86): G sub-tokens per token, so z keeps G numbers a token
  whatever the width (B N G elements), and G bounds the rank of dW. The group count, not
  the sub-token size M, is the knob: it is the official one and the scripts' settings are
  in it (at LLaMA-7B G = 32 is M = 128 for v and 344 for down), and it keeps the gradient's
  rank bound the same on every model; on the suite's 128-wide tiny models G = 32 is
  M = 4 (z keeps 1/4 of the input). The code needs G to divide D (it views x as
  [B N G, D / G]); where the asked G does not (llama-tiny's down_proj has D = 344, llama-1b's
  5461), the layer takes the smallest divisor of D not below G (344: 43 groups of 8; 5461:
  43 of 127; G >= D: D groups of 1, exact), never fewer groups than asked. The report
  gives each layer's G and M.
- `velora_scale` 1.0 (the C4-130M script; 60M uses 1.5, the LoRA fine-tuning 0.1: e.g.
  `lora+velora@velora_scale=0.1`). It scales dW only; Adam divides it out (but for eps and
  global-norm clipping), so it matters for SGD-like optimizers. Memory does not depend on it.
- Not taken: the rank `velora_r` (always 1 in the code; other ranks need other inits), the
  `batch_average` / `ema` variants of v (recomputed each batch), the fp16 cast of the
  official projection (z stays in x's dtype, as the authors' PEFT version keeps it).

With LoRA (the stack `lora+velora`, the paper's fine-tuning): where the target layer is a
`methods.lora.LoRALinear`, its adapter `lora_A` (whose input is the adapter's input,
drop(x)) is wrapped, not the frozen base layer; A's gradient is then the VeLoRA estimate.
A target layer that is frozen and has no adapter is left alone (reported as frozen).

What it saves, and what it cannot. Per wrapped layer and micro-batch of T = B N tokens, in
x's dtype (e bytes), autograd keeps T G e bytes (z) and M e (v, a buffer, counted once; the
weight is the parameter) instead of the T D e of x: (T G + M) e, tested with
`saved_tensors_hooks`. That frees x only where nothing else keeps x, and the method does not
assume it: on the run's first training forward it watches each wrapped layer's input storage
(a weak reference) and counts the input freed if the storage is gone once the model's
forward has returned (only the autograd graph could still hold it), else held; it also lists
the trainable linear layers that read the same tensor. Measured on the tiny models (and
checked against saved-tensor hooks in tests/methods/test_velora.py), `velora` alone:
- LLaMA: v_proj's input (input_layernorm's output) is held: q_proj and k_proj read the same
  tensor and keep it for their weight gradients, so wrapping v_proj frees nothing and adds
  its z. down_proj's input SiLU(gate) * up is freed: the product keeps its two factors, not
  its output.
- BERT: attention.self.value's input is held (query and key keep it); output.dense's input,
  GELU's output, is freed (GELU keeps its input).
- GPT-2: attn.c_attn's input, ln_1's output, is freed (LayerNorm keeps its input; q, k and v
  are one layer); mlp.c_proj's input, GELU's output, is freed.
`lora+velora` (LoRA's default, every projection adapted, dropout 0): the same, with the q
and k adapters' A holding v's input; with LoRA dropout > 0 (the paper's fine-tuning: 0.1)
each adapter reads its own dropped copy, and v's is freed too. `method_report` gives per
layer the count freed and held and who else reads it, and `expected_activation_change_bytes`
for the measured micro-batch: -T D e per freed input, +T G e per z (e.g. bert-tiny at 16 x 64
in float32: -3,670,016 bytes, which is its measured activation and peak change, the peak
being at the end of the forward there). Under `checkpointing` the blocks keep nothing in the
forward, so every input counts as freed there. Stack it after LoRA: in `velora+lora` LoRA
freezes the wrapped layers, which then run plain (the report says so).

Everything is static-shape tensor code (no value read on the host), so it runs on fake
tensors (the simulated tier); v is then a fake tensor too, which memory does not mind.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from bench.method import Method, MethodError
from methods.lora import LoRALinear, fake_mode_of, in_out_features, linear_types

# velora_layers' letters, in the order a value lists them, and the layer each names per
# family (the name within a block, as `_kind` gives it).
LETTERS = "qkvogud"
LAYERS = {
    "q": ("self_attn.q_proj", "attention.self.query", "attn.c_attn"),
    "k": ("self_attn.k_proj", "attention.self.key", "attn.c_attn"),
    "v": ("self_attn.v_proj", "attention.self.value", "attn.c_attn"),
    "o": ("self_attn.o_proj", "attention.output.dense", "attn.c_proj"),
    "g": ("mlp.gate_proj",),
    "u": ("mlp.up_proj", "intermediate.dense", "mlp.c_fc"),
    "d": ("mlp.down_proj", "output.dense", "mlp.c_proj"),
}
LAYER_CHOICES = tuple("".join(c) for n in range(1, len(LETTERS) + 1)
                      for c in itertools.combinations(LETTERS, n))


def groups_for(d_in: int, num_groups: int) -> int:
    """The group count a layer of width d_in takes: the smallest divisor of d_in that is
    not below num_groups (d_in itself if num_groups >= d_in)."""
    return next(g for g in range(min(num_groups, d_in), d_in + 1) if d_in % g == 0)


def _kind(name: str) -> str:
    """A module's name within its block: `model.layers.0.self_attn.v_proj` ->
    `self_attn.v_proj` (the name itself outside the blocks)."""
    parts = name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), -1)
    return ".".join(parts[index + 1:])


class VeLoRAFunction(torch.autograd.Function):
    """y = x W^T + b (W stored [out, in]; `transposed`: [in, out], GPT-2's Conv1D, whose
    addmm is then the forward); saves z = sub-tokens . v and v, returns dW in W's layout."""

    @staticmethod
    def forward(ctx, x, weight, bias, v, groups: int, scale: float, transposed: bool):
        if transposed:  # Conv1D.forward, op for op
            x2 = x.view(-1, x.size(-1))
            y = (torch.addmm(bias, x2, weight) if bias is not None else x2.mm(weight)).view(*x.shape[:-1], -1)
        else:
            y = F.linear(x, weight, bias)
        v = v.to(x.dtype)
        z = torch.matmul(x.detach().reshape(-1, groups, v.numel()), v)  # [T, G]
        ctx.save_for_backward(z, weight, v)
        ctx.groups, ctx.scale, ctx.transposed, ctx.has_bias = groups, scale, transposed, bias is not None
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        z, weight, v = ctx.saved_tensors
        gy = grad_y.reshape(-1, grad_y.shape[-1])  # [T, out]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_y.matmul(weight.t() if ctx.transposed else weight)
        if ctx.needs_input_grad[1]:
            zg = z.to(gy.dtype)
            if ctx.transposed:  # [in, out]: block g of rows is v (z_g^T dy)
                a = zg.t().matmul(gy).mul_(ctx.scale)  # [G, out]
                grad_w = (v.to(gy.dtype)[None, :, None] * a[:, None, :]).reshape(-1, gy.shape[1])
            else:  # [out, in]: block g of columns is (dy^T z_g) v^T
                a = gy.t().matmul(zg).mul_(ctx.scale)  # [out, G]
                grad_w = (a[:, :, None] * v.to(gy.dtype)[None, None, :]).reshape(gy.shape[1], -1)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = gy.sum(0)
        return grad_x, grad_w, grad_b, None, None, None, None


class VeLoRALayer:
    """Mixed into a wrapped layer's class (nn.Linear or Conv1D): the layer keeps its
    parameters, names and type; its forward in training runs `VeLoRAFunction`."""

    def velora_setup(self, num_groups: int, scale: float) -> None:
        d_in, _ = in_out_features(self)
        self.velora_groups = groups_for(d_in, num_groups)
        self.velora_scale = scale
        self.velora_ready = False  # v is set from the first training batch
        w = self.weight
        with fake_mode_of(w) or contextlib.nullcontext():  # fake weights (simulated tier): a fake v
            v = torch.zeros(d_in // self.velora_groups, dtype=w.dtype, device=w.device)
        self.register_buffer("velora_v", v)

    def forward(self, x):
        w = self.weight
        if not (self.training and torch.is_grad_enabled() and w.requires_grad):
            return super().forward(x)
        v = self.velora_v
        if not self.velora_ready:  # batch_average_once: the normalised mean sub-token
            with torch.no_grad():
                v.copy_(F.normalize(x.detach().reshape(-1, v.numel()).mean(0).to(v.dtype), dim=0))
            self.velora_ready = True
        transposed = not isinstance(self, torch.nn.Linear)
        return VeLoRAFunction.apply(x, w, self.bias, v, self.velora_groups, self.velora_scale, transposed)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, velora_groups={self.velora_groups}, "
                f"sub_token_size={self.velora_v.numel()}, velora_scale={self.velora_scale}")


_CLASSES: dict[type, type] = {}


def velora_class(cls: type) -> type:
    """The VeLoRA version of a linear layer class (made once per class)."""
    if issubclass(cls, VeLoRALayer):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"VeLoRA{cls.__name__}", (VeLoRALayer, cls), {})
    return _CLASSES[cls]


def wrap(module: torch.nn.Module, num_groups: int, scale: float) -> torch.nn.Module:
    """Make a Linear / Conv1D a VeLoRA layer in place (same object, parameters and names)."""
    module.__class__ = velora_class(type(module))
    module.velora_setup(num_groups, scale)
    return module


def select(model: torch.nn.Module, letters: str) -> tuple[list, list, list]:
    """(wrapped: [(target name, its layer's kind, module)], frozen kinds, letters that name
    no layer of this model). A LoRALinear target gives its lora_A."""
    kinds = {kind for letter in letters for kind in LAYERS[letter]}
    types = linear_types()
    chosen, frozen, found = [], [], set()
    for name, module in model.named_modules():
        kind = _kind(name)
        if kind not in kinds or kind == name:
            continue
        if isinstance(module, LoRALinear):
            chosen.append((f"{name}.lora_A", kind, module.lora_A))
        elif isinstance(module, types):
            if module.weight.requires_grad:
                chosen.append((name, kind, module))
            elif kind not in frozen:
                frozen.append(kind)
        else:
            continue
        found.add(kind)
    missing = [letter for letter in letters if not found.intersection(LAYERS[letter])]
    return chosen, frozen, missing


class Probe:
    """The first training forward, watched: which modules read which storage, and whether
    each wrapped layer's input storage outlives the model's forward."""

    def __init__(self, model, wrapped):
        self.wrapped = {id(m): (name, kind) for name, kind, m in wrapped}
        self.readers: dict[int, tuple] = {}  # storage key -> (its storage, weakly; ids of trainable readers)
        self.inputs: list = []  # (name, kind, module, readers of its input, the input storage weakly, numel, bytes)
        self.plain: list[str] = []  # kinds of wrapped layers a later method froze (they ran plain)
        self.handles = [m.register_forward_pre_hook(self.saw) for m in model.modules()
                        if isinstance(m, linear_types())]

    def saw(self, module, args):
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor):
            return
        storage = x.untyped_storage()
        key = storage._cdata
        entry = self.readers.get(key)
        if entry is None or entry[0]() is not storage:  # a new storage (a freed one's key is reused)
            entry = self.readers[key] = (weakref.ref(storage), [])
        if module.weight.requires_grad:
            entry[1].append(id(module))
        if id(module) in self.wrapped and not module.weight.requires_grad:  # frozen after wrapping
            self.plain.append(self.wrapped[id(module)][1])
        elif id(module) in self.wrapped:
            name, kind = self.wrapped[id(module)]
            self.inputs.append((name, kind, module, entry[1], weakref.ref(storage), x.numel(), x.element_size()))

    def close(self, model) -> dict:
        for h in self.handles:
            h.remove()
        names = {id(m): _kind(n) for n, m in model.named_modules()}
        per_kind: dict[str, dict] = {}
        change = 0
        for name, kind, module, readers, ref, numel, size in self.inputs:
            freed = ref() is None
            d_in = in_out_features(module)[0]
            tokens = numel // d_in
            entry = per_kind.setdefault(kind, {"freed": 0, "held": 0, "read_also_by": []})
            entry["freed" if freed else "held"] += 1
            for other in readers:
                if other != id(module) and names[other] not in entry["read_also_by"]:
                    entry["read_also_by"].append(names[other])
            change += tokens * module.velora_groups * size - (tokens * d_in * size if freed else 0)
        for kind in self.plain:
            entry = per_kind.setdefault(kind, {"freed": 0, "held": 0, "read_also_by": []})
            entry["ran_plain"] = entry.get("ran_plain", 0) + 1
        tokens = self.inputs[0][5] // in_out_features(self.inputs[0][2])[0] if self.inputs else 0
        return {"per_layer": per_kind, "tokens": tokens, "expected_activation_change_bytes": change}


class VeLoRA(Method):
    paper = ("Miles, Reddy, Elezi, Deng, VeLoRA: Memory Efficient Training using Rank-1 Sub-Token "
             "Projections, NeurIPS 2024, arXiv 2405.17991")
    defaults = dict(velora_layers="vd", num_groups=32, velora_scale=1.0)
    choices = {"velora_layers": LAYER_CHOICES}
    ranges = {"num_groups": "[1, inf)", "velora_scale": "(0, inf)"}

    def transform_model(self, model):
        hp = self.hp
        chosen, frozen, missing = select(model, hp["velora_layers"])
        if not chosen:
            kinds = sorted({_kind(n) for n, m in model.named_modules()
                            if isinstance(m, linear_types()) and _kind(n) != n})
            raise MethodError(f"velora: velora_layers {hp['velora_layers']!r} selects no trainable linear layer "
                              f"of {type(model).__name__}" + (f" (frozen: {', '.join(frozen)})" if frozen else "")
                              + f"; its block layers: {', '.join(kinds) or 'none'}")
        layers = {}
        for name, kind, module in chosen:
            wrap(module, hp["num_groups"], hp["velora_scale"])
            d_in, _ = in_out_features(module)
            entry = layers.setdefault(kind, {"wraps": _kind(name), "count": 0, "in_features": d_in,
                                             "num_groups": module.velora_groups,
                                             "sub_token_size": d_in // module.velora_groups})
            entry["count"] += 1
        self.report = {"velora_layers": hp["velora_layers"], "layers": layers}
        if frozen:
            self.report["frozen_not_wrapped"] = frozen
        if missing:
            self.report["not_in_model"] = "".join(missing)
        self._probe = None
        self._wrapped = chosen
        model.register_forward_pre_hook(self._probe_start)
        model.register_forward_hook(self._probe_end, always_call=True)
        return model

    # -- the measurement of what is freed, on the first training forward ------------------
    def _probe_start(self, model, args):
        if self._probe is None and self._wrapped and model.training and torch.is_grad_enabled():
            self._probe = Probe(model, self._wrapped)

    def _probe_end(self, model, args, output):
        probe = self._probe
        if probe is None or not self._wrapped:
            return
        self._wrapped = []  # once
        measured = probe.close(model)
        for kind, entry in self.report["layers"].items():
            entry.update(measured["per_layer"].get(kind, {}))
        layers = self.report["layers"]
        freed, held, plain = ([k for k, e in layers.items() if e.get(key)] for key in ("freed", "held", "ran_plain"))
        self.report.update(tokens_measured=measured["tokens"],
                           expected_activation_change_bytes=measured["expected_activation_change_bytes"],
                           saving=_saving_line(freed, held, plain, layers))
        self._probe = None


def _saving_line(freed: list, held: list, plain: list, layers: dict) -> str:
    parts = []
    if freed:
        parts.append(f"input freed: {', '.join(freed)}")
    if held:
        others = sorted({o for k in held for o in layers[k].get("read_also_by", [])})
        by = f" (also read by {', '.join(others)})" if others else ""
        parts.append(f"input still held by another op{by}: {', '.join(held)}; wrapping these frees "
                     f"nothing and adds their z")
    if plain:
        parts.append(f"frozen by a later method, so run as plain frozen layers (stack lora first, "
                     f"lora+velora): {', '.join(plain)}")
    return "; ".join(parts) or "no wrapped layer ran"


METHOD = VeLoRA

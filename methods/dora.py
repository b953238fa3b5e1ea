"""DoRA: LoRA's direction plus a trainable magnitude per output row, the norm detached.

Liu, Wang, Yin, Molchanov, Wang, Cheng, Chen, "DoRA: Weight-Decomposed Low-Rank
Adaptation", ICML 2024, arXiv 2402.09353. Each target layer y = W x + b keeps W and b
frozen; its weight is decomposed into a magnitude and a direction (Eq. 5), the direction
updated by LoRA, the magnitude trained directly:

    W' = m * (W + s B A) / ||W + s B A||_c     ||.||_c: L2 norm of each output row
    A ~ U(-1/sqrt(d_in), 1/sqrt(d_in)),  B = 0,  s = alpha / r        (LoRA's, methods/lora.py)
    m = ||W + s B A||_c at init (= ||W||_c, since B = 0): one entry per output feature
    ||W + s B A||_c is recomputed every step and treated as a constant (Section 4.3:
    detached, no gradient through it), so W' = W at step 0 and the model starts as the base

Hugging Face peft 0.21.2 (`LoraConfig(use_dora=True)`: `DoraLinearVariant.forward` and
`DoraLinearLayer.forward`, tuners/lora/variants.py and dora.py) computes it, and so do
we, op for op, in the same nested calls (so that each temporary is freed at the same
point), with x the layer's input and r0 = base(x) its frozen output:

    r0 = base(x)                                  (bias included)
    if dropout is the identity or in eval:  x_l = x,      b = r0 - bias (r0 if no bias)
    else:                                   x_l = drop(x), b = None
    L = B(A(I_{d_in})).T                          (d_out x d_in: s B A without s, made through
                                                   the adapters' forward on an identity)
    n = ||W + s L.detach()||_c, detached          (torch.linalg.norm(dim=1), d_out values)
    k = (m / n).view(1, d_out)
    l = B(A(x_l))
    if b is None: b = F.linear(x_l, W)            (the base output again, on the dropped input)
    y = r0 + ((k - 1) * b + k * l * s)

which at p = 0 (or in eval) is m/n * (W x + s B A x) + bias: DoRA's W' x + bias with the
norm a constant (with dropout, peft's: W x + bias + (k - 1) W drop(x) + k s B A drop(x)).
GPT-2's `Conv1D` stores W as (d_in, d_out); peft sets `fan_in_fan_out` for it and
transposes with `peft.utils.other.transpose`, which wraps the transpose of a Parameter in
a new `nn.Parameter`, one that requires grad. So for a Conv1D layer (only) the norm is
taken in a graph (its input W + s L is saved until the detach drops it), and with dropout
> 0 the recomputed F.linear(x_l, W^T) keeps x_l for, and in backward computes, a d_out x
d_in gradient of that throwaway parameter, alive until the step's loss is freed. We do
the same (`_transpose`), so that memory matches peft's; it is peft's cost, not DoRA's.
(bench's memory tracker, as of this writing, keeps that norm graph alive: its saved-tensor
hook holds the saved norm with its grad_fn, a cycle no collector sees, so a tracked or
simulated GPT-2 run counts each Conv1D layer's W + s L, d_out d_in e, as activation for
good, ours and peft's alike; without the tracker it is freed at the detach.)

What DoRA keeps beyond LoRA (N tokens, element size e = the model's dtype; adapters take
the base dtype, as in methods/lora.py):

- parameters: m, d_out per layer (`param`, trainable: `trainable_params` = sum over
  targets of r (d_in + d_out) + d_out); its gradient and AdamW moments;
- saved for backward per layer (`activation`, alive until backward): b (the base output
  less its bias, N d_out e), l (B's output, N d_out e), n (d_out e, saved by m / n),
  k (d_out e, saved by k * l) and, where x requires grad (every layer but those reading
  the frozen embeddings: GPT-2's first c_attn, BERT's and LLaMA's first q, k, v), k - 1
  (d_out e): 2 N d_out e + (2 or 3) d_out e per layer, on top of LoRA's N d_in e
  (A's input) + N r e (B's input);
- transient, in each layer's forward: the identity (d_in^2 e) and A(I) (d_in r e), kept by
  L's graph until the layer returns, L (d_in d_out e), s L and W + s L (d_out d_in e each):
  up to 3 d_out d_in e + d_in^2 e + d_in r e at once, the dense W + s B A materialised for
  the norm (peft's choice: "for FSDP-safety"); nothing weight-sized in backward (the norm
  is detached), except the Conv1D dropout gradient above.

At the peak (the end of forward, or the last layers' forward with one layer's transient on
top) every layer's 2 N d_out e + O(d_out) is alive, about as much as the base layers'
outputs themselves: a DoRA model keeps roughly twice LoRA's activations (LLaMA-7B, batch
1 x 512, bfloat16, simulated: 5.4 GiB against 2.7 GiB). One layer's transient (3 d_out d_in
+ d_in^2 elements: about 0.5 GiB for LLaMA-7B's down_proj, d_in 11008) is alive at a time.

Targets, rank, alpha, dropout and the adapters' initialisation (same seed, same A) are
LoRA's (methods/lora.py: `targets` "all-linear" by default); every base parameter frozen;
the optimizer is the contract's AdamW or a stacked member's. `method_report` names the
layers and the trainable parameters. The peer methods/dora_peft.py runs peft itself.
"""
from __future__ import annotations

import contextlib

import torch

from bench.method import Method, MethodError
from methods.lora import LoRA, LoRALinear, fake_mode_of, report, select_targets


class Magnitude(torch.nn.Module):
    """m (d_out,) as `.weight`, as peft's `lora_magnitude_vector[adapter]` holds it (so the
    parameters come in peft's order: base, A, B, m)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=True)


class DoRALinear(LoRALinear):
    """A frozen linear layer (`base_layer`), LoRA's A and B, and the magnitude m
    (`lora_magnitude_vector.weight`); the forward is peft 0.21.2's (module docstring)."""

    def __init__(self, base_layer: torch.nn.Module, rank: int, alpha: float, dropout: float):
        super().__init__(base_layer, rank, alpha, dropout)
        self.fan_in_fan_out = not isinstance(base_layer, torch.nn.Linear)  # GPT-2's Conv1D
        weight = base_layer.weight
        with fake_mode_of(weight) or contextlib.nullcontext(), torch.no_grad():
            # peft's DoraLinearLayer.update_layer: the norm of W + s B A (B is zero: ||W||)
            norm = self.weight_norm(weight, self.lora_B.weight @ self.lora_A.weight, self.scaling)
        self.lora_magnitude_vector = Magnitude(norm)

    def _transpose(self, weight: torch.Tensor) -> torch.Tensor:
        """peft.utils.other.transpose: a Conv1D weight as (d_out, d_in); a Parameter's
        transpose is a new Parameter (requiring grad), as peft makes it."""
        if not self.fan_in_fan_out:
            return weight
        if isinstance(weight, torch.nn.Parameter):
            return torch.nn.Parameter(weight.T)
        return weight.T

    def weight_norm(self, weight, lora_weight, scaling) -> torch.Tensor:
        """||W + s L||_c, one value per output row (peft's `get_weight_norm`)."""
        weight = self._transpose(weight)
        weight = weight + scaling * lora_weight
        return torch.linalg.norm(weight, dim=1).to(weight.dtype)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # peft's lora.Linear.forward (the input cast is a no-op: adapters in x's dtype)
        result = self.base_layer(x, *args, **kwargs)
        return self._variant_forward(x, result)

    def _variant_forward(self, x: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
        # peft's DoraLinearVariant.forward
        if isinstance(self.lora_dropout, torch.nn.Identity) or not self.training:
            base_result = result
        else:
            x = self.lora_dropout(x)
            base_result = None
        return result + self._dora(x, base_result)

    def _dora(self, x: torch.Tensor, base_result: torch.Tensor | None) -> torch.Tensor:
        # peft's DoraLinearLayer.forward: (k - 1) * b + k * s * B(A(x)), k = m / ||W + s B A||_c
        lora_A, lora_B, scaling = self.lora_A, self.lora_B, self.scaling
        x_eye = torch.eye(lora_A.weight.shape[1], device=lora_A.weight.device, dtype=lora_A.weight.dtype)
        lora_weight = lora_B(lora_A(x_eye)).T
        lora_weight = lora_weight.to(x.dtype)
        magnitude = self.lora_magnitude_vector.weight
        weight = self.base_layer.weight.to(x.dtype)
        weight_norm = self.weight_norm(weight, lora_weight.detach(), scaling)
        weight_norm = weight_norm.detach()  # Section 4.3: the norm is a constant
        mag_norm_scale = (magnitude / weight_norm).view(1, -1)
        lora_result = lora_B(lora_A(x))
        if base_result is not None:
            bias = self.base_layer.bias
            if bias is not None:
                base_result = base_result - bias
        else:
            base_result = torch.nn.functional.linear(x, self._transpose(weight))
        return (mag_norm_scale - 1) * base_result + mag_norm_scale * lora_result * scaling


def dora_targets(model: torch.nn.Module, targets: str, method: str) -> list[str]:
    """`select_targets`, its error naming `method`."""
    try:
        return select_targets(model, targets)
    except MethodError as e:
        raise MethodError(str(e).replace("lora:", f"{method}:", 1)) from None


class DoRA(Method):
    paper = ("Liu et al., DoRA: Weight-Decomposed Low-Rank Adaptation, ICML 2024, arXiv 2402.09353 "
             "(as peft 0.21.2's use_dora)")
    defaults = dict(LoRA.defaults)
    choices, ranges = LoRA.choices, LoRA.ranges

    def transform_model(self, model):
        hp = self.hp
        names = dora_targets(model, hp["targets"], self.name)
        for p in model.parameters():
            p.requires_grad_(False)
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, child, DoRALinear(getattr(parent, child), hp["rank"], hp["alpha"], hp["dropout"]))
        self.report = report(names, model)
        return model


METHOD = DoRA

"""Approx-BP's memory-sharing norms: LayerNorm and RMSNorm whose backward reads the OUTPUT.

Yang, Shi, Wang, Zhen, Shi, Xu, "Reducing Fine-Tuning Memory Overhead by Approximate and
Memory-Sharing Backpropagation", ICML 2024, arXiv 2406.16282 (code: yyyyychen/LowMemoryBP,
package `lomem`, CUDA kernels). This is our own pure-PyTorch version (CPU, CUDA, fake
tensors); `swap_norms(model)` puts it into a Hugging Face model in place.

A norm's standard backward needs its input x. The input is the residual stream, which
nothing else keeps for backward; the output y is the input of the next Linear, which keeps
it anyway. MS-BP rewrites the backward in terms of y (and one scalar per row, rstd), so the
norm saves the same storage as the Linear after it and its own activation memory is gone:

    MS-LayerNorm (per row, N features)      x_hat = (x - mean(x)) * rstd,  rstd = 1/sqrt(var(x) + eps)
        forward    y = w * x_hat + b        save  y, rstd          (baseline: x, mean, rstd)
        backward   x_hat = (y - b) / w
                   g = dy * w
                   dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))
                   dw = sum_rows dy * x_hat ,  db = sum_rows dy
    MS-RMSNorm                              x_hat = x * rstd,  rstd = 1/sqrt(mean(x^2) + eps)
        forward    y = w * x_hat            save  y, rstd          (baseline, LLaMA's code: x in
                                                                    float32, x * rstd, x_hat)
        backward   x_hat = y / w
                   g = dy * w
                   dx = rstd * (g - x_hat * mean(g * x_hat))
                   dw = sum_rows dy * x_hat

Both formulas are exact (eps included: d rstd / dx = -rstd^3 (x - mean) / N and x - mean =
x_hat / rstd); gradients equal autograd's up to rounding. In float32 and float64 that is
all; in bfloat16 x_hat is recovered from the rounded y (relative error 2^-9, as the paper's
kernels, which also keep y in the activation dtype), where autograd used x.

Affine weights. The paper's `MSLayerNorm` / `MSRMSNorm` have none: the authors merge w and b
into the following Linear (W' = W diag(w), b' = b_lin + W b) before fine-tuning, so x_hat is
the norm's output and no division is needed. That changes the parameters the optimizer
sees (and so the training), so here the affine stays and x_hat = (y - b) / w. Where w_j = 0
(y_j does not depend on x_hat_j) the division is undefined; what we do instead:
  - LayerNorm: x_hat has zero mean in every row, so a single zero column is recovered
    exactly and for free: x_hat_k = -sum_{j != k} x_hat_j. With several zero columns that
    sum is shared equally among them (their dx and dw are then approximate; everything else
    stays exact).
  - RMSNorm has no such identity (x_hat_k^2 is known, its sign is not): the `exact_columns`
    columns with the smallest |w| (default 1) keep x_hat exactly, B*S elements per norm (the
    size of rstd). Further zero columns get x_hat = 0 (their dx and dw are then wrong).
  - |x_hat| <= sqrt(N) holds for every true x_hat; recovered values are clamped to it, so a
    tiny w (y - b a rounding error divided by 1e-300) gives nothing infinite.
For tiny nonzero |w_j|, x_hat_j = (y_j - b_j) / w_j loses precision as ulp(y_j) / |w_j|.

What it saves, per norm and token (hidden H, e bytes per element of the activation dtype),
when the next op keeps y (GPT-2 ln_1 -> c_attn, ln_2 -> c_fc, ln_f -> lm_head; BERT's
attention-output and layer-output LayerNorms -> the next dense / q, k, v; LLaMA's
input_layernorm -> q, k, v, post_attention_layernorm -> gate, up, norm -> lm_head):
  - LayerNorm: H*e (x) + the mean (4 bytes on CUDA, float32; e on CPU); rstd stays.
  - LlamaRMSNorm, as Hugging Face writes it (x.to(float32); x * rsqrt(...); w * x_hat.to(dtype)):
    autograd keeps x in float32 (a copy; x itself in a float32 model) and x_hat in the
    activation dtype: H*(4 + e) bytes (6H for bfloat16, 8H for float32), less the kept
    column (e bytes) and its index.
  Measured (tests; simulated at batch 8, seq 512): exactly these bytes, e.g. 96.0 MiB per
  RMSNorm of LLaMA-7B in bfloat16 and 8.0 MiB per LayerNorm of BERT-large.
Where y is not kept by anything else (BERT's embedding LayerNorm feeds dropout), saving y
instead of x saves nothing and costs nothing.

Under autocast, a norm runs the standard layer (autocast's float32 norm makes a new tensor
for the next Linear; the paper's README notes the same failure to share).
"""
from __future__ import annotations

import math
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from transformers.models.llama.modeling_llama import LlamaRMSNorm


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- MS-LayerNorm ----------------------------------------------------------------------------


def _layer_norm_x_hat(y: torch.Tensor, weight, bias, n: int, cd: torch.dtype) -> torch.Tensor:
    """x_hat (rows x N, in `cd`) recovered from the output y = w * x_hat + b."""
    x_hat = y.reshape(-1, n).to(cd)
    if bias is not None:
        x_hat = x_hat - bias.reshape(-1).to(cd)
    if weight is None:
        return x_hat
    w = weight.reshape(-1).to(cd)
    zero = w == 0
    x_hat = (x_hat / torch.where(zero, 1, w)).masked_fill_(zero, 0)
    bound = math.sqrt(n)
    x_hat = x_hat.clamp_(-bound, bound)
    # rows of x_hat sum to 0: the zero columns share what the others leave (exact for one)
    n_zero = zero.sum().clamp(min=1).to(cd)
    fill = x_hat.sum(1, keepdim=True).neg_().div_(n_zero)
    return torch.where(zero, fill, x_hat).clamp_(-bound, bound)


class MSLayerNormFunction(torch.autograd.Function):
    """y = LayerNorm(x; w, b), keeping y and rstd for backward (never x nor the mean)."""

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps):
        y, _mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.n = math.prod(normalized_shape)
        ctx.save_for_backward(y, rstd, weight, bias)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        y, rstd, weight, bias = ctx.saved_tensors
        n = ctx.n
        cd = _compute_dtype(y.dtype)
        x_hat = _layer_norm_x_hat(y, weight, bias, n, cd)
        dy = grad_y.reshape(-1, n).to(cd)
        g = dy * weight.reshape(-1).to(cd) if weight is not None else dy
        proj = (g * x_hat).mean(1, keepdim=True)
        dx = (g - g.mean(1, keepdim=True) - x_hat * proj).mul_(rstd.reshape(-1, 1).to(cd))
        d_weight = d_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            d_weight = (dy * x_hat).sum(0).reshape(weight.shape).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            d_bias = dy.sum(0).reshape(bias.shape).to(bias.dtype)
        return dx.reshape(grad_y.shape).to(grad_y.dtype), d_weight, d_bias, None, None


class MSLayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters, same forward) whose backward works from its output."""

    @classmethod
    def from_layer_norm(cls, ln: nn.LayerNorm) -> "MSLayerNorm":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape, new.eps, new.elementwise_affine = ln.normalized_shape, ln.eps, ln.elementwise_affine
        new.weight, new.bias = ln.weight, ln.bias  # the same Parameter objects (or None)
        return new

    def forward(self, x):
        if torch.is_autocast_enabled(x.device.type):
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return MSLayerNormFunction.apply(x, self.weight, self.bias, tuple(self.normalized_shape), self.eps)


# -- MS-RMSNorm ------------------------------------------------------------------------------


def _smallest_columns(weight: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(weight.detach().reshape(-1).abs(), k, largest=False, sorted=True).indices


class MSRMSNormFunction(torch.autograd.Function):
    """LLaMA's RMSNorm, y = w * (x * rstd).to(x.dtype) with rstd in float32 (float64 for a
    float64 x), keeping y, rstd and x_hat of the `k` columns with the smallest |w|."""

    @staticmethod
    def forward(ctx, x, weight, eps, k: int):
        cd = _compute_dtype(x.dtype)
        h = x.to(cd)
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        x_hat = (h * rstd).to(x.dtype)
        y = weight * x_hat
        n = x.shape[-1]
        k = min(k, n)
        idx = cols = None
        if k:
            idx = _smallest_columns(weight, k)
            cols = x_hat[..., idx]
        ctx.n, ctx.k = n, k
        ctx.save_for_backward(y, rstd, weight, idx, cols)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        y, rstd, weight, idx, cols = ctx.saved_tensors
        n, k = ctx.n, ctx.k
        cd = _compute_dtype(y.dtype)
        w = weight.reshape(-1).to(cd)
        zero = w == 0
        x_hat = (y.reshape(-1, n).to(cd) / torch.where(zero, 1, w)).masked_fill_(zero, 0)
        bound = math.sqrt(n)
        x_hat = x_hat.clamp_(-bound, bound)
        if k:
            x_hat.index_copy_(1, idx, cols.reshape(-1, k).to(cd))
        dy = grad_y.reshape(-1, n).to(cd)
        g = dy * w
        dx = (g - x_hat * (g * x_hat).mean(1, keepdim=True)).mul_(rstd.reshape(-1, 1).to(cd))
        d_weight = None
        if ctx.needs_input_grad[1]:
            d_weight = (dy * x_hat).sum(0).reshape(weight.shape).to(weight.dtype)
        return dx.reshape(grad_y.shape).to(grad_y.dtype), d_weight, None, None


class MSRMSNorm(LlamaRMSNorm):
    """LlamaRMSNorm (same parameter, same forward up to float64 inputs, which Hugging Face
    rounds to float32 inside the norm and this does not) whose backward works from its output."""

    @classmethod
    def from_rms_norm(cls, norm: LlamaRMSNorm, exact_columns: int = 1) -> "MSRMSNorm":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.weight, new.variance_epsilon = norm.weight, norm.variance_epsilon
        new.exact_columns = exact_columns
        return new

    def forward(self, hidden_states):
        if torch.is_autocast_enabled(hidden_states.device.type):
            return super().forward(hidden_states)
        return MSRMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon, self.exact_columns)


# -- swapping ----------------------------------------------------------------------------------


def swap_norms(model: nn.Module, exact_columns: int = 1) -> dict:
    """Replace, in place, every nn.LayerNorm (GPT-2, BERT) and LlamaRMSNorm (LLaMA) by its
    memory-sharing version, keeping the same Parameter objects. Returns counts per replaced
    type, e.g. {"LayerNorm": 5}; norms swapped before are counted under their old type
    name, other norm classes are listed under "not_swapped" (count per class name)."""
    swapped, others = Counter(), Counter()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, MSLayerNorm):
                swapped["LayerNorm"] += 1
            elif isinstance(child, MSRMSNorm):
                swapped["LlamaRMSNorm"] += 1
            elif type(child) is nn.LayerNorm:
                setattr(parent, name, MSLayerNorm.from_layer_norm(child))
                swapped["LayerNorm"] += 1
            elif type(child) is LlamaRMSNorm:
                setattr(parent, name, MSRMSNorm.from_rms_norm(child, exact_columns))
                swapped["LlamaRMSNorm"] += 1
            elif "norm" in type(child).__name__.lower():
                others[type(child).__name__] += 1
    report = dict(sorted(swapped.items()))
    if others:
        report["not_swapped"] = dict(sorted(others.items()))
    return report

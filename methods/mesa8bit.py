"""Mesa-style 8-bit saved activations: every tensor autograd keeps for backward, stored as
uint8 codes with a (min, max) pair per group of `group_size` elements; forward unchanged.

Pan, Chen, He, Liu, Cai, Zhuang, "Mesa: A Memory-saving Training Framework for
Transformers", arXiv 2111.11124, 2021 (code: ziplab/Mesa, a CUDA extension with one custom
layer per op type). Mesa keeps the exact forward pass and quantizes what each layer saves
for backward to 8 bits; the backward then runs on the dequantized values. Here this is done
once for every op, through `torch.autograd.graph.saved_tensors_hooks` around the model's
forward, so it applies to any model and stacks with any method (one that owns the step
too: only the model's forward is wrapped). In the paper's notation, per group g of a saved
activation x (Mesa: alpha = range, beta = min, 256 levels):

    pack      lo_g = min_{i in g} x_i ,  hi_g = max_{i in g} x_i          stored exactly
              s_g = (hi_g - lo_g) / 255        (computed again when unpacking; 1 if 0)
              q_i = round((x_i - lo_g) / s_g)  in {0, ..., 255}, uint8
    unpack    x~_i = q_i s_g + lo_g            |x~_i - x_i| <= s_g / 2
    backward  the saved op's own formula, on x~

A Linear y = x W^T keeps x (quantized) and W (a parameter, kept as is): dx = dy W is exact,
and dW~ - dW = dy^T (x~ - x), so elementwise |dW~ - dW| <= |dy|^T (s / 2), with s the
group's step at each element of x (tested).

Choices where Mesa differs or leaves freedom:
- Groups: `group_size` (default 64) contiguous elements of the saved tensor, in memory
  order (a transposed view is quantized as the block of memory it covers, so all views of
  one block share one copy; a view with gaps, e.g. one of q, k, v split from a fused qkv
  output, as a row-major copy). For an activation [tokens, hidden], a group is one
  token's channels of one attention head (head size 64 in GPT-2, BERT; half a head in
  LLaMA), a finer version of Mesa's per-head groups (Mesa shares one range per head over
  all tokens). Cost per element: 1 byte + 2
  values of the activation dtype per group: 1.125 bytes for float32 (28% of 4), 1.0625
  for bfloat16 (53% of 2).
- Ranges: the exact min and max of each group, every step (Mesa keeps running estimates of
  them, an EMA with decay 0.9 over steps, and clips what falls outside). Ours have no state
  and a hard error bound; they cost one min/max pass per saved tensor.
- Rounding: to nearest (Mesa's kernel rounds stochastically: unbiased, but with up to a
  whole step of error); here deterministic, within half a step.
- (De)quantizing runs in `PIECES` (16) chunks of a tensor, or in chunks of `CHUNK_ELEMENTS`
  (2^10) elements of a smaller one, so its float temporaries stay a sixteenth of the saved
  tensor, and a paper-sized one takes a bounded number of operations. The small least
  chunk puts every saved tensor of a paper-sized model (16k elements or more: LLaMA-7B's
  smallest, the attention's log-sum-exp, has 16k a sequence of 512 tokens) in 16 pieces at
  every batch size, so a step runs the same operations at every batch, and `membench fit`
  reads most batches from a line through three (docs/fit.md).
- What is not quantized (kept as saved, counted in `report`):
  parameters and buffers (a Linear's weight is kept by the model anyway: quantizing it would
  add memory), found by storage, so views such as W^T are recognised; integer and bool
  tensors (indices, masks); tensors of fewer than `min_numel` elements; per-row statistics
  (last dimension 1: LayerNorm's mean and rstd, RMSNorm's rstd).
- A storage saved several times in one forward (BERT's q, k, v Linears keep the same input;
  a memory-sharing norm and the Linear after it keep the same output) is quantized once and
  shared, as the original was.
- Activation checkpointing: stacks, but the tensors saved inside checkpointed blocks go to
  the checkpoint's own hooks (the innermost), not to these, and the forward re-run during
  backward is outside the wrapped forward: with `checkpointing`, only what is saved outside
  the blocks (embeddings, final norm, LM head) is quantized.

Outer hooks (the memory tracker's, another method's) still see every saved tensor: packing
passes what it stores (codes, ranges, or the tensor kept as is) through them.

Measured (bench memory jobs, NOTES-actnorm.md): saved activations at the peak -78% on the
tiny float32 models (batch 16, seq 128); simulated in bfloat16 at batch 8, seq 512:
LLaMA-7B activations -53%, peak -17.6%; BERT-large -39%, peak -22% (its 1-byte dropout
masks stay as they are).
"""
from __future__ import annotations

import math
import weakref
from collections import Counter

import torch
import torch.nn.functional as F

from bench.method import Method
from methods._common.chunks import chunk_size

LEVELS = 256
CHUNK_ELEMENTS = 2**10  # elements per chunk, at least
PIECES = 16  # chunks of a larger tensor, at most


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _step(lo: torch.Tensor, hi: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
    step = (hi.to(cd) - lo.to(cd)) / (LEVELS - 1)
    return torch.where(step == 0, 1, step)


def _chunk_groups(n_groups: int, group_size: int) -> int:
    """Groups per chunk: 1/PIECES of the tensor, or about CHUNK_ELEMENTS elements of a
    smaller one; the float temporaries of (de)quantizing stay that small."""
    return max(1, chunk_size(n_groups * group_size, CHUNK_ELEMENTS, PIECES) // group_size)


def quantize(x: torch.Tensor, group_size: int):
    """(codes uint8 [groups, group_size], lo [groups], hi [groups]) of x's elements in
    row-major order, the last group zero padded."""
    flat = x.detach().reshape(-1)
    pad = (-flat.numel()) % group_size
    if pad:
        flat = F.pad(flat, (0, pad))
    groups = flat.view(-1, group_size)
    lo, hi = groups.amin(1), groups.amax(1)
    cd = _compute_dtype(x.dtype)
    low = lo.to(cd)[:, None]  # once for all chunks: a group's min and step, in cd
    step = _step(low, hi[:, None], cd)
    codes = torch.empty(groups.shape, dtype=torch.uint8, device=x.device)
    rows = _chunk_groups(len(groups), group_size)  # views of each chunk, made once
    for g, lo_g, s, c in zip(groups.split(rows), low.split(rows), step.split(rows), codes.split(rows)):
        # (x - lo) / s in cd (a bfloat16 chunk is promoted): one float temporary a chunk
        c.copy_(torch.sub(g, lo_g).div_(s).round_().clamp_(0, LEVELS - 1))
    return codes, lo, hi


def dequantize(codes, lo, hi, shape, dtype) -> torch.Tensor:
    cd = _compute_dtype(dtype)
    low = lo.to(cd)[:, None]
    step = _step(low, hi[:, None], cd)
    x = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    rows = _chunk_groups(len(codes), codes.shape[1])
    for out, c, s, lo_g in zip(x.split(rows), codes.split(rows), step.split(rows), low.split(rows)):
        out.copy_(torch.addcmul(lo_g, c, s))  # lo + code x step, in cd (the uint8 codes promoted)
    return x.view(-1)[: math.prod(shape)].view(shape)


def step_per_element(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """The quantization step s of each element of a contiguous x (for error bounds); 0
    where a group is constant (stored exactly)."""
    _, lo, hi = quantize(x, group_size)
    step = _step(lo, hi, _compute_dtype(x.dtype))
    step = torch.where(hi == lo, 0, step)  # a constant group is stored exactly
    return step.repeat_interleave(group_size)[: x.numel()].view(x.shape)


def _dense(t: torch.Tensor) -> bool:
    """True if t's elements fill a block of its storage without gaps or overlaps (any order
    of dimensions): then every view of that block is one saved tensor."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class _Packed:
    """A quantized saved tensor: shared codes and ranges of a block of memory (`data`), and
    this save's view of it (shape, strides; None for a row-major copy)."""

    __slots__ = ("data", "shape", "stride", "dtype")

    def __init__(self, data, shape, stride, dtype):
        self.data, self.shape, self.stride, self.dtype = data, shape, stride, dtype

    def value(self, outer_unpack) -> torch.Tensor:
        codes, lo, hi = (outer_unpack(x) if outer_unpack else x for x in self.data)
        n = math.prod(self.shape)
        flat = dequantize(codes, lo, hi, (n,), self.dtype)
        return flat.view(self.shape) if self.stride is None else flat.as_strided(self.shape, self.stride)


class SavedActivationQuantizer:
    """The saved-tensor hooks of one forward pass of `model`."""

    def __init__(self, model: torch.nn.Module, group_size: int, min_numel: int):
        self.group_size, self.min_numel = group_size, min_numel
        self.kept = {t.untyped_storage()._cdata
                     for t in [*model.parameters(), *model.buffers()]}
        self.cache: dict = {}  # storage view -> packed data, this forward only
        self.counts = Counter()
        self.bytes = Counter()
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.outer_pack, self.outer_unpack = outer if outer is not None else (None, None)

    def _keep_reason(self, t: torch.Tensor) -> str | None:
        if not t.is_floating_point():
            return "integer_or_bool"
        if t.untyped_storage()._cdata in self.kept:
            return "parameter_or_buffer"
        if t.numel() < self.min_numel:
            return "small"
        if t.dim() == 0 or t.shape[-1] == 1:
            return "statistics"
        return None

    def pack(self, t: torch.Tensor):
        reason = self._keep_reason(t)
        outer = self.outer_pack
        if reason is not None:
            self.counts[f"kept_{reason}"] += 1
            return (outer(t) if outer else t), self.outer_unpack
        storage = t.untyped_storage()
        shape, n = tuple(t.shape), t.numel()
        if _dense(t):  # its block of memory, in memory order: shared by all its views
            stride, flat = t.stride(), t.detach().as_strided((n,), (1,), t.storage_offset())
            key = (storage._cdata, t.storage_offset(), n, t.dtype, t._version)
        else:  # a row-major copy, shared by equal views only
            stride, flat = None, t.detach().reshape(-1)
            key = (storage._cdata, t.storage_offset(), n, t.dtype, t._version, shape, t.stride())
        entry = self.cache.get(key)
        if entry is not None and entry[0]() is storage:
            self.counts["shared"] += 1
            return _Packed(entry[1], shape, stride, t.dtype), self.outer_unpack
        codes, lo, hi = quantize(flat, self.group_size)
        data = tuple(outer(x) if outer else x for x in (codes, lo, hi))
        self.cache[key] = (weakref.ref(storage), data)
        self.counts["quantized"] += 1
        self.bytes["quantized_bytes"] += t.numel() * t.element_size()
        self.bytes["packed_bytes"] += sum(x.numel() * x.element_size() for x in (codes, lo, hi))
        return _Packed(data, shape, stride, t.dtype), self.outer_unpack

    @property
    def report(self) -> dict:
        return dict(sorted({**self.counts, **self.bytes}.items()))


def _unpack(packed):
    # module level (no reference to the forward's cache, so packed data dies with its node)
    value, outer_unpack = packed
    if isinstance(value, _Packed):
        return value.value(outer_unpack)
    return outer_unpack(value) if outer_unpack else value


class Mesa8bit(Method):
    paper = ("Pan, Chen, He, Liu, Cai, Zhuang, Mesa: A Memory-saving Training Framework for "
             "Transformers, arXiv 2111.11124, 2021")
    # group_size: contiguous elements sharing one (min, max); min_numel: smaller saved
    # tensors are kept as they are.
    defaults = dict(group_size=64, min_numel=4096)

    def transform_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Quantize what autograd saves during `model`'s forward: a forward pre-hook enters
        the saved-tensor hooks, a forward hook (also called on an exception) leaves them.
        Hooks, not a wrapper, so the model keeps its class and a deep copy stays correct."""
        if getattr(model, "_mesa8bit", False):
            return model  # transformed before
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._exit, always_call=True)
        model._mesa8bit = True
        self._active = []
        return model

    def _enter(self, model, args):
        quantizer = SavedActivationQuantizer(model, int(self.hp["group_size"]), int(self.hp["min_numel"]))
        hooks = torch.autograd.graph.saved_tensors_hooks(quantizer.pack, _unpack)
        hooks.__enter__()
        self._active.append((quantizer, hooks))

    def _exit(self, model, args, output):
        quantizer, hooks = self._active.pop()
        hooks.__exit__(None, None, None)
        quantizer.cache.clear()
        self.report = quantizer.report


METHOD = Mesa8bit

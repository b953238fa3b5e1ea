"""Block-wise 8-bit tensors: optimizer moments kept as one byte an element plus one float32
scale per block of BLOCK = 256 consecutive elements (AdamA's 8-bit state, methods/adama.py;
8-bit GaLore, methods/galore_8bit.py).

A `Quantized8bit` holds the codes (int8 or uint8) and the scales (float32, one per block).
`decode()` gives the values (float32), `encode(x)` stores new ones; both also work on a
range of whole blocks (`decode(start, stop)`, `encode(x, start)`), so a large tensor can
be updated chunk by chunk with small temporaries. No tensor value is read on the Python
side: it runs on fake tensors.

Mappings, per block of values x with scale s:

- `linear` (signed, for a first moment; int8 codes in [-127, 127]): x ~ c s with
  s = absmax / 127, c = round(x / s); error <= s / 2.
- `log` (non-negative, for sqrt(v); uint8): 0 for c = 0, else s LOG_RANGE ** ((255 - c) / 254)
  with s = the block's max, so the relative error is <= LOG_STEP / 2 (2.8%) for values
  above s LOG_RANGE. A linear code would round small sqrt(v) to 0 and blow the update
  m / sqrt(v) up.
- `dynamic` (signed) and `udynamic` (non-negative): bitsandbytes' 8-bit optimizer state,
  Dettmers et al., "8-bit Optimizers via Block-wise Quantization", ICLR 2022, arXiv
  2110.02861 (its 8-bit Adam keeps m on the signed map and v itself on the unsigned one,
  blocks of 256). uint8 c indexes a table D of 256 float32 values, bitsandbytes'
  `create_dynamic_map(signed)` (`dynamic_map` below): a decimal exponent 10^-k, k = 0..6,
  times a linear fraction in [0.1, 1] that gets more codes the larger the exponent, so
  small values keep a relative precision. Signed: 127 negative values down to -0.99297,
  0, 127 positive values, 1; unsigned: 0, 254 positive values, 1. x ~ D[c] s with
  s = the block's absmax and c the code nearest x / s (a tie goes to the lower code),
  which is how bitsandbytes' CUDA kernel rounds (a binary search, then the nearer of the
  two neighbours; its CPU library looks c up in a 65536-bin table instead, which picks a
  farther code for about one normally distributed value in 600, and maps values below
  about 1.5e-5 of the absmax, zero included, to a code near 1.5e-5). Like the CUDA
  kernel, a negative value whose nearest code is 0 takes the negative code next to 0, so
  the first moment keeps its sign. Error <= s x half the gap between the two codes
  around x / s: at most s x 0.9 / 128 (signed, the same at -1) or s x 0.9 / 256
  (unsigned), and relatively small for small values.

An all-zero block stores scale 1.0 and decodes to exact zeros. `padded` codes fill whole
blocks (blocks x 256 bytes, AdamA's layout); otherwise exactly one byte an element
(bitsandbytes' layout: numel bytes plus 4 bytes a block). The dynamic maps are
`CodeMap`s, one per map and device, shared by every tensor that uses it.
"""
from __future__ import annotations

import math

import torch

BLOCK = 256  # elements per quantisation block (bitsandbytes' 8-bit optimizers: 256 too)
LOG_RANGE = 1e-6  # smallest non-zero code of the log mapping, relative to the block's max
LOG_STEP = LOG_RANGE ** (-1 / 254) - 1  # relative spacing of neighbouring log codes
MAPPINGS = ("linear", "log", "dynamic", "udynamic")


def dynamic_map(signed: bool) -> tuple[float, ...]:
    """bitsandbytes' `create_dynamic_map(signed, max_exponent_bits=7, total_bits=8)`, the
    same operations: for each exponent 10^(i - 6), i = 0..6, the means of neighbouring
    points of linspace(0.1, 1, 2^i + 1) (signed, both signs) or of 2^(i+1) + 1 points
    (unsigned); then 0 and 1; sorted, as float32 values."""
    data = []
    for i in range(7):
        points = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
        boundaries = torch.linspace(0.1, 1, points, dtype=torch.float32, device="cpu")
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0, 1.0]
    return tuple(float(v) for v in torch.tensor(sorted(data), dtype=torch.float32).tolist())


DYNAMIC = {True: dynamic_map(True), False: dynamic_map(False)}  # plain floats: no tensor, no device


class CodeMap:
    """A dynamic map on one device: its 256 values and the 255 midpoints between
    neighbours (the rounding boundaries). Made where it is used (inside a fake mode, on
    fake tensors)."""

    def __init__(self, signed: bool, device):
        self.signed = signed
        self.values = torch.tensor(DYNAMIC[signed], dtype=torch.float32, device=device)
        self.bounds = (self.values[:-1] + self.values[1:]) / 2
        self.zero = DYNAMIC[signed].index(0.0)  # the code of 0

    def tensors(self) -> list[torch.Tensor]:
        return [self.values, self.bounds]


class Quantized8bit:
    """A tensor kept as 8-bit codes and one float32 scale per block of `BLOCK` elements,
    in one of `MAPPINGS` (module docstring); `code` is the `CodeMap` of a dynamic mapping."""

    def __init__(self, shape: torch.Size, device, mapping: str, code: CodeMap | None = None,
                 padded: bool = True):
        self.shape, self.mapping, self.code, self.padded = shape, mapping, code, padded
        self.numel = math.prod(shape)
        blocks = -(-self.numel // BLOCK)
        dtype = torch.int8 if mapping == "linear" else torch.uint8
        self.codes = torch.zeros(blocks * BLOCK if padded else self.numel, dtype=dtype, device=device)
        self.scale = torch.zeros(blocks, 1, dtype=torch.float32, device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scale]

    def decode(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The values, float32: all of them in `shape`, or elements [start, stop) as a
        flat tensor (`start` a multiple of BLOCK)."""
        whole = stop is None
        stop = self.numel if whole else stop
        first, last = start // BLOCK, -(-stop // BLOCK)
        if whole and self.padded:
            codes, scale = self.codes, self.scale
        else:
            codes, scale = self.codes[first * BLOCK:last * BLOCK], self.scale[first:last]
            if codes.numel() < (last - first) * BLOCK:  # the short last block of unpadded codes
                codes = torch.nn.functional.pad(codes, (0, (last - first) * BLOCK - codes.numel()))
        codes = codes.view(last - first, BLOCK)
        # each value computed as `c s`, `s LOG_RANGE ** ((255 - c) / 254)` or `D[c] s`, by
        # operations that write in place where they can (fewer temporaries, on fake tensors
        # fewer tensors made)
        if self.mapping == "linear":
            x = codes.float().mul_(scale)
        elif self.mapping == "log":
            x = torch.pow(LOG_RANGE, codes.float().neg_().add_(255).div_(254)).mul_(scale)
            x.masked_fill_(codes == 0, 0.0)
        else:
            x = self.code.values.index_select(0, codes.flatten().int()).view(-1, BLOCK).mul_(scale)
        x = x.flatten()
        if x.numel() != stop - start:
            x = x[: stop - start]
        return x.view(self.shape) if whole else x

    def encode(self, x: torch.Tensor, start: int = 0) -> None:
        """Store `x`: the whole tensor, or (flat) the elements from `start` on (a multiple
        of BLOCK; `x` ends at a block's end or at the tensor's)."""
        flat = (x.detach() if x.requires_grad else x).float().flatten()
        n = flat.numel()
        first, last = start // BLOCK, -(-(start + n) // BLOCK)
        whole = start == 0 and n == self.numel
        short = (last - first) * BLOCK - n  # the last block's missing elements: padded with zeros
        blocks = (torch.nn.functional.pad(flat, (0, short)) if short else flat).view(-1, BLOCK)
        top = blocks.abs().amax(dim=1, keepdim=True)
        scale = self.scale if whole else self.scale[first:last]
        scale.copy_(torch.where(top > 0, top.div_(127) if self.mapping == "linear" else top, 1.0))
        ratio = blocks / scale
        if self.mapping == "linear":
            codes = ratio.round_().clamp_(-127, 127)
        elif self.mapping == "log":
            zero = ratio < LOG_RANGE / 2
            codes = ratio.clamp_min_(LOG_RANGE).log_().mul_(254).div_(math.log(1 / LOG_RANGE)).add_(255).round_()
            codes = codes.clamp_(1, 255).masked_fill_(zero, 0.0)
        else:
            codes = torch.bucketize(ratio, self.code.bounds, out_int32=True)  # the nearest code
            if self.code.signed:  # keep the sign: a negative value never rounds to 0
                codes.masked_fill_((codes == self.code.zero).logical_and_(ratio < 0), self.code.zero - 1)
        if self.padded:
            out = self.codes if whole else self.codes[start:last * BLOCK]
            out.copy_(codes.flatten())
        else:
            out = self.codes if whole else self.codes[start:start + n]
            out.copy_(codes.flatten() if short == 0 else codes.flatten()[:n])

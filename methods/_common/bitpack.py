"""b-bit codes packed densely into bytes (b = 1..8), with pure torch ops of static shapes,
so the same code runs on CPU, CUDA and fake tensors.

Layout: one little-endian bit stream. Code i occupies stream bits [i*b, (i+1)*b), its
least significant bit first; stream bit k is bit (k mod 8) of byte k // 8; the last
byte is zero padded. n codes take exactly ceil(n*b/8) bytes (3 bits: 3/8 byte a code).
For b = 1 this is the layout of `methods.tempo.pack_bits`.

The work runs in chunks of `CHUNK` codes, or of 1/`PIECES` of a tensor larger than
PIECES chunks (a multiple of 8, so every chunk starts on a byte boundary): the
temporaries (int64 words, 8 bytes a group of eight codes) stay those of one chunk, never
of the whole tensor, and a paper-sized tensor takes a bounded number of operations (on
fake tensors each costs the same whatever its size). 8-bit codes are their own packing
(a copy).
"""
from __future__ import annotations

import math

import torch

from methods._common.chunks import chunk_size

CHUNK = 1 << 20  # codes per chunk, at least; a multiple of 8
PIECES = 16  # chunks of a larger tensor, at most


def _chunk(n: int) -> int:
    """Codes per chunk for `n` codes (a multiple of 8; `pack` and `unpack` agree on it)."""
    return chunk_size(n, CHUNK, PIECES, multiple=8)


def packed_size(numel: int, bits: int) -> int:
    """Bytes that `pack` returns for `numel` codes of `bits` bits."""
    return -(-numel * bits // 8)


def _check(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be 1..8, got {bits}")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (any shape, values < 2**bits; higher bits are ignored) -> a 1-D uint8
    tensor of ceil(numel * bits / 8) bytes.

    Eight codes make `bits` whole bytes: code j of each group of eight is shifted by
    j * bits into one int64 word per group, whose `bits` low bytes are the group's bytes.
    One position (or byte) of all groups at a time: the temporaries are a few bytes per
    group, not 8 bytes per code."""
    _check(bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    flat = codes.reshape(-1)
    n = flat.numel()
    if bits == 8:
        return flat.clone()
    out = torch.empty(packed_size(n, bits), dtype=torch.uint8, device=codes.device)
    mask = (1 << bits) - 1
    step = _chunk(n)
    for start in range(0, n, step):
        piece = flat[start:start + step]
        m = piece.numel()
        if m % 8:
            piece = torch.cat([piece, piece.new_zeros(8 - m % 8)])
        groups = piece.view(-1, 8)
        # code j of every group in place in one int64 word per group (the views of the eight
        # positions made at once; each widened, masked and shifted in place)
        positions = groups.unbind(1)
        words = positions[0].to(torch.int64).bitwise_and_(mask)
        for j in range(1, 8):
            words.bitwise_or_(positions[j].to(torch.int64).bitwise_and_(mask).bitwise_left_shift_(j * bits))
        first, size = start * bits // 8, packed_size(m, bits)
        whole = size == groups.shape[0] * bits  # every chunk but a last one of m % 8 != 0
        data = out[first:first + size] if whole else \
            torch.empty(groups.shape[0] * bits, dtype=torch.uint8, device=codes.device)
        for k, byte in enumerate(data.view(-1, bits).unbind(1)):
            byte.copy_(torch.bitwise_right_shift(words, 8 * k).bitwise_and_(255))
        if not whole:
            out[first:first + size] = data[:size]
    return out


def unpack(packed: torch.Tensor, bits: int, shape) -> torch.Tensor:
    """Inverse of `pack`: the uint8 codes, of `shape`."""
    _check(bits)
    shape = torch.Size(shape)
    n = math.prod(shape)
    if packed.numel() != packed_size(n, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {n} codes of {bits} bits "
                         f"(expected {packed_size(n, bits)})")
    if bits == 8:
        return packed.view(shape)
    out = torch.empty(-(-n // 8) * 8, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    step = _chunk(n)
    for start in range(0, n, step):
        m = min(step, n - start)
        first, size = start * bits // 8, packed_size(m, bits)
        chunk = packed[first:first + size]
        groups = -(-m // 8)
        if size < groups * bits:
            chunk = torch.cat([chunk, chunk.new_zeros(groups * bits - size)])
        data = chunk.view(groups, bits).unbind(1)
        words = data[0].to(torch.int64)
        for k in range(1, bits):
            words.bitwise_or_(data[k].to(torch.int64).bitwise_left_shift_(8 * k))
        for j, code in enumerate(out[start:start + groups * 8].view(groups, 8).unbind(1)):
            code.copy_(torch.bitwise_right_shift(words, j * bits).bitwise_and_(mask))
    return out[:n].view(shape)

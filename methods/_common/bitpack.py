"""b-bit codes packed densely into bytes (b = 1..8), with pure torch ops of static shapes,
so the same code runs on CPU, CUDA and fake tensors.

Layout: one little-endian bit stream. Code i occupies stream bits [i*b, (i+1)*b), its
least significant bit first; stream bit k is bit (k mod 8) of byte k // 8; the last
byte is zero padded. n codes take exactly ceil(n*b/8) bytes (3 bits: 3/8 byte a code).
For b = 1 this is the layout of `methods.tempo.pack_bits`.

The work runs in chunks of `CHUNK` codes (a multiple of 8, so every chunk starts on a
byte boundary): the temporaries stay a few bytes per code of one chunk, never of the
whole tensor.
"""
from __future__ import annotations

import math

import torch

CHUNK = 1 << 20  # codes per chunk; a multiple of 8


def packed_size(numel: int, bits: int) -> int:
    """Bytes that `pack` returns for `numel` codes of `bits` bits."""
    return -(-numel * bits // 8)


def _check(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be 1..8, got {bits}")


def _powers(n: int, device) -> torch.Tensor:
    return torch.bitwise_left_shift(torch.ones(n, dtype=torch.uint8, device=device),
                                    torch.arange(n, dtype=torch.uint8, device=device))


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes (any shape, values < 2**bits; higher bits are ignored) -> a 1-D uint8
    tensor of ceil(numel * bits / 8) bytes."""
    _check(bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    flat = codes.reshape(-1)
    n = flat.numel()
    out = torch.empty(packed_size(n, bits), dtype=torch.uint8, device=codes.device)
    code_bits = torch.arange(bits, dtype=torch.uint8, device=codes.device)
    byte_weights = _powers(8, codes.device)
    step = CHUNK - CHUNK % 8
    for start in range(0, n, step):
        piece = flat[start:start + step]
        m = piece.numel()
        stream = torch.bitwise_right_shift(piece.unsqueeze(-1), code_bits).bitwise_and_(1).reshape(-1)
        pad = (-m * bits) % 8
        if pad:
            stream = torch.cat([stream, stream.new_zeros(pad)])
        first = start * bits // 8
        out[first:first + packed_size(m, bits)] = (stream.view(-1, 8) * byte_weights).sum(-1, dtype=torch.uint8)
    return out


def unpack(packed: torch.Tensor, bits: int, shape) -> torch.Tensor:
    """Inverse of `pack`: the uint8 codes, of `shape`."""
    _check(bits)
    shape = torch.Size(shape)
    n = math.prod(shape)
    if packed.numel() != packed_size(n, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {n} codes of {bits} bits "
                         f"(expected {packed_size(n, bits)})")
    out = torch.empty(n, dtype=torch.uint8, device=packed.device)
    byte_bits = torch.arange(8, dtype=torch.uint8, device=packed.device)
    code_weights = _powers(bits, packed.device)
    step = CHUNK - CHUNK % 8
    for start in range(0, n, step):
        m = min(step, n - start)
        first = start * bits // 8
        chunk = packed[first:first + packed_size(m, bits)]
        stream = torch.bitwise_right_shift(chunk.unsqueeze(-1), byte_bits).bitwise_and_(1).reshape(-1)
        out[start:start + m] = (stream[: m * bits].view(m, bits) * code_weights).sum(-1, dtype=torch.uint8)
    return out.view(shape)

"""How a large tensor is cut into chunks: each chunk's temporaries stay small, and the
number of chunks (operations, each of a fixed cost on fake tensors) stays bounded."""
from __future__ import annotations


def chunk_size(n: int, least: int, pieces: int, multiple: int = 1) -> int:
    """Elements per chunk of `n`: at least `least`, and so many that there are at most
    `pieces` chunks; rounded up to a multiple of `multiple`."""
    size = max(least, -(-n // pieces))
    return -(-size // multiple) * multiple

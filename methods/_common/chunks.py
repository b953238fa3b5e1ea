"""How a large tensor is cut into chunks: each chunk's temporaries stay small, and the
number of chunks (operations, each of a fixed cost on fake tensors) stays bounded.

Where a tensor grows with the batch (activations), a `least` below its size at batch 1 over
`pieces` puts a paper-sized tensor in `pieces` chunks at every batch size: the step's
operations do not change with the batch, and `membench fit` reads batches from shallow
copies and from the line through three steps instead of learning anew (docs/fit.md; Mesa
8-bit). A larger `least` costs fewer operations on small tensors (a warm-up at batch 1)."""
from __future__ import annotations


def chunk_size(n: int, least: int, pieces: int, multiple: int = 1) -> int:
    """Elements per chunk of `n`: at least `least`, and so many that there are at most
    `pieces` chunks; rounded up to a multiple of `multiple`."""
    size = max(least, -(-n // pieces))
    return -(-size // multiple) * multiple

"""A simulated step's allocation trace as a line in the batch size, so that a search asks
the allocator model about batches it does not run.

A trace (`MemoryTracker` events: ("alloc", key, nbytes), ("free", key)) has a *shape*:
the order of its allocations and frees, each free naming the allocation it ends (keys are
storage addresses, so only the order says which), and a *size* per allocation. For most
methods two steps at different batch sizes have the same shape, and each allocation's size
is a + c x batch (parameters, gradients and optimizer state: c = 0; activations and
their temporaries: c > 0). Then the trace at any batch follows from two of them: `Line`.

A line is used only once a third step's trace lies on it byte for byte (`Line.holds`): the
same shape and every size the line's; and only between the smallest and the largest batch
run on it (`within`), never beyond: a number of chunks that grows with the tensor changes
the shape somewhere beyond, and a shape that is the same at both ends of a span is the same
inside it (such counts only grow with the batch), while a micro-batch of one sequence often
has a shape of its own. A method whose steps change shape with the batch (ROAM's plan per
shape) or whose sizes are not affine in it (a chunk of ceil(n / pieces) elements) never
gets one, and its search runs every batch it asks about. At a batch where the line's sizes
are not whole bytes the line gives nothing (`at` returns None) and that batch is run.
"""
from __future__ import annotations

_UNKNOWN = -1  # a free of a storage the trace never allocated (the allocator model ignores it)
_ALLOC = -2


def shape_and_sizes(trace: list) -> tuple[tuple, list[int]]:
    """The trace's shape (per event: _ALLOC, or the number of the allocation it frees) and
    its allocation sizes, in order. A labelled trace's events (`MemoryTracker(labelled=True)`
    and ZeRO's `TimelineTracker`) keep what they say beside the size in its shape: an
    allocation's category, a mark, and a label's or a timeline event's allocation number."""
    shape, sizes, number = [], [], {}
    for event in trace:
        kind = event[0]
        if kind == "alloc":
            number[event[1]] = len(sizes)
            shape.append(_ALLOC if len(event) == 3 else ("alloc", *event[3:]))
            sizes.append(event[2])
        elif kind == "free":
            shape.append(number.pop(event[1], _UNKNOWN))
        elif kind == "mark":
            shape.append(event)
        else:  # a label, or a timeline's event: of an allocation, by its number
            shape.append((kind, number.get(event[1], _UNKNOWN), *event[2:]))
    return tuple(shape), sizes


def rebuilt(shape: tuple, sizes: list[int]) -> list:
    """The trace of a shape and sizes, its keys allocation numbers (an event of a storage the
    trace never allocated is left out: the allocator model ignores it; `numbered` too)."""
    trace, n = [], 0
    for op in shape:
        if isinstance(op, int):  # an unlabelled allocation, or a free
            if op == _ALLOC:
                trace.append(("alloc", n, sizes[n]))
                n += 1
            elif op != _UNKNOWN:
                trace.append(("free", op))
        elif op[0] == "alloc":  # a labelled allocation: its category after the size
            trace.append(("alloc", n, sizes[n], *op[1:]))
            n += 1
        elif op[0] == "mark" or op[1] != _UNKNOWN:
            trace.append(op)
    return trace


class Line:
    """The traces of two batches (`a`, `b`: (batch, trace)) when they have one shape: the
    trace at another batch, each allocation's size on the line through the two."""

    def __init__(self, a: tuple[int, list], b: tuple[int, list]):
        (self.b0, t0), (b1, t1) = sorted((a, b), key=lambda p: p[0])
        self.shape, self.s0 = shape_and_sizes(t0)
        shape1, s1 = shape_and_sizes(t1)
        self.same_shape = self.b0 != b1 and shape1 == self.shape
        self.span = b1 - self.b0
        self.rise = [y - x for x, y in zip(self.s0, s1)] if self.same_shape else []
        self.batches = [self.b0, b1]  # the steps run that lie on it (`holds` adds the others)

    @property
    def confirmed(self) -> bool:
        """A third step lies on it."""
        return len(self.batches) >= 3

    def within(self, batch: int) -> bool:
        """Between the smallest and the largest batch run on it."""
        return min(self.batches) <= batch <= max(self.batches)

    def sizes(self, batch: int) -> list[int] | None:
        """Each allocation's bytes at `batch`, or None where one is not a whole, non-negative
        number of bytes."""
        if not self.same_shape:
            return None
        d = batch - self.b0
        out = []
        for s, r in zip(self.s0, self.rise):
            q, rem = divmod(s * self.span + r * d, self.span)
            if rem or q < 0:
                return None
            out.append(q)
        return out

    def at(self, batch: int) -> list | None:
        """The trace at `batch` (keys: allocation numbers), or None (see `sizes`)."""
        sizes = self.sizes(batch)
        return None if sizes is None else rebuilt(self.shape, sizes)

    def holds(self, batch: int, trace: list) -> bool:
        """Whether the trace run at `batch` lies on the line byte for byte (then it counts
        among the line's batches)."""
        shape, sizes = shape_and_sizes(trace)
        ok = self.same_shape and shape == self.shape and self.sizes(batch) == sizes
        if ok:
            self.batches.append(batch)
        return ok


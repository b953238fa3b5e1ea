"""A model of PyTorch's CUDA caching allocator, replayed over a step's allocations.

The simulated tier counts live tensor bytes exactly, but a GPU needs more than that: the
caching allocator rounds every request, carves requests out of larger segments it
reserves from the driver, and keeps freed blocks cached, so its *reserved* memory (what
the GPU really gives away) is above the live bytes. This module replays the sequence of
allocations and frees that `MemoryTracker` records (`events=`) through a model of that
allocator, default settings, one stream (c10/cuda/CUDACachingAllocator.cpp, torch 2.x):

- a request is rounded up to 512 bytes;
- requests up to 1 MiB come from the small pool, whose segments are 2 MiB; larger ones
  from the large pool, whose segments are 20 MiB for requests under 10 MiB, else the
  request rounded up to 2 MiB;
- the best-fitting cached free block (smallest that fits, lowest address on ties) is
  used and split when the rest is worth keeping (small pool: >= 512 bytes; large pool:
  > 1 MiB); a freed block merges with free neighbours of its segment;
- when no cached block fits, a new segment is reserved; if that would exceed the limit,
  every wholly free segment is released and the reservation retried once (an "alloc
  retry"); if it still does not fit, the allocation fails: out of memory.

What it does not model: the CUDA context (`context_bytes`, added by the caller), library
workspaces (cuBLAS, cuDNN) that do not show up as tensors, several streams, and
non-default allocator settings (expandable segments, max_split_size). Those are what a
calibration on a real GPU measures.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize: largest request served by the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: small-pool segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: segment for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge
# Device memory the CUDA context takes before PyTorch allocates anything. An assumption
# (typical of recent drivers with lazy module loading), not yet calibrated on a GPU.
CUDA_CONTEXT_BYTES = 512 << 20


def round_size(nbytes: int) -> int:
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("segment", "addr", "size", "free", "prev", "next", "small")

    def __init__(self, segment, addr, size, small):
        self.segment, self.addr, self.size, self.small = segment, addr, size, small
        self.free, self.prev, self.next = True, None, None


@dataclass
class Replay:
    """What the allocator did over a trace."""

    fits: bool  # no allocation failed under the limit
    allocated_peak_bytes: int  # peak of rounded live blocks
    reserved_peak_bytes: int  # peak of reserved segments: what the GPU gives away
    alloc_retries: int  # times cached segments were released to make room
    failed_request_bytes: int | None = None  # the request that failed, if one did


class CachingAllocator:
    """Replay allocations (`malloc`/`free` by key) under an optional byte limit."""

    def __init__(self, limit_bytes: int | None = None):
        self.limit = limit_bytes
        self.pools = {True: [], False: []}  # small? -> sorted [(size, addr, block)]
        self.live: dict = {}  # key -> block
        self.segments: dict[int, int] = {}  # base address -> size
        self.next_addr = 0
        self.allocated = self.reserved = 0
        self.allocated_peak = self.reserved_peak = 0
        self.retries = 0
        # `Rising`: at the first reservation the limit refuses, a copy of the state then
        # (what the unlimited replay has at that point)
        self.keep_refused = False
        self.refused: CachingAllocator | None = None

    def snapshot(self) -> CachingAllocator:
        """A copy of this allocator's state (its blocks copied, linked as these are), with no
        limit."""
        new = CachingAllocator()
        for name in ("next_addr", "allocated", "reserved", "allocated_peak", "reserved_peak",
                     "retries"):
            setattr(new, name, getattr(self, name))
        new.segments = dict(self.segments)
        blocks = [b for pool in self.pools.values() for _, _, b in pool] + list(self.live.values())
        twins = {}  # every block is free (in a pool) or live
        for block in blocks:
            twin = twins[id(block)] = _Block(block.segment, block.addr, block.size, block.small)
            twin.free = block.free
        for block in blocks:
            twin = twins[id(block)]
            twin.prev = None if block.prev is None else twins[id(block.prev)]
            twin.next = None if block.next is None else twins[id(block.next)]
        new.pools = {small: [(size, addr, twins[id(b)]) for size, addr, b in pool]
                     for small, pool in self.pools.items()}
        new.live = {key: twins[id(b)] for key, b in self.live.items()}
        return new

    # -- segments -----------------------------------------------------------------
    def _reserve(self, size: int, small: bool) -> _Block | None:
        seg = segment_size(size)
        if self.limit is not None and self.reserved + seg > self.limit:
            return None
        base = self.next_addr
        self.next_addr += seg
        self.segments[base] = seg
        self.reserved += seg
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        return _Block(base, base, seg, small)

    def _release_cached(self) -> None:
        for small in (True, False):
            keep = []
            for entry in self.pools[small]:
                block = entry[2]
                if block.prev is None and block.next is None:  # the whole segment is free
                    self.reserved -= self.segments.pop(block.segment)
                else:
                    keep.append(entry)
            self.pools[small] = keep

    # -- requests -----------------------------------------------------------------
    def malloc(self, key, nbytes: int) -> bool:
        size = -(-nbytes // MIN_BLOCK) * MIN_BLOCK or MIN_BLOCK  # round_size, inline: the hot path
        small = size <= SMALL_SIZE
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1))  # the best-fitting cached block
        block = pool.pop(i)[2] if i < len(pool) else self._reserve(size, small)
        if block is None:
            if self.keep_refused and self.refused is None:  # nothing has changed yet
                self.refused = self.snapshot()
            self.retries += 1
            self._release_cached()
            block = self._reserve(size, small)
            if block is None:
                return False
        rest = block.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            tail = _Block(block.segment, block.addr + size, rest, small)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            bisect.insort(self.pools[small], (rest, tail.addr, tail))  # (the retry replaces the pool)
        block.free = False
        self.live[key] = block
        self.allocated += block.size
        if self.allocated > self.allocated_peak:
            self.allocated_peak = self.allocated
        return True

    def free(self, key) -> None:
        block = self.live.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        pool = self.pools[block.small]
        before, after = block.prev, block.next
        if before is not None and before.free:  # merge into the free block before
            del pool[bisect.bisect_left(pool, (before.size, before.addr))]
            before.size += block.size
            before.next = after
            if after is not None:
                after.prev = before
            block = before
        if after is not None and after.free:  # take in the free block after
            del pool[bisect.bisect_left(pool, (after.size, after.addr))]
            block.size += after.size
            block.next = after.next
            if after.next is not None:
                after.next.prev = block
        bisect.insort(pool, (block.size, block.addr, block))


class Prefix:
    """The unlimited replay of the events that every trace of a search starts with (its
    warm-up step's: about half of each), kept so that a replay of such a trace starts after
    them. Under a limit at least their reserved peak the allocator does there what it does
    without one (no reservation is refused), so the state it reaches is this one. A trace
    that does not start with them, or a lower limit, is replayed from its first event."""

    def __init__(self, events: list):
        self.events = events
        self.state = CachingAllocator()
        _go_on(self.state, events, 0)

    def start(self, events: list, limit_bytes: int | None) -> tuple[int, CachingAllocator] | None:
        """Where a replay of `events` under `limit_bytes` may start, and a copy of the state
        there (its limit set); None where it must start at the first event."""
        if limit_bytes is not None and self.state.reserved_peak > limit_bytes:
            return None
        n = len(self.events)
        if events[:n] != self.events:
            return None
        alloc = self.state.snapshot()
        alloc.limit = limit_bytes
        return n, alloc


def replay(events, limit_bytes: int | None = None, prefix: Prefix | None = None) -> Replay:
    """Replay `MemoryTracker` events — ("alloc", key, nbytes) and ("free", key) — through
    the allocator model; `limit_bytes` is the memory it may reserve (None: unlimited);
    `prefix`: the events it may start after (`Prefix`)."""
    start, alloc = (prefix and prefix.start(events, limit_bytes)) or (0, CachingAllocator(limit_bytes))
    failed = _go_on(alloc, events, start)
    return Replay(failed is None, alloc.allocated_peak, alloc.reserved_peak, alloc.retries,
                  None if failed is None else round_size(failed[2]))


def _go_on(alloc: CachingAllocator, events, start: int) -> tuple | None:
    """Replay `events` from `events[start]` on `alloc`: None, or the allocation that failed
    (where the replay stops)."""
    malloc, free = alloc.malloc, alloc.free
    for event in itertools.islice(events, start, None):
        if event[0] == "alloc":
            if not malloc(event[1], event[2]):
                return event
        else:
            free(event[1])
    return None


def replay_on_gpu(events, memory_bytes: int, prefix: Prefix | None = None) -> Replay:
    """`replay` on a GPU of `memory_bytes`, of which the CUDA context takes its share."""
    return replay(events, memory_bytes - CUDA_CONTEXT_BYTES, prefix)


class Rising:
    """`replay_on_gpu(events, memory).fits` for GPU sizes each larger than the last that did
    not fit (a bisection's), each replay resumed where they all agree: under a limit the
    allocator does what it does without one up to the first reservation the limit refuses;
    every reservation before it was within that limit, hence within any larger one. So a
    replay that does not fit leaves the state at that point, and a later, larger limit
    replays from there, not from the first event."""

    def __init__(self, events, prefix: Prefix | None = None):
        self.events = events
        self.prefix = prefix  # where no limit has been refused yet: a start after it (`Prefix`)
        self.start, self.state = 0, CachingAllocator()  # the unlimited replay before events[start]
        self.floor = None  # the largest limit that did not fit: later ones must be larger

    def fits_on_gpu(self, memory_bytes: int) -> bool:
        limit = memory_bytes - CUDA_CONTEXT_BYTES
        if self.floor is not None and limit <= self.floor:
            raise ValueError(f"a limit of {limit} bytes is not above {self.floor}, which did not fit")
        resumed = self.prefix.start(self.events, limit) if self.floor is None and self.prefix else None
        start, alloc = resumed or (self.start, self.state.snapshot())
        alloc.limit, alloc.keep_refused = limit, True
        refused_at = None
        for i in range(start, len(self.events)):
            event = self.events[i]
            if event[0] != "alloc":
                alloc.free(event[1])
                continue
            fits = alloc.malloc(event[1], event[2])
            if refused_at is None and alloc.refused is not None:
                refused_at = i
            if not fits:
                self.start, self.state, self.floor = refused_at, alloc.refused, limit
                return False
        return True

"""The model of CUDA's caching allocator: segments, splitting, merging, release and retry;
and a simulated run's prediction of what a GPU needs."""
import random

import pytest

from bench.measure import allocator, runner
from bench.measure.allocator import CachingAllocator, replay

MiB = 2**20


def test_small_requests_share_a_two_mib_segment():
    trace = [("alloc", i, 1000) for i in range(3)]
    r = replay(trace)
    assert r.fits and r.reserved_peak_bytes == 2 * MiB and r.allocated_peak_bytes == 3 * 1024


def test_segment_sizes_follow_the_request_size():
    assert replay([("alloc", 0, 1.5 * MiB)]).reserved_peak_bytes == 20 * MiB
    # the rest of that 20 MiB segment (over 1 MiB) serves the next medium request
    assert replay([("alloc", 0, 1.5 * MiB), ("alloc", 1, 3 * MiB)]).reserved_peak_bytes == 20 * MiB
    assert replay([("alloc", 0, 11 * MiB + 1)]).reserved_peak_bytes == 12 * MiB


def test_freed_blocks_merge_and_are_reused():
    trace = [("alloc", "a", 4 * MiB), ("alloc", "b", 4 * MiB), ("free", "a"), ("free", "b"),
             ("alloc", "c", 15 * MiB)]  # fits the merged 20 MiB block: no new segment
    r = replay(trace)
    assert r.fits and r.reserved_peak_bytes == 20 * MiB


def test_cached_segments_are_released_and_retried_before_out_of_memory():
    trace = [("alloc", "a", 12 * MiB), ("free", "a"), ("alloc", "b", 20 * MiB)]
    r = replay(trace, limit_bytes=30 * MiB)
    assert r.fits and r.alloc_retries == 1 and r.reserved_peak_bytes == 20 * MiB
    assert replay(trace).reserved_peak_bytes == 32 * MiB  # no limit: the cache is kept
    failed = replay([("alloc", "a", 12 * MiB)], limit_bytes=10 * MiB)
    assert not failed.fits and failed.failed_request_bytes == 12 * MiB


def test_fragmentation_can_fail_below_the_limit():
    # two 10 MiB blocks in their own segments; free the first; a 12 MiB request cannot use
    # the cached 10 MiB segment while the other is live, and the limit allows no new one
    trace = [("alloc", "a", 10 * MiB), ("alloc", "b", 10 * MiB), ("free", "a"),
             ("alloc", "c", 12 * MiB)]
    assert not replay(trace, limit_bytes=21 * MiB).fits  # live bytes would be 22 MiB: no
    assert replay(trace, limit_bytes=22 * MiB).fits  # the cached one is released, retried


def test_random_traces_keep_the_allocator_consistent():
    rng = random.Random(0)
    alloc, live = CachingAllocator(), {}
    for step in range(3000):
        if live and rng.random() < 0.45:
            key = rng.choice(list(live))
            alloc.free(key)
            del live[key]
        else:
            size = rng.choice([rng.randint(1, 4096), rng.randint(1, 3 * MiB), rng.randint(1, 30 * MiB)])
            assert alloc.malloc(step, size)
            live[step] = allocator.round_size(size)
        # a block not worth splitting is handed out whole, and counted whole (as PyTorch does)
        assert all(alloc.live[k].size >= size for k, size in live.items())
        assert alloc.allocated == sum(b.size for b in alloc.live.values()) <= alloc.reserved
        blocks = sorted((b.addr, b.addr + b.size) for b in alloc.live.values())
        assert all(e0 <= s1 for (_, e0), (s1, _) in zip(blocks, blocks[1:]))  # no overlap
    for key in list(live):
        alloc.free(key)
    assert alloc.allocated == 0
    alloc._release_cached()
    assert alloc.reserved == 0  # every segment merged back into one free block


def test_a_simulated_run_predicts_what_a_gpu_needs(tiny_job):
    record = runner.run(tiny_job(simulate=True, batch_size=8, seq_len=64))
    mem = record["memory"]
    assert record["status"] == "ok"
    assert mem["peak_bytes"] <= mem["predicted_allocated_peak_bytes"] <= mem["reserved_peak_bytes"]
    assert mem["predicted_gpu_bytes"] == mem["reserved_peak_bytes"] + allocator.CUDA_CONTEXT_BYTES
    over = runner.run(tiny_job(simulate=True, batch_size=8, seq_len=64,
                               capacity_gb=(mem["predicted_gpu_bytes"] - MiB) / 2**30))
    assert over["status"] == "oom" and "predicted out of memory" in over["message"]


def _random_trace(seed: int, events: int = 3000) -> list:
    """Allocations of all three kinds of size, about 45% of the events frees."""
    rng, live, trace = random.Random(seed), [], []
    for step in range(events):
        if live and rng.random() < 0.45:
            trace.append(("free", live.pop(rng.randrange(len(live)))))
        else:
            trace.append(("alloc", step, rng.choice([rng.randint(1, 4096), rng.randint(1, 3 * MiB),
                                                     rng.randint(1, 30 * MiB)])))
            live.append(step)
    return trace


def _traces():
    """Random traces, and steps of three methods on fake tensors (as `membench fit` replays them)."""
    from bench.job import Job
    from bench.measure import capacity

    out = [_random_trace(seed) for seed in range(3)]
    for method, unit in (("adamw", 1), ("checkpointing", 1), ("grad_accum", 4)):
        job = Job(kind="capacity", method=method, model="gpt2-tiny", batch_size=16, seq_len=64, simulate=True)
        out.append(capacity._Simulation(job, cost=False).measure()[1])
    return out


def _bisected(trace: list, memory: dict, resolution: int = 2**26) -> int:
    """`fit.smallest_gpu` as it was: the same bisection, each step a replay from the first event."""
    lo = memory["predicted_allocated_peak_bytes"] + allocator.CUDA_CONTEXT_BYTES
    hi = memory["predicted_gpu_bytes"]
    if lo >= hi or allocator.replay_on_gpu(trace, lo).fits:
        return lo
    while hi - lo > resolution:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if allocator.replay_on_gpu(trace, mid).fits else (mid, hi)
    return hi


def test_rising_limits_resume_where_the_replays_agree_and_answer_as_replays_from_the_start():
    """`Rising` (each replay resumed from the state where a smaller limit was first refused)
    against a replay from the first event, at every step of bisections from the allocated
    peak to the unlimited reserve, fine and coarse; and `fit.smallest_gpu`, which bisects
    with it, against the same bisection on whole replays."""
    from bench import fit

    ctx = allocator.CUDA_CONTEXT_BYTES
    resumed = 0
    for trace in _traces():
        whole = replay(trace)
        memory = {"predicted_allocated_peak_bytes": whole.allocated_peak_bytes,
                  "predicted_gpu_bytes": whole.reserved_peak_bytes + ctx}
        assert fit.smallest_gpu(trace, memory) == _bisected(trace, memory)
        for resolution in (64 * 1024, MiB):
            rising = allocator.Rising(trace)
            lo, hi = whole.allocated_peak_bytes + ctx, whole.reserved_peak_bytes + ctx
            fits = rising.fits_on_gpu(lo)
            assert fits == allocator.replay_on_gpu(trace, lo).fits
            while not fits and hi - lo > resolution:
                mid = (lo + hi) // 2
                at_mid = rising.fits_on_gpu(mid)
                assert at_mid == allocator.replay_on_gpu(trace, mid).fits, mid
                lo, hi = (lo, mid) if at_mid else (mid, hi)
            resumed += rising.start > 0
    assert resumed  # bisections that did resume past the first event
    rising = allocator.Rising(_random_trace(0))
    assert not rising.fits_on_gpu(ctx + MiB)
    with pytest.raises(ValueError, match="not above"):
        rising.fits_on_gpu(ctx + MiB)


def test_a_replay_after_a_kept_prefix_is_the_replay_from_the_first_event():
    """`Prefix` (the unlimited replay of the events a search's traces start with, kept): a
    replay started after it, unlimited and at limits below, at and above its reserved peak,
    and `fit.smallest_gpu` with it, against replays from the first event; a trace that does
    not start with it, or a limit below its peak, starts at the first event."""
    from bench import fit

    ctx = allocator.CUDA_CONTEXT_BYTES
    started = 0
    for trace in _traces():
        prefix = allocator.Prefix(trace[:len(trace) // 2])
        whole = replay(trace)
        assert replay(trace, None, prefix) == whole
        peak = prefix.state.reserved_peak
        for limit in (peak - MiB, peak, peak + 7 * MiB, whole.allocated_peak_bytes, whole.reserved_peak_bytes):
            assert replay(trace, limit, prefix) == replay(trace, limit), limit
            started += prefix.start(trace, limit) is not None
        assert prefix.start(trace, peak - 1) is None
        memory = {"predicted_allocated_peak_bytes": whole.allocated_peak_bytes,
                  "predicted_gpu_bytes": whole.reserved_peak_bytes + ctx}
        assert fit.smallest_gpu(trace, memory, prefix=prefix) == _bisected(trace, memory)
    assert started
    trace = _random_trace(0)
    assert allocator.Prefix(_random_trace(1)[:100]).start(trace, None) is None


def test_a_snapshot_goes_on_as_the_allocator_it_copies():
    trace = _random_trace(1)
    alloc = CachingAllocator()
    for i, event in enumerate(trace):
        if i == len(trace) // 2:
            twin = alloc.snapshot()
            for later in trace[i:]:
                (twin.malloc(later[1], later[2]) if later[0] == "alloc" else twin.free(later[1]))
        (alloc.malloc(event[1], event[2]) if event[0] == "alloc" else alloc.free(event[1]))
    for name in ("allocated", "reserved", "allocated_peak", "reserved_peak", "retries", "segments"):
        assert getattr(twin, name) == getattr(alloc, name), name
    assert sorted((b.addr, b.size, b.free) for b in twin.live.values()) == \
        sorted((b.addr, b.size, b.free) for b in alloc.live.values())
    for small in (True, False):  # the same free blocks, linked to the same neighbours
        assert [(size, addr, b.prev and b.prev.addr, b.next and b.next.addr) for size, addr, b in twin.pools[small]] \
            == [(size, addr, b.prev and b.prev.addr, b.next and b.next.addr) for size, addr, b in alloc.pools[small]]

"""Per-rank memory under FSDP2 (bench.measure.sharded): the simulated tier (fake tensors,
fake process group) against real gloo runs, rank by rank; the shards' bytes against
FSDP2's sharding rule computed here; world size 1 against the unsharded memory job;
PyTorch's FSDPMemTracker on the same real step as an independent split."""
import math

import pytest
import torch

from bench import models
from bench.job import CATEGORIES, Job
from bench.measure import allocator, runner, sharded

F32 = 4
PARTS = ("unsharded_param", "unsharded_grad", "comm")


def job(model="gpt2-tiny", **kw):
    return Job(**{**dict(kind="memory", method="adamw", model=model, batch_size=4, seq_len=32), **kw})


@pytest.fixture(scope="module")
def real2(sim2):
    """gpt2-tiny on 2 gloo processes, with FSDPMemTracker's third step. About one run in 30
    on busy cores differs in one rank: gloo's own thread, not the main one, drops the last
    reference to the previous block's all-gather buffer, after the next one is allocated,
    so both are alive at the peak (its activations 278,528 bytes more, its peak 22,528
    over; docs/sharding.md). Such a run is made again once, so the simulated tier must still
    equal a real run byte for byte."""
    return real_again_once(sim2, job(), 2, reference=True)


def real_again_once(sim, job, world_size, **kw):
    """Real ranks of `job`, run again once where a rank differs from `sim` (the gloo thread's
    late release of an all-gather buffer, `real2`)."""
    for _ in range(2):
        real = sharded.run_ranks(job, world_size, **kw)
        if all(same(s, r) for s, r in zip(sim, real)):
            break
    return real


@pytest.fixture(scope="module")
def sim2():
    return sharded.simulate_ranks(job(), 2)


def shapes(name):
    """Each parameter's shape (tied weights once), from the unsharded model on meta."""
    with torch.device("meta"):
        return [tuple(p.shape) for p in models.build(name).parameters()]


def fsdp2_bytes(name, world_size, rank):
    """(param, grad, optimizer) bytes of one rank by FSDP2's rule, from the shapes alone:
    dim 0 is cut by torch.chunk into chunks of c = ceil(d0 / world_size) rows; every rank
    keeps a buffer of c rows (its own rows first, zero padding after): the parameter, and
    per group the reduce-scatter output the gradients view, are c rows of every parameter;
    AdamW's two moments are `zeros_like` the rank's own rows, rows [rank * c, (rank + 1) * c)
    clipped to d0, plus one float32 step counter per parameter."""
    param = own = 0
    for shape in shapes(name):
        rest = math.prod(shape[1:])
        c = math.ceil(shape[0] / world_size)
        param += c * rest
        own += max(0, min(c, shape[0] - rank * c)) * rest
    return param * F32, param * F32, (2 * own + len(shapes(name))) * F32


def allocations(events):
    """The sizes allocated (storages made, and grown again by resize_), in size order."""
    return sorted(e[2] for e in events if e[0] == "alloc" and e[2])


def same(sim, real) -> bool:
    try:
        assert_same(sim, real)
    except AssertionError:
        return False
    return True


def assert_same(sim, real):
    for c in CATEGORIES:
        assert sim["memory"][f"{c}_bytes"] == real["memory"][f"{c}_bytes"], c
    assert sim["memory"]["peak_bytes"] == real["memory"]["peak_bytes"]
    assert sim["sharding"] == real["sharding"]
    assert sim["before_update"] == real["before_update"]
    assert sim["after_step"] == real["after_step"]
    # the same allocations; their order differs in places (when a storage is resized), which
    # the allocator model does not see (test_simulated_equals_real_per_rank)
    assert allocations(sim["events"]) == allocations(real["events"])


def test_simulated_equals_real_per_rank(sim2, real2):
    assert [r["rank"] for r in real2] == [0, 1]
    for sim, real in zip(sim2, real2):
        assert sim["memory"]["tier"] == "simulated" and real["memory"]["tier"] == "tracked"
        assert_same(sim, real)
        # the allocator model reads the same trace from both tiers
        predicted = allocator.replay(real["events"])
        assert sim["memory"]["predicted_allocated_peak_bytes"] == predicted.allocated_peak_bytes
        assert sim["memory"]["reserved_peak_bytes"] == predicted.reserved_peak_bytes
    assert all(math.isfinite(r["loss"]) for r in real2)


def test_sharding_is_visible_and_inside_other(sim2):
    for r in sim2:
        m, s = r["memory"], r["sharding"]
        assert s["bytes"] == sum(s[p] for p in PARTS) <= m["other_bytes"]
        # the peak is in forward: the last block's gathered parameters are alive
        assert s["unsharded_param"] > 0 and s["comm"] > 0


# 3: the last rank's chunks are partly padding; 96: the last rank owns every row of some
# parameters (d0 384) and none of the others (d0 128, 256, 512: the max(0, ...) of the rule);
# 1024, the largest world size a suite may ask for, is opt-in (`heavy`: 40 s on 2 cores)
@pytest.mark.parametrize("world_size", [1, 2, 3, 96, pytest.param(1024, marks=[pytest.mark.slow, pytest.mark.heavy])])
def test_shards_follow_fsdp2_rule(sim2, world_size):
    # the first and the last rank (at 1024 the last only: rank 0's rule is that of 2, 3 and 96)
    ranks = [world_size - 1] if world_size > 96 else [0, world_size - 1] if world_size > 1 else [0]
    results = sim2 if world_size == 2 else sharded.simulate_ranks(job(), world_size, ranks)
    for r, rank in zip(results, ranks):
        param, grad, optimizer = fsdp2_bytes("gpt2-tiny", world_size, rank)
        assert r["memory"]["param_bytes"] == param
        assert r["memory"]["optimizer_bytes"] == optimizer  # all state is alive at the peak
        assert r["before_update"] == {"param": param, "grad": grad, "optimizer": optimizer}
        assert r["after_step"] == {"param": param, "grad": 0, "optimizer": optimizer}


def test_real_shards_follow_fsdp2_rule(real2):
    for r in real2:
        param, grad, optimizer = fsdp2_bytes("gpt2-tiny", 2, r["rank"])
        assert r["before_update"] == {"param": param, "grad": grad, "optimizer": optimizer}


def test_world_size_1_is_the_unsharded_job():
    one = sharded.simulate_ranks(job(), 1)[0]
    plain = runner.run(job())
    assert plain["status"] == "ok", plain.get("message")
    assert one["memory"]["param_bytes"] == plain["memory"]["param_bytes"]
    assert one["memory"]["optimizer_bytes"] == plain["memory"]["optimizer_bytes"]
    # every gradient at once, as the unsharded step has them before its update
    assert one["before_update"]["grad"] == plain["memory"]["param_bytes"]
    assert one["sharding"]["comm"] == 0  # no collective at world size 1


def test_fsdp_mem_tracker_agrees_on_the_split(real2):
    """PyTorch's FSDPMemTracker, a third step of the same run: same peak, same shards and
    sharding buffers. By design it names activations otherwise (all of forward's tensors
    are `act`, ours only what autograd saves), so those are compared in sum."""
    for r in real2:
        ref, m, s = r["fsdp_mem_tracker"], r["memory"], r["sharding"]
        # Its peak is ours, but once (a run beside other tests on the 2 cores, not
        # reproduced alone) it counted 22,528 bytes more, in its forward/temporary
        # categories: the shards and sharding buffers below stay exact.
        extra = ref["total"] - m["peak_bytes"]
        assert 0 <= extra <= 0.005 * m["peak_bytes"]
        assert ref["sharded_param"] == m["param_bytes"]
        assert ref["sharded_grad"] == m["grad_bytes"]
        assert ref["opt"] == m["optimizer_bytes"]
        assert ref["unsharded_param"] == s["unsharded_param"]
        assert ref["unsharded_grad"] == s["unsharded_grad"]
        assert ref["all_gather"] + ref["reduce_scatter"] == s["comm"]
        rest = ref["act"] + ref["temp"] + ref["inp"] + ref["buffer"]
        assert rest - extra == m["activation_bytes"] + m["other_bytes"] - s["bytes"]


def test_blocks_are_the_transformer_layers():
    with torch.device("meta"):
        for name, n in (("gpt2-tiny", 2), ("llama-tiny", 2), ("bert-tiny", 2)):
            found = sharded.blocks(models.build(name))
            assert len(found) == n and len({type(b) for b in found}) == 1, name


def test_padding_rule():
    assert sharded.shard_numel((10, 3), 4) == 3 * 3  # chunks of 3 rows: 3, 3, 3, 1
    assert [sharded.local_numel((10, 3), 4, r) for r in range(4)] == [9, 9, 9, 3]
    assert [sharded.local_numel((2,), 4, r) for r in range(4)] == [1, 1, 0, 0]


def test_resize_is_a_free_and_an_allocation():
    events = []
    tracker = sharded.ShardedTracker(events=events)
    with tracker:
        t = torch.empty(1000)
        t.untyped_storage().resize_(0)
        after_free = tracker.current
        t.untyped_storage().resize_(4000)
        after_alloc = tracker.current
    assert (after_free, after_alloc) == (0, 4000)
    assert [e[0] for e in events] == ["alloc", "free", "alloc"]
    assert tracker.peak == 4000


def test_llama_shards_follow_fsdp2_rule_at_four_ranks():
    """The simulated tier on the other causal family (its 344-row MLP weights), the first and
    last of 4 ranks; the real 4-rank run of the same job is opt-in (below)."""
    for r, rank in zip(sharded.simulate_ranks(job("llama-tiny"), 4, [0, 3]), [0, 3]):
        param, grad, optimizer = fsdp2_bytes("llama-tiny", 4, rank)
        assert r["memory"]["param_bytes"] == param
        assert r["before_update"] == {"param": param, "grad": grad, "optimizer": optimizer}


# Opt-in (`heavy`: four spawned gloo processes, about a minute on 2 cores). The default run
# still checks the simulated tier against real gloo ranks (gpt2-tiny, 2 ranks:
# test_simulated_equals_real_per_rank) and llama-tiny's shards in the simulated tier against
# FSDP2's rule (just above); this adds llama-tiny on 4 real ranks.
@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("model", ["llama-tiny"])
def test_simulated_equals_real_at_four_ranks(model):
    sim = sharded.simulate_ranks(job(model), 4)
    real = real_again_once(sim, job(model), 4)
    for s, r in zip(sim, real):
        assert_same(s, r)
        param, grad, optimizer = fsdp2_bytes(model, 4, r["rank"])
        assert r["before_update"] == {"param": param, "grad": grad, "optimizer": optimizer}


@pytest.fixture(scope="module")
def sim2_mixed():
    return sharded.simulate_ranks(job(precision="mixed", dtype="bfloat16"), 2)


def test_mixed_precision_gathers_in_the_compute_dtype(sim2, sim2_mixed):
    """Under mixed precision FSDP2's MixedPrecisionPolicy (`sharded.shard`) gathers the
    float32 shards in bfloat16: the gathered parameters and the all-gather buffers at the
    peak are half float32's, the shards, their gradients and AdamW's state stay float32."""
    for pure, mixed in zip(sim2, sim2_mixed):
        assert mixed["sharding"]["unsharded_param"] * 2 == pure["sharding"]["unsharded_param"] > 0
        assert mixed["sharding"]["comm"] * 2 == pure["sharding"]["comm"] > 0
        assert mixed["before_update"] == pure["before_update"]
        assert {s["dtype"] for s in mixed["shards"]} == {"torch.float32"}


@pytest.mark.slow
@pytest.mark.heavy
def test_mixed_precision_simulated_equals_real(sim2_mixed):
    real = real_again_once(sim2_mixed, job(precision="mixed", dtype="bfloat16"), 2)
    for s, r in zip(sim2_mixed, real):
        assert_same(s, r)

"""ZeRO-1/2/3 per-rank memory, modelled (bench.measure.zero): world size 1 against the
unsharded memory job; the parameter, gradient and optimizer bytes per rank against
DeepSpeed's partitioning arithmetic computed here from the shapes; the transient buffers
within their stated bounds; stage 3 against FSDP2's sharding rule; and the model against
DeepSpeed itself on CPU processes (gloo) where deepspeed is installed."""
import importlib.util
import math
import warnings

import pytest
import torch

from bench import models
from bench.job import Job
from bench.measure import kinds, sharded, zero
from bench.method import available, load

F32 = 4


def job(model="gpt2-tiny"):
    return Job(kind="memory", method="adamw", model=model, batch_size=4, seq_len=32)


@pytest.fixture(scope="module")
def timeline():
    return zero.record_timeline(job(), load("adamw"))


def shapes(name="gpt2-tiny"):
    with torch.device("meta"):
        return [tuple(p.shape) for p in models.build(name).parameters()]


def deepspeed_bytes(stage, world_size, rank, name="gpt2-tiny", threshold=0):
    """(param, grad, optimizer) bytes of one rank as DeepSpeed allocates them for a float32
    model and AdamW, from the shapes alone.
    Stage 1/2: the flat buffer is padded to a multiple of 2 x world_size elements and kept
    whole; each rank owns padded / world_size elements; it keeps the whole gradient of every
    parameter that overlaps its partition. Stage 3: each parameter padded to a multiple of
    world_size, ceil(numel / world_size) per rank (whole if at most `threshold` elements);
    the gradient partition is as large. Optimizer: the float32 master partition, AdamW's two
    moments on it, one step counter."""
    numels = [math.prod(s) for s in shapes(name)]
    if stage in (1, 2):
        padded = math.ceil(sum(numels) / (2 * world_size)) * 2 * world_size
        part = padded // world_size
        lo, hi, offset, kept = part * rank, part * (rank + 1), 0, 0
        for n in numels:
            if offset < hi and offset + n > lo:
                kept += n
            offset += n
        return padded * F32, kept * F32, (3 * part + 1) * F32
    part = sum(-(-n // world_size) for n in numels)
    param = sum(n + -(-n // world_size) if n <= threshold else -(-n // world_size) for n in numels)
    return param * F32, part * F32, (3 * part + 1) * F32


def config(stage, world_size, **kw):
    return zero.ZeroConfig(stage=stage, world_size=world_size, **{"param_persistence_threshold": 0, **kw})


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_world_size_1_is_the_unsharded_job(timeline, stage):
    """At world size 1 the state is the unsharded job's, plus exactly what DeepSpeed adds on
    its own: a float32 master copy of the parameters (4 bytes each) and one step counter for
    the flat parameter instead of one per parameter."""
    plain = timeline.unsharded
    n = plain["n_params"]
    m = zero.model_rank(timeline, config(stage, 1))
    assert m["before_update"]["param"] == plain["param_bytes"]
    assert m["before_update"]["grad"] == plain["param_bytes"]  # every gradient, as unsharded
    steps = F32 * len(shapes())
    assert m["before_update"]["optimizer"] == plain["optimizer_bytes"] - steps + F32 + n * F32
    assert m["sharding"]["gathered_param"] == 0


@pytest.mark.parametrize("world_size", [2, 3, 64])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_follows_deepspeed_arithmetic(timeline, stage, world_size):
    for rank in (0, world_size - 1):
        m = zero.model_rank(timeline, config(stage, world_size), rank)
        param, grad, optimizer = deepspeed_bytes(stage, world_size, rank)
        assert m["before_update"] == {"param": param, "grad": grad, "optimizer": optimizer}, (stage, rank)


def test_persistent_parameters_stay_whole(timeline):
    m = zero.model_rank(timeline, zero.ZeroConfig(stage=3, world_size=2, param_persistence_threshold=40_000))
    assert m["before_update"]["param"] == deepspeed_bytes(3, 2, 0, threshold=40_000)[0]


def test_stage2_keeps_at_most_one_bucket_beyond_its_partition(timeline):
    bucket = 20_000
    m = zero.model_rank(timeline, config(2, 2, reduce_bucket_size=bucket))
    kept = deepspeed_bytes(2, 2, 0)[1]
    largest = max(math.prod(s) for s in shapes()) * F32
    assert m["sharding"]["bucket"] == bucket * F32
    # at the peak: the kept partition, the bucket, and one gradient on its way into it
    assert m["memory"]["grad_bytes"] + m["sharding"]["unsharded_grad"] <= kept + largest
    assert m["memory"]["grad_bytes"] + m["sharding"]["unsharded_grad"] + m["sharding"]["bucket"] \
        <= kept + bucket * F32 + largest
    # without contiguous gradients, the full gradients wait for their bucket: still at most one bucket's worth
    loose = zero.model_rank(timeline, config(2, 2, reduce_bucket_size=bucket, contiguous_gradients=False))
    assert loose["sharding"]["bucket"] == 0
    assert loose["sharding"]["unsharded_grad"] <= bucket * F32 + largest


@pytest.mark.parametrize("max_live", [40_000, 100_000, 10**9])
def test_stage3_gathers_at_most_max_live(timeline, max_live):
    m = zero.model_rank(timeline, config(3, 2, max_live_parameters=max_live))
    largest = max(math.prod(s) for s in shapes())
    assert 0 < m["sharding"]["gathered_param"] <= max(max_live, largest) * F32
    # the default reuse distance keeps a tiny model's parameters gathered; none reuse: fewer
    freed = zero.model_rank(timeline, config(3, 2, max_live_parameters=max_live, max_reuse_distance=0))
    assert freed["sharding"]["gathered_param"] <= m["sharding"]["gathered_param"]


@pytest.mark.parametrize("world_size", [3, 8])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_largest_rank_is_the_largest_of_every_rank_modelled(timeline, stage, world_size):
    """model_ranks models one rank of those whose state has the same sizes: its answer is
    the one of modelling every rank (the lowest of equal peaks)."""
    cfg = config(stage, world_size)
    every = [zero.model_rank(timeline, cfg, r) for r in range(world_size)]
    peaks = [r["memory"]["peak_bytes"] for r in every]
    got = zero.model_ranks(timeline, cfg)
    assert got["rank0"] == every[0]
    assert got["max"] == every[peaks.index(max(peaks))]


def test_reuse_distance_is_the_scan_of_the_uses_after_now(timeline):
    """Stage 3's reuse distance, read from an index, against its definition scanned use by
    use: the elements the modules use after event `at`, up to the first use of `p`."""
    def scanned(p, at):
        distance = 0
        for kind, i, own in timeline.uses:
            if i > at and kind == "use":
                if p in own:
                    return distance
                distance += sum(timeline.params[q][0] for q in own)
        return math.inf

    moments = sorted({i for _, i, _ in timeline.uses} | {-1, len(timeline.events)})
    got = {(p, at): zero._next_use_distance(timeline, p, at) for p in range(len(timeline.params)) for at in moments}
    assert got == {(p, at): scanned(p, at) for p, at in got}
    assert {math.inf, 0} < set(got.values())  # never used again, used next, and between


@pytest.mark.parametrize("world_size", [2, 3, 64])
def test_stage3_against_fsdp2_sharding(timeline, world_size):
    """Stage 3 and FSDP2 shard the same state. FSDP2 pads dim 0 of each parameter to a
    multiple of world_size rows (bench.measure.sharded.shard_numel); DeepSpeed pads its
    elements: ceil(numel / N) <= ceil(d0 / N) x numel / d0, equal when N divides d0."""
    m = zero.model_rank(timeline, config(3, world_size))
    fsdp2 = sum(sharded.shard_numel(s, world_size) for s in shapes()) * F32
    assert m["before_update"]["param"] <= fsdp2
    if all(s[0] % world_size == 0 for s in shapes()):
        assert m["before_update"]["param"] == fsdp2


def test_fsdp2_run_equals_stage3_at_2_ranks(timeline):
    """The simulated FSDP2 run (its measured shards) against the stage-3 model: the same
    parameter and gradient bytes per rank for gpt2-tiny on 2 ranks (every d0 is even)."""
    run = sharded.simulate_ranks(job(), 2)
    for rank, r in enumerate(run):
        m = zero.model_rank(timeline, config(3, 2), rank)
        assert r["before_update"]["param"] == m["before_update"]["param"]
        assert r["before_update"]["grad"] == m["before_update"]["grad"]


# Opt-in (`pytest -m heavy`; skipped anyway where deepspeed is not installed: it is not in
# requirements-test.txt): each stage is two spawned processes that import DeepSpeed, 40 to 115
# CPU-seconds, a tenth of the default run for stage 3 alone. The default run checks every
# stage's per-rank bytes against DeepSpeed's partitioning arithmetic computed from the shapes
# (test_state_follows_deepspeed_arithmetic, test_persistent_parameters_stay_whole), and stage 3
# against FSDP2's measured shards (test_stage3_against_fsdp2_sharding, test_fsdp2_run_equals_stage3_at_2_ranks).
@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_equals_deepspeed_on_cpu(timeline, stage):
    """DeepSpeed itself on 2 CPU processes (gloo): each rank's parameter, gradient and
    optimizer bytes as its optimizer step begins equal the model's."""
    cfg = config(stage, 2, reduce_bucket_size=20_000, max_reuse_distance=0)
    for run in zero.deepspeed_ranks(job(), cfg):
        m = zero.model_rank(timeline, cfg, run["rank"])
        assert run["before_update"] == m["before_update"], (stage, run["rank"])


# Each method the ZeRO model takes (`shards` True or naming the stages), its timeline recorded
# on real tensors (the tracker's module and optimizer hooks are those of a fake-tensor run):
# a method that cannot give one must say so in `shards`, as the planner reads it before any job
ZERO_METHODS = [m for m in available() if kinds.can_shard(load(m), "zero3")]


@pytest.mark.parametrize("method", ZERO_METHODS)
def test_every_method_the_zero_model_takes_gives_a_timeline(method):
    job = Job(kind="memory", method=method, model="gpt2-tiny", batch_size=4, seq_len=32, world_size=2,
              sharding="zero3")
    timeline = zero.record_timeline(job, load(method))
    assert timeline.owner and timeline.uses  # each gradient's parameter, each module's use
    assert timeline.updates or method == "lomo"  # LOMO updates inside backward (AdaLomo does not shard)


def test_the_methods_that_cannot_give_one_are_refused_before_any_job():
    refused = sorted(set(available()) - set(ZERO_METHODS))
    assert {"chunked_ce", "offload_optimizer"} <= set(refused)
    assert all(not kinds.can_shard(load(m), s) for m in refused for s in ("zero1", "zero2", "zero3"))


# ZeRO's tracker keeps the memory job's trace: its marks hang on the graph without moving a free
# (a module's full backward hooks would add nodes that hold gradients longer), so one run of a
# shallow copy serves the one-GPU search and ZeRO's timelines (`capacity._copy_run`)
# (gpt2-tiny's opt-in, `heavy`: 12 s more)
@pytest.mark.parametrize("model", ["llama-d64-l4-v256", pytest.param("gpt2-tiny", marks=pytest.mark.heavy)])
def test_the_timelines_run_is_the_memory_jobs_step(model):
    from bench.measure import capacity
    from bench.measure.trace_depth import numbered

    for method in ZERO_METHODS:
        unit = load(method).hp.get("micro_batches", 1)
        job = Job(kind="memory", method=method, model=model, batch_size=4 * unit, seq_len=32, simulate=True)
        record, trace = capacity._Simulation(job, cost=False, labelled=True).measure()
        timeline, labelled, _ = zero.labelled_run(job, load(method))
        assert numbered(zero.memory_trace(labelled)) == numbered(trace), method
        assert timeline.unsharded == {**{k: v for k, v in record["memory"].items() if k != "tier"},
                                      "n_params": record["n_params"]}, method


@pytest.mark.parametrize("method", ["adamw", "lora", "checkpointing", "dora"])
def test_the_backward_marks_are_where_full_backward_hooks_fire(method):
    """The modules' marks against PyTorch's own full backward hooks, which add nodes to the
    graph (their run's allocations and frees fall elsewhere, so positions are not compared):
    the same modules marked, in the same order, forward and backward."""
    job = Job(kind="memory", method=method, model="llama-d64-l4-v256", batch_size=4, seq_len=32, simulate=True)
    ours = zero.record_timeline(job, load(method))

    def full_hooks(model, tracker, uses):
        index = {id(p): i for i, p in enumerate(model.parameters())}
        handles = []
        for module in model.modules():
            own = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
            if own:
                def mark(kind, own=own):
                    return lambda *_: uses.append((kind, tracker.count, own))
                handles += [module.register_forward_pre_hook(mark("use")), module.register_forward_hook(mark("done")),
                            module.register_full_backward_pre_hook(mark("use")),
                            module.register_full_backward_hook(mark("done"))]
        return handles

    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # full backward hooks on modules whose inputs need no gradient
        patch.setattr(zero, "_watch_modules", full_hooks)
        theirs = zero.record_timeline(job, load(method))
    assert [(k, own) for k, _, own in ours.uses] == [(k, own) for k, _, own in theirs.uses]
    forwards = 2 * len({tuple(own) for _, _, own in ours.uses})  # each module's forward, in both steps
    assert sum(kind == "use" for kind, _, _ in ours.uses) > forwards  # and backward marks beside them

"""The bytes a data-parallel step's collectives move (bench.measure.collectives) and their
estimated time (bench.estimate.collective_seconds): FSDP2's against the shards of a
simulated run and against the collectives FSDP2 itself called in it (counted here); ZeRO's
and DDP's volumes against the arithmetic written out here; world size 1 against nothing;
the time against bytes over bandwidth; and the summary row of sharded memory jobs."""
import math

import pytest
import torch
import torch.distributed as dist

from bench import estimate, models
from bench.job import Job
from bench.measure import collectives, runner, sharded, zero
from bench.report import aggregate

W = 2
F32 = 4


def params(name="gpt2-tiny"):
    """(name, shape, block) per parameter of the unsharded model (tied weights once); block:
    the index of the transformer block (`sharded.blocks`) holding it, None for the root."""
    with torch.device("meta"):
        model = models.build(name)
    owner = {id(p): i for i, block in enumerate(sharded.blocks(model)) for p in block.parameters()}
    return [(n, tuple(p.shape), owner.get(id(p))) for n, p in model.named_parameters()]


def padded(shape, world_size):
    """FSDP2's per-rank buffer of a parameter, elements: ceil(d0 / N) rows of dim 0."""
    return math.ceil(shape[0] / world_size) * math.prod(shape[1:])


@pytest.fixture(scope="module")
def counted():
    """Run simulated FSDP2 memory jobs (2 ranks, gpt2-tiny) through `runner.run`, counting
    the bytes of every all-gather output and reduce-scatter input FSDP2 hands to the process
    group, and keeping rank 0's `sharded.measure_rank` result (its shards)."""
    out = {}

    def run(method, precision="pure", dtype="float32", **hparams):
        calls, ranks = {"all_gather": 0, "reduce_scatter": 0}, []
        gather, scatter, measure = dist.all_gather_single, dist.reduce_scatter_single, sharded.measure_rank

        def all_gather_single(output, input, *args, **kwargs):
            calls["all_gather"] += output.numel() * output.element_size()
            return gather(output, input, *args, **kwargs)

        def reduce_scatter_single(output, input, *args, **kwargs):
            calls["reduce_scatter"] += input.numel() * input.element_size()
            return scatter(output, input, *args, **kwargs)

        def measure_rank(*args, **kwargs):
            ranks.append(measure(*args, **kwargs))
            return ranks[-1]

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dist, "all_gather_single", all_gather_single)
            mp.setattr(dist, "reduce_scatter_single", reduce_scatter_single)
            mp.setattr(sharded, "measure_rank", measure_rank)
            record = runner.run(Job(kind="memory", method=method, model="gpt2-tiny", batch_size=4, seq_len=32,
                                    world_size=W, sharding="fsdp", simulate=True, hparams=hparams,
                                    precision=precision, dtype=dtype))
        assert record["status"] == "ok", record.get("message")
        return {"record": record, "calls": calls, "rank": ranks[0]}

    out["adamw"] = run("adamw")
    out["lora"] = run("lora", micro_batches=2)
    out["mixed"] = run("adamw", precision="mixed", dtype="bfloat16")
    return out


def test_fsdp_bytes_follow_the_shards_and_fsdp2s_own_calls(counted):
    """The forward all-gathers every group's padded shards (W x per rank), the backward
    the blocks' again (the root is not resharded after forward), the reduce-scatter every
    padded gradient; each rank sends (W - 1) / W of each. FSDP2 called exactly these, in
    each of the run's two steps."""
    run = counted["adamw"]
    shards = {s["name"]: s for s in run["rank"]["shards"]}
    blocks = {name for name, _, block in params() if block is not None}
    for name, shape, _ in params():
        assert shards[name]["padded_numel"] == padded(shape, W)  # FSDP2's rule, from the shapes
    every = W * sum(s["padded_numel"] * s["element_size"] for s in shards.values())
    in_blocks = W * sum(s["padded_numel"] * s["element_size"] for n, s in shards.items() if n in blocks)
    assert 0 < in_blocks < every
    got = collectives.fsdp(run["rank"]["shards"], W)
    ops = {(o["op"], o["when"]): o for o in got["ops"]}
    assert ops["all_gather", "forward"]["buffer_bytes"] == every
    assert ops["all_gather", "backward"]["buffer_bytes"] == in_blocks
    assert ops["reduce_scatter", "backward"]["buffer_bytes"] == every
    assert got["buffer_bytes"] == 2 * every + in_blocks
    assert got["wire_bytes"] == (2 * every + in_blocks) // 2  # (W - 1) / W at W = 2
    # what FSDP2 handed the process group: the warm-up and the measured step
    assert run["calls"] == {"all_gather": 2 * (every + in_blocks), "reduce_scatter": 2 * every}
    # the job's result carries the same (kinds._fsdp)
    assert run["record"]["sharding"]["collectives"] == got


def test_mixed_precision_gathers_in_the_compute_dtype_and_reduces_in_float32(counted):
    """Under mixed precision FSDP2 (`MixedPrecisionPolicy`, `sharded.shard`) gathers the
    float32 shards in bfloat16 and reduce-scatters float32 gradients: what it handed the
    process group, and the estimate from the shards."""
    pure, mixed = counted["adamw"]["calls"], counted["mixed"]
    assert mixed["calls"] == {"all_gather": pure["all_gather"] // 2, "reduce_scatter": pure["reduce_scatter"]}
    got = collectives.fsdp(mixed["rank"]["shards"], W, gather_itemsize=2)
    assert mixed["record"]["sharding"]["collectives"] == got
    ops = {(o["op"], o["when"]): o["buffer_bytes"] for o in got["ops"]}
    assert 2 * (ops["all_gather", "forward"] + ops["all_gather", "backward"]) == mixed["calls"]["all_gather"]
    assert 2 * ops["reduce_scatter", "backward"] == mixed["calls"]["reduce_scatter"]


def test_fsdp_reduces_only_trainable_gradients_and_gathers_per_micro_batch(counted):
    """LoRA (frozen base weights) with 2 micro-batches: every pass gathers all the
    parameters, the reduce-scatter carries the adapters' gradients only (W x the rank's
    gradient shards)."""
    run = counted["lora"]
    rank = run["rank"]
    every = W * sum(s["padded_numel"] * s["element_size"] for s in rank["shards"])
    in_blocks = W * sum(s["padded_numel"] * s["element_size"] for s in rank["shards"]
                        if s["name"].startswith("transformer.h."))
    adapters = W * sum(s["padded_numel"] * s["element_size"] for s in rank["shards"] if ".lora_" in s["name"])
    assert adapters == W * rank["before_update"]["grad"] < every
    moved = run["record"]["sharding"]["collectives"]
    ops = {(o["op"], o["when"]): o for o in moved["ops"]}
    assert {k: (o["buffer_bytes"], o["times"]) for k, o in ops.items()} == {
        ("all_gather", "forward"): (every, 2), ("all_gather", "backward"): (in_blocks, 2),
        ("reduce_scatter", "backward"): (adapters, 2)}
    assert moved["wire_bytes"] == 2 * (every + in_blocks + adapters) // 2
    steps = 2  # warm-up and measured, each of 2 micro-batches
    assert run["calls"] == {"all_gather": steps * 2 * (every + in_blocks), "reduce_scatter": steps * 2 * adapters}


@pytest.mark.parametrize("model", ["gpt2-tiny", "bert-tiny", "llama-tiny"])
def test_fsdp_groups_are_the_blocks_and_the_root(model):
    groups = {}
    for name, _, block in params(model):
        groups.setdefault(block, set()).add(collectives.fsdp_group(name))
    assert groups[None] == {""}  # the root's own parameters
    named = [g for block, g in groups.items() if block is not None]
    assert all(len(g) == 1 and "" not in g for g in named) and len(set().union(*named)) == len(named)


def test_world_size_1_moves_nothing(counted):
    numels = [(math.prod(shape), F32, True) for _, shape, _ in params()]
    for moved in (collectives.fsdp(counted["adamw"]["rank"]["shards"], 1),
                  *(collectives.zero_stage(numels, zero.ZeroConfig(stage=s, world_size=1)) for s in (1, 2, 3)),
                  collectives.replicas(numels, 1)):
        assert moved["wire_bytes"] == 0 and all(o["wire_bytes"] == 0 for o in moved["ops"])
    assert collectives.wire_bytes("all_reduce", 10 ** 9, 1) == 0


@pytest.mark.parametrize("world_size", [2, 8, 64])
def test_zero_and_ddp_volumes(world_size):
    """Per rank and step, ring algorithm: DDP all-reduces the gradients, 2 (N-1)/N x P.
    ZeRO-1/2 as the paper counts them (a reduce-scatter, then the all-gather of the updated
    flat partitions): 2 (N-1)/N x P; with DeepSpeed 0.19.8's default all-reduce of the
    gradients, 3 (N-1)/N x P. ZeRO-3: all-gather for forward, again for backward, and a
    reduce-scatter, 3 (N-1)/N x P (each parameter padded to a multiple of N); parameters of
    at most the persistence threshold only reduce-scatter and one all-gather after the step."""
    n = world_size
    shapes = [shape for _, shape, _ in params()]
    numels = [math.prod(s) for s in shapes]
    p = sum(numels) * F32
    flat = math.ceil(sum(numels) / (2 * n)) * 2 * n * F32
    triples = [(k, F32, True) for k in numels]
    assert collectives.replicas(triples, n)["wire_bytes"] == 2 * p * (n - 1) // n
    for stage in (1, 2):
        cfg = zero.ZeroConfig(stage=stage, world_size=n)
        paper = collectives.zero_stage(triples, cfg, multi_rank_allreduce=False)["wire_bytes"]
        assert paper == p * (n - 1) // n + flat * (n - 1) // n
        assert paper == pytest.approx(2 * p * (n - 1) / n, abs=2 * n * F32)
        default = collectives.zero_stage(triples, cfg)["wire_bytes"]
        assert default == 2 * p * (n - 1) // n + flat * (n - 1) // n
    per_param = [math.ceil(k / n) * n * F32 for k in numels]
    whole = collectives.zero_stage(triples, zero.ZeroConfig(stage=3, world_size=n, param_persistence_threshold=0))
    assert whole["wire_bytes"] == 3 * (sum(per_param) * (n - 1) // n)
    assert whole["wire_bytes"] == pytest.approx(3 * p * (n - 1) / n, rel=0.01)
    threshold = 20_000  # (DeepSpeed's default, 1e5, keeps every gpt2-tiny parameter whole)
    used = sum(b for k, b in zip(numels, per_param) if k > threshold)
    kept = sum(b for k, b in zip(numels, per_param) if k <= threshold)
    cfg = zero.ZeroConfig(stage=3, world_size=n, param_persistence_threshold=threshold)
    some = collectives.zero_stage(triples, cfg)
    assert 0 < used and 0 < kept
    assert some["wire_bytes"] == (2 * (used * (n - 1) // n) + (used + kept) * (n - 1) // n
                                  + kept * (n - 1) // n)


def test_micro_batches_frozen_parameters_and_the_stage_1_boundary():
    """Per pass (micro-batch) every scheme gathers and reduces again, except ZeRO-1, which
    reduces once at the accumulation boundary; frozen parameters (whole on every rank in the
    ZeRO model, no gradient in DDP) move nothing."""
    triples = [(1000, F32, True), (3000, F32, False)]
    g = 1000 * F32
    assert collectives.replicas(triples, 4, passes=3)["wire_bytes"] == 3 * (2 * g * 3 // 4)
    one = collectives.zero_stage(triples, zero.ZeroConfig(stage=1, world_size=4), passes=3)
    two = collectives.zero_stage(triples, zero.ZeroConfig(stage=2, world_size=4), passes=3)
    assert one["wire_bytes"] == 2 * g * 3 // 4 + g * 3 // 4
    assert two["wire_bytes"] == 3 * (2 * g * 3 // 4) + g * 3 // 4
    three = collectives.zero_stage(triples, zero.ZeroConfig(stage=3, world_size=4, param_persistence_threshold=0),
                                   passes=3)
    assert three["wire_bytes"] == 3 * 3 * (g * 3 // 4)


def test_time_is_bytes_over_the_link():
    """NVLink per direction inside a node (H100 SXM 450 GB/s, A100 SXM 300 GB/s, V100 SXM2
    150 GB/s; the RTX 4090's PCIe Gen4 x16, 32 GB/s); beyond 8 ranks the assumed inter-node
    link (400 Gb/s NDR per GPU, 50 GB/s) bounds the ring."""
    sent = 9 * 10 ** 9
    for gpu, gbs in (("h100-sxm-80gb", 450), ("a100-sxm-80gb", 300), ("v100-sxm2-16gb", 150),
                     ("rtx4090-24gb", 32)):
        assert estimate.collective_seconds(sent, 8, gpu) == pytest.approx(sent / (gbs * 1e9))
        assert estimate.collective_seconds(sent, 2, gpu) == pytest.approx(sent / (gbs * 1e9))
        assert estimate.collective_seconds(sent, 16, gpu) == pytest.approx(sent / (min(gbs, 50) * 1e9))
    assert estimate.collective_seconds(0, 1024, "h100-sxm-80gb") == 0
    assert all(g.peer_link_gbs > 0 and "NVLink" in g.source for g in estimate.GPUS.values())


def test_sharded_memory_rows_carry_the_collectives(counted):
    """The summary row of a simulated FSDP2, ZeRO-3 and DDP-replica memory job (gpt2-tiny,
    2 ranks): `collective_bytes` (sent per rank and step) and `est_h100_collective_s` (over
    the H100's NVLink, 450 GB/s a direction); a single-rank row has neither."""
    numels = [math.prod(shape) for _, shape, _ in params()]
    p = sum(numels) * F32
    record = counted["adamw"]["record"]
    row = aggregate.summary_rows(record, "r.json")[0]
    every = W * sum(padded(shape, W) for _, shape, _ in params()) * F32
    in_blocks = W * sum(padded(shape, W) for _, shape, block in params() if block is not None) * F32
    assert row["collective_bytes"] == (2 * every + in_blocks) // 2
    assert row["est_h100_collective_s"] == pytest.approx(row["collective_bytes"] / 450e9)
    assert {"collective_bytes", "est_h100_collective_s"} <= set(aggregate.SUMMARY_COLUMNS)

    base = dict(kind="memory", method="adamw", model="gpt2-tiny", batch_size=2, seq_len=16, simulate=True)
    replicas = runner.run(Job(**base, world_size=W))
    assert replicas["status"] == "ok", replicas.get("message")
    assert aggregate.summary_rows(replicas, "d.json")[0]["collective_bytes"] == 2 * p // 2  # all-reduce
    stage3 = runner.run(Job(**base, world_size=W, sharding="zero3"))
    assert stage3["status"] == "ok", stage3.get("message")
    # DeepSpeed's persistence threshold (1e5 elements) keeps every gpt2-tiny parameter whole: the
    # gradients' reduce-scatter, and the all-gather of the updated parameters after the step
    per_param = [math.ceil(k / W) * W * F32 for k in numels]
    assert max(numels) <= 100_000
    row3 = aggregate.summary_rows(stage3, "z.json")[0]
    assert row3["collective_bytes"] == 2 * (sum(per_param) // 2)
    assert row3["est_h100_collective_s"] == pytest.approx(row3["collective_bytes"] / 450e9)

    single = aggregate.summary_rows({**record, "sharding": None, "job": {**record["job"], "world_size": 1}}, "s")[0]
    assert single["collective_bytes"] is None and single["est_h100_collective_s"] is None

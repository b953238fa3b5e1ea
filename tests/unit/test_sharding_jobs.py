"""The data-parallel axis of a job (`world_size`, `sharding`): planned with its own result
file names, checked before any job (kind, scheme, method, ranks), measured as one rank's
memory (FSDP2 through bench.measure.sharded), and carried into the summary row, the
tables and the figures (docs/sharding.md)."""
import copy
import json
import math

import pandas as pd
import pytest
import yaml

from bench import suite as plan
from bench.job import Job
from bench.measure import kinds, runner, sharded
from bench.models import build
from bench.report import aggregate, compare, figures, tables
from bench.suite import ConfigError
from conftest import REPO

CONFIG = yaml.safe_load((REPO / "config" / "config.yaml").read_text())


def checked(config):
    plan.validate_schema(config)
    return plan.plan(config)


def mutate(fn):
    config = copy.deepcopy(CONFIG)
    fn(config)
    return config


def test_the_quick_suite_plans_its_sharded_section_in_a_group_of_its_own():
    jobs = checked(copy.deepcopy(CONFIG))
    sharded_jobs = {p: j for p, j in jobs.items() if j.world_size > 1 or j.sharding != "none"}
    names = {p.split("/", 5)[5] for p in sharded_jobs}
    expected = {f"{m}/markov-bs8-seq64-seed0-ws2{s}{t}.json" for m in ("adamw", "checkpointing", "grad_accum")
                for s in ("", "-fsdp") for t in ("", "-sim")}
    assert names == expected
    # at most 3 real 2-rank runs (each about 30 s on 2 cores)
    assert sum(1 for j in sharded_jobs.values() if j.sharding == "fsdp" and not j.simulate) == 3
    groups = plan.groups(jobs, "quick")
    assert groups["quick/memory-gpt2-tiny-sharded"] == list(sharded_jobs)
    others = [p for gid, paths in groups.items() if "sharded" not in gid for p in paths]
    assert not set(others) & set(sharded_jobs)


def test_each_model_search_of_several_gpus_is_a_group_of_its_own():
    config = copy.deepcopy(CONFIG)
    config["suite"] = "gpu-capacity"
    jobs = checked(config)
    groups = plan.groups(jobs, "gpu-capacity")
    searches = [p for p, j in jobs.items() if j.kind == "model_capacity" and j.world_size > 1]
    assert len(searches) == 8
    assert sorted([paths for gid, paths in groups.items() if "sharded" in gid]) == sorted([p] for p in searches)
    assert "gpu-capacity/model_capacity-llama-1b-sharded-checkpointing-x64-zero3" in groups


def test_a_memory_section_takes_world_size_and_sharding():
    config = mutate(lambda c: c["suites"]["quick"]["memory"].update(
        methods=["adamw"], world_size=64, sharding="fsdp", simulate=True))
    jobs = checked(config)
    mem = {p: j for p, j in jobs.items() if j.kind == "memory" and "sharded" not in p and j.world_size == 64}
    assert sorted(p.split("/")[-1] for p in mem) == ["markov-bs16-seq128-seed0-ws64-fsdp-sim.json"] * 3
    # world size 1 under fsdp is allowed (today's numbers) and named
    one = Job(kind="memory", method="adamw", model="gpt2-tiny", batch_size=4, seq_len=32, sharding="fsdp")
    assert plan.result_path("s", one).endswith("markov-bs4-seq32-seed0-fsdp.json")


BAD = {
    "a method that cannot shard, named": (
        lambda c: c["suites"]["quick"]["sharded_memory"].update(methods=["adamw", "galore"]),
        "suites/quick/sharded_memory/methods: galore cannot run sharded (sharding fsdp"),
    "a stack with a member that cannot shard": (
        lambda c: c["suites"]["quick"]["sharded_memory"].update(methods=["checkpointing+microadam"]),
        "suites/quick/sharded_memory/methods: checkpointing+microadam cannot run sharded"),
    "a ZeRO stage for a method that cannot shard": (
        lambda c: c["suites"]["quick"]["sharded_memory"].update(shardings=["zero2"], methods=["galore"]),
        "suites/quick/sharded_memory/methods: galore cannot run sharded (sharding zero2"),
    "sharding at the suite's level reaches the throughput jobs": (
        lambda c: c["suites"]["quick"].update(sharding="fsdp"),
        "suites/quick/sharding: sharding fsdp applies to memory jobs only, not to throughput jobs"),
    "ranks at the suite's level reach the throughput jobs": (
        lambda c: c["suites"]["quick"].update(world_size=2),
        "suites/quick/world_size: world_size 2 applies to memory jobs only, not to throughput jobs"),
    "more real ranks than processes on one machine": (
        lambda c: c["suites"]["quick"]["sharded_memory"].update(world_sizes=[2, 8]),
        "suites/quick/sharded_memory/world_sizes: world_size 8: a real (tracked) sharded run"),
    "a world size over 1024": (
        lambda c: c["suites"]["quick"]["sharded_memory"].update(world_sizes=[2048]),
        "suites/quick/sharded_memory/world_sizes/0"),
    "fsdp on a GPU": (
        lambda c: c["suites"]["gpu"]["memory"].update(sharding="fsdp") or c.update(suite="gpu"),
        "suites/gpu/device: sharding fsdp runs on the cpu device"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_data_parallel_setting_no_job_can_measure_is_rejected_naming_the_key(case):
    change, expected = BAD[case]
    with pytest.raises(ConfigError) as err:
        checked(mutate(change))
    assert expected in str(err.value)


def test_all_leaves_out_the_methods_that_cannot_shard():
    config = mutate(lambda c: c["suites"]["quick"]["sharded_memory"].update(methods=["all"], tiers=["simulated"]))
    jobs = checked(config)
    fsdp = {j.method for j in jobs.values() if j.sharding == "fsdp"}
    replicas = {j.method for j in jobs.values() if j.world_size == 2 and j.sharding == "none"}
    assert "adamw" in fsdp and "galore" not in fsdp and "qlora" not in fsdp
    assert "galore" in replicas  # replicas: every method (that simulates)


def test_every_scheme_has_its_code_in_one_place():
    assert set(kinds.SHARDED) == {"fsdp", "zero1", "zero2", "zero3"}
    assert kinds.sharding_problem("memory", 1024, "fsdp", True, "cpu") is None
    # the ZeRO model replays one rank's timeline: any world size, tracked or simulated
    assert kinds.sharding_problem("memory", 64, "zero3", False, "cpu") is None
    assert kinds.sharding_problem("memory", 8, "none", False, "cuda") is None  # replicas: anywhere


@pytest.fixture(scope="module")
def sim_record(tmp_path_factory):
    """`membench run` of a simulated FSDP2 memory job on 2 ranks."""
    from bench.run import main

    out = tmp_path_factory.mktemp("sharded") / "r.json"
    assert main(["--kind", "memory", "--method", "adamw", "--model", "gpt2-tiny", "--batch-size", "4",
                 "--seq-len", "32", "--world-size", "2", "--sharding", "fsdp", "--simulate",
                 "--out", str(out)]) == 0
    return json.loads(out.read_text()), str(out)


def test_a_sharded_memory_job_holds_fsdp2s_shards(sim_record):
    record, _ = sim_record
    assert record["status"] == "ok", record.get("message")
    mem, shard = record["memory"], record["sharding"]
    shapes = [tuple(p.shape) for p in build("gpt2-tiny", "sdpa").parameters()]
    # FSDP2's rule, from the unsharded shapes: every rank keeps ceil(d0 / N) rows of each
    # parameter; AdamW keeps two moments of rank 0's own rows and a step counter each
    rows = [(math.ceil(s[0] / 2), math.prod(s[1:])) for s in shapes]
    own = [min(math.ceil(s[0] / 2), s[0]) * math.prod(s[1:]) for s in shapes]
    assert mem["tier"] == "simulated"
    assert mem["param_bytes"] == 4 * sum(r * rest for r, rest in rows)
    assert mem["optimizer_bytes"] == 2 * 4 * sum(own) + 4 * len(shapes)
    assert shard["scheme"] == "fsdp" and shard["world_size"] == 2
    assert shard["bytes"] == sum(shard[k] for k in sharded.SHARDING_PARTS) > 0
    assert shard["bytes"] <= mem["other_bytes"]
    assert shard["max_rank_peak_bytes"] == mem["peak_bytes"]  # rank 0 holds the most
    assert record["n_params"] == sum(math.prod(s) for s in shapes)


def test_the_summary_row_carries_the_data_parallel_setting(sim_record, tmp_path):
    record, path = sim_record
    row = aggregate.summary_rows(record, path)[0]
    assert (row["world_size"], row["sharding"]) == (2, "fsdp")
    assert row["sharding_bytes"] == record["sharding"]["bytes"]
    assert row["max_rank_peak_bytes"] == record["memory"]["peak_bytes"]
    cols = aggregate.SUMMARY_COLUMNS
    assert cols[cols.index("precision") + 1:cols.index("precision") + 3] == ["world_size", "sharding"]
    old = copy.deepcopy(record)
    for k in ("world_size", "sharding"):
        old["job"].pop(k)
    old.pop("sharding")
    row = aggregate.summary_rows(old, path)[0]
    assert (row["world_size"], row["sharding"], row["sharding_bytes"]) == (1, "none", None)


def test_tracked_dispatch_keeps_every_ranks_peak(monkeypatch):
    def fake_ranks(job, world_size, reference=False, threads=1):
        return [{"n_params": 10, "trainable_params": 10, "first_step_peak_bytes": 1, "loss": 2.0,
                 "before_update": None, "after_step": {}, "sharding": {"bytes": 5},
                 "memory": {"tier": "tracked", "peak_bytes": 100 - r}} for r in range(world_size)]

    monkeypatch.setattr(sharded, "run_ranks", fake_ranks)
    job = Job(kind="memory", method="adamw", model="gpt2-tiny", batch_size=4, seq_len=32,
              world_size=3, sharding="fsdp")
    out = kinds._fsdp(job, None)
    assert out["sharding"]["rank_peaks_bytes"] == [100, 99, 98]
    assert out["sharding"]["max_rank_peak_bytes"] == 100 and out["memory"]["peak_bytes"] == 100
    real = Job(kind="memory", method="adamw", model="gpt2-tiny", batch_size=4, seq_len=32,
               world_size=5, sharding="fsdp")
    record = runner.run(real)
    assert record["status"] == "error" and "world_size 5" in record["message"]


def test_replicas_hold_the_single_rank_jobs_bytes():
    base = dict(kind="memory", method="adamw", model="gpt2-tiny", batch_size=2, seq_len=16, simulate=True)
    one, two = runner.run(Job(**base)), runner.run(Job(**base, world_size=2))
    assert one["memory"]["peak_bytes"] == two["memory"]["peak_bytes"]
    assert two["sharding"]["scheme"] == "none" and "not modelled" in two["sharding"]["note"]
    throughput = runner.run(Job(kind="throughput", method="adamw", model="gpt2-tiny", batch_size=2,
                                seq_len=16, world_size=2))
    assert throughput["status"] == "error" and "world_size 2 applies to memory jobs only" in throughput["message"]


def _row(method, world_size, sharding, tier, peak):
    return {"kind": "memory", "method": method, "model": "gpt2-tiny", "batch_size": 8, "seq_len": 64,
            "device": "cpu", "dtype": "float32", "memory_tier": tier, "status": "ok", "seed": 0, "task": "markov",
            "world_size": world_size, "sharding": sharding, "peak_bytes": peak, "param_bytes": peak // 4,
            "grad_bytes": 0, "optimizer_bytes": peak // 4, "activation_bytes": peak // 4,
            "other_bytes": peak - 3 * (peak // 4), "sharding_bytes": 0 if world_size > 1 else None}


def test_sharded_rows_are_their_own_cells_labelled_with_scheme_and_ranks(tmp_path):
    rows = [_row("adamw", 1, "none", "tracked", 4000), _row("checkpointing", 1, "none", "tracked", 3000),
            _row("adamw", 2, "fsdp", "tracked", 2000), _row("adamw", 2, "fsdp", "simulated", 2000),
            _row("checkpointing", 2, "fsdp", "tracked", 1000), _row("adamw", 2, "none", "tracked", 4000)]
    summary = tables._tidy(pd.DataFrame(rows), aggregate.SUMMARY_COLUMNS)
    mem = tables.memory_table(summary)
    assert len(mem) == 5  # the tracked and simulated twin share a row
    fsdp = mem[mem["sharding"] == "fsdp"].set_index("method")
    assert fsdp.loc["adamw", "label"] == "adamw [fsdp x2]" and fsdp.loc["adamw", "tiers_agree"]
    assert fsdp.loc["checkpointing", "pct_vs_baseline"] == pytest.approx(-50)  # vs adamw [fsdp x2]
    assert mem[(mem["sharding"] == "none") & (mem["world_size"] == 2)]["label"].tolist() == ["adamw [ddp x2]"]
    one = mem[mem["world_size"] == 1].set_index("method")
    assert one.loc["checkpointing", "pct_vs_baseline"] == pytest.approx(-25)
    fig = figures.figure_memory_breakdown(summary)
    labels = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels()]
    assert {"adamw", "adamw [fsdp x2]", "checkpointing [fsdp x2]", "adamw [ddp x2]"} <= set(labels)
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert any("tracked = simulated" in t for t in texts)
    # an old summary (no data-parallel columns) compares with a new one as one rank
    new = pd.DataFrame(rows[:2]).reindex(columns=aggregate.SUMMARY_COLUMNS)
    old = new.drop(columns=["world_size", "sharding", "sharding_bytes", "max_rank_peak_bytes"])
    diffs, only, n = compare.compare(old, new)
    assert not diffs and not only and n > 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_zero_job_is_rank_0_of_the_model(stage):
    """A memory job under ZeRO is the model (bench/measure/zero.py) of rank 0, stated as
    such. Stage 1 and 2: the optimizer state is the rank's part of the flat group (padded to
    2 x world_size elements) as a float32 master copy and Adam's two moments, 12 bytes an
    element, plus one 4-byte step counter for the one flat parameter."""
    from bench.measure import zero

    job = Job(kind="memory", method="adamw", model="gpt2-tiny", batch_size=4, seq_len=32, simulate=True,
              world_size=2, sharding=f"zero{stage}")
    record = runner.run(job)
    assert record["status"] == "ok", record.get("message")
    assert record["memory"]["tier"] == "modelled" and record["sharding"]["scheme"] == f"zero{stage}"
    assert record["sharding"]["max_rank_peak_bytes"] >= record["memory"]["peak_bytes"]
    if stage < 3:
        numels = [p.numel() for p in build("gpt2-tiny").parameters()]
        assert zero.flat_partition_numel(numels, 2) == -(-sum(numels) // 4) * 4 // 2
        assert record["before_update"]["optimizer"] == 12 * zero.flat_partition_numel(numels, 2) + 4

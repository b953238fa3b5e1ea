"""`membench fit --gpus N --sharding ...`: per-GPU answers under FSDP2 (simulated) and ZeRO
(modelled), checked against the memory jobs of the same settings (their own code path:
`membench run` of a sharded memory job) and against the allocator model at the boundary."""
import contextlib
import io
import json

import pytest

from bench import fit
from bench.measure import allocator, runner, zero

# GiB (0.5 is the CUDA context): FSDP2's boundary is in the first, ZeRO-3's in the second (its
# 5e8-element reduce bucket is 954 MiB in bfloat16)
SIZES = [0.52, 1.47]
BATCH, SEQ = 4, 64


@pytest.fixture(scope="module")
def answered(tmp_path_factory):
    out = tmp_path_factory.mktemp("fit") / "rows.json"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = fit.main(["--model", "gpt2-tiny", "--methods", "adamw", "galore", "--gpus", "1", "2",
                         "--sharding", "fsdp", "zero3", "--batch-size", str(BATCH), "--seq-len", str(SEQ),
                         "--memory-gb", *map(str, SIZES), "--max-batch", "16", "--jobs", "1",
                         "--json", str(out)])
    return code, json.loads(out.read_text()), err.getvalue()


def rows_of(rows, method, world_size, sharding):
    return [r for r in rows if r["method"] == method and r["world_size"] == world_size
            and r["sharding"] == sharding]


def test_a_row_per_method_layout_and_size(answered):
    code, rows, _ = answered
    assert code == 0
    layouts = [(1, "none"), (2, "fsdp"), (2, "zero3")]
    for method in ("adamw", "galore"):
        for world_size, sharding in layouts:
            assert [r["memory_gb"] for r in rows_of(rows, method, world_size, sharding)] == SIZES


def test_a_method_that_cannot_shard_is_a_row_naming_why_and_runs_alone(answered):
    _, rows, _ = answered
    alone = rows_of(rows, "galore", 1, "none")
    assert all(r["status"] == "ok" for r in alone)
    for sharding in ("fsdp", "zero3"):
        for r in rows_of(rows, "galore", 2, sharding):
            assert r["status"] == "error" and f"cannot run sharded (sharding {sharding})" in r["message"]


@pytest.mark.parametrize("sharding", ["fsdp", "zero3"])
def test_the_step_is_the_sharded_memory_jobs_and_the_boundary_is_replayed(answered, sharding, tiny_job):
    """At --batch-size a row holds the sharded memory job's bytes (rank 0 for FSDP2; ZeRO:
    the model's largest rank, rank 0 of two for stage 3); the largest batch's own memory
    job fits the size under the allocator model and one more sequence does not."""
    _, rows, _ = answered
    job = dict(model="gpt2-tiny", batch_size=BATCH, seq_len=SEQ, dtype="bfloat16", simulate=True,
               world_size=2, sharding=sharding)
    alone = runner.run(tiny_job(**job))
    assert alone["status"] == "ok", alone.get("message")
    for row in rows_of(rows, "adamw", 2, sharding):
        for c in ("param", "grad", "optimizer", "activation", "other"):
            assert alone["memory"][f"{c}_bytes"] == row[f"{c}_bytes"], c
        assert row["sharding_bytes"] == alone["sharding"]["bytes"]
    big = rows_of(rows, "adamw", 2, sharding)[0 if sharding == "fsdp" else 1]
    k = big["largest_batch"]
    assert 0 < k < 16, big
    capacity = int(big["memory_gb"] * 2**30)

    def replays(batch):
        from bench.job import Job
        from bench.measure import sharded
        from bench.method import load

        j = Job(kind="memory", method="adamw", **{**job, "batch_size": batch})
        if sharding == "fsdp":
            events = sharded.measure_rank(j, load("adamw"), 2, 0)["events"]
        else:
            events = zero.model_ranks(zero.record_timeline(j, load("adamw")),
                                      zero.ZeroConfig(stage=3, world_size=2))["max"]["events"]
        return allocator.replay_on_gpu(events, capacity).fits

    assert replays(k) and not replays(k + 1)


def test_sharding_cuts_what_each_gpu_keeps(answered):
    """FSDP2 on 2 GPUs: each keeps about half of the parameters and optimizer state (the
    shards, padded); ZeRO-3 a float32 master and AdamW's two moments of its half."""
    _, rows, _ = answered
    one = rows_of(rows, "adamw", 1, "none")[0]
    fsdp = rows_of(rows, "adamw", 2, "fsdp")[0]
    assert one["param_bytes"] / 2 <= fsdp["param_bytes"] <= one["param_bytes"] / 2 * 1.05
    assert one["optimizer_bytes"] / 2 - 1024 <= fsdp["optimizer_bytes"] <= one["optimizer_bytes"] / 2 * 1.05
    zero3 = rows_of(rows, "adamw", 2, "zero3")[0]
    n = one["n_params"]
    # master (4 bytes) + two float32 moments (8) per element of the rank's half, padded
    assert 12 * n / 2 <= zero3["optimizer_bytes"] <= 12 * n / 2 * 1.05 + 1024


def test_the_table_names_each_layout(answered):
    _, rows, _ = answered
    text = fit.table(rows)
    assert "adamw [fsdp x2]" in text and "adamw [zero3 x2]" in text
    assert "galore [zero3 x2]  error: cannot run sharded" in text
    assert "one of N GPUs" in text


def test_one_gpu_is_the_unsharded_answer(answered, tmp_path):
    """--gpus 1 (any scheme) is the single-GPU question: the rows without --gpus."""
    _, rows, _ = answered
    out = tmp_path / "plain.json"
    with contextlib.redirect_stderr(io.StringIO()):
        assert fit.main(["--model", "gpt2-tiny", "--methods", "adamw", "--batch-size", str(BATCH), "--seq-len",
                         str(SEQ), "--memory-gb", *map(str, SIZES), "--max-batch", "16", "--jobs", "1",
                         "--json", str(out)]) == 0
    plain = json.loads(out.read_text())
    assert plain == rows_of(rows, "adamw", 1, "none")


def test_too_many_gpus_is_an_argparse_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as e:
        fit.main(["--model", "gpt2-tiny", "--methods", "adamw", "--gpus", "2048"])
    assert e.value.code == 2 and "--gpus" in capsys.readouterr().err


# -- the same search in a suite: a `sharded_model_capacity` section --------------------
def gpu_capacity(change=None):
    import copy

    import yaml

    from conftest import REPO

    config = copy.deepcopy(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))
    config["suite"] = "gpu-capacity"
    if change:
        change(config["suites"]["gpu-capacity"]["sharded_model_capacity"])
    return config


def test_gpu_capacity_plans_a_search_per_gpu_count_and_scheme():
    from bench import suite

    jobs = suite.check(gpu_capacity())[1]
    sharded = [j for j in jobs.values() if j.world_size > 1]
    section = gpu_capacity()["suites"]["gpu-capacity"]["sharded_model_capacity"]
    assert {(j.method, j.world_size, j.sharding) for j in sharded} == {
        (m, n, s) for m in section["methods"] for n in section["world_sizes"] for s in section["shardings"]}
    assert all(j.kind == "model_capacity" and j.simulate for j in sharded)
    paths = [p for p, j in jobs.items() if j.world_size > 1]
    assert len(set(paths)) == len(paths) and all(f"-ws{j.world_size}-{j.sharding}" in p
                                                 for p, j in jobs.items() if j.world_size > 1)


@pytest.mark.parametrize("change, key, why", [
    (lambda s: s.update(simulate=False), "suites/gpu-capacity/sharded_model_capacity/simulate",
     "runs simulated"),
    (lambda s: s.update(methods=["galore"]), "suites/gpu-capacity/sharded_model_capacity/methods",
     "galore cannot run sharded"),
    (lambda s: s.pop("shardings"), "suites/gpu-capacity/sharded_model_capacity",
     "'shardings' is a required property"),
])
def test_a_sharded_search_no_job_can_run_is_an_error_naming_the_key(change, key, why):
    from bench import suite

    with pytest.raises(suite.ConfigError) as err:
        suite.check(gpu_capacity(change))
    assert key in str(err.value) and why in str(err.value)


def test_a_rungs_weights_are_shared_among_the_gpus_before_it_is_built(monkeypatch):
    """Under FSDP2 a rung whose weights / N fit is built (its step runs); one whose share
    alone exceeds the memory is not."""
    from bench.job import Job
    from bench.measure import capacity

    built = []

    class Stub:
        tier = "simulated"

        def __init__(self, job, unit, runs=None, **kw):
            self.job, self.records, self.error = job, {}, None
            built.append(job.model)

        def need(self, batch):
            return 1

        def need_of(self, record):
            return 1

        def fits(self, batch, capacity):
            self.records[batch] = {"status": "ok"}
            return True

        def close(self):
            pass

    monkeypatch.setattr(capacity, "Oracle", Stub)
    job = Job(kind="model_capacity", method="adamw", model="gpt2-tiny", batch_size=1, seq_len=8, simulate=True,
              dtype="bfloat16", world_size=64, sharding="fsdp")
    # the ladder's top (GPT-3 13B's shape) is about 25 GB in bfloat16: 0.4 GiB on each of 64 GPUs
    found = capacity.search_model(job, [0.5], 1)
    top = found["ladder"][-1]
    assert found["sizes"][0]["largest_model"] == top and top in built
    built.clear()
    single = capacity.search_model(Job(**{**job.to_dict(), "world_size": 1, "sharding": "none"}), [0.5], 1)
    assert top not in built and single["sizes"][0]["largest_model"] != top

"""GPU memory sizes: the largest-batch and largest-model searches."""
import random
from dataclasses import replace

import pytest

from bench.measure import allocator, capacity, runner
from conftest import PAIR_HPARAMS

MiB = 2**20


@pytest.mark.parametrize("seed", range(20))
def test_largest_finds_the_boundary_of_a_monotone_predicate(seed):
    rng = random.Random(seed)
    most = rng.randint(1, 300)
    answer = rng.randint(0, most)
    calls = []

    def fits(k):
        calls.append(k)
        return k <= answer

    assert capacity.largest_fitting(fits, rng.randint(-5, most + 5), most) == answer
    assert 0 not in calls and len(calls) <= 2 * most.bit_length() + 2


@pytest.mark.parametrize("jump, answer", [(10, 5), (4, 3), (1, 6)])
def test_a_guess_from_the_anchor_at_zero_starts_below_the_secant(jump, answer):
    """A batch search's need jumps at the first batch (the step's own peak over what is
    kept between steps, the anchor at 0), then rises by a batch's bytes: the secant from
    the anchor to the first step overshoots, so the first probe is one below it, at or
    under the answer (the answer's neighbours then lie between steps run); the answer is
    the largest batch whose need fits."""
    kept, rise, first = 10, 3, 8

    def need_of(k):
        return kept + jump + rise * k

    capacity_bytes = need_of(answer) + 1
    known = {0: kept, first: need_of(first)}
    probes = []

    def need(k):
        probes.append(k)
        known[k] = need_of(k)

    assert capacity.guess_largest(need, lambda: dict(known), capacity_bytes, 64, probes=()) == answer
    assert probes[0] <= answer < probes[0] + 2

def test_tracked_search_answers_are_confirmed_by_capped_memory_jobs(tiny_job):
    job = tiny_job(kind="capacity", method="grad_accum", batch_size=64, seq_len=32,
                   memory_gb=[0.012, 0.02])
    record = runner.run(job)
    assert record["status"] == "ok", record.get("message")
    found = record["capacity"]
    assert found["tier"] == "tracked" and found["unit"] == 4
    needs = {r["batch_size"]: r["needed_bytes"] for r in found["runs"]}
    assert len(needs) == len(found["runs"])  # each batch run once, for every size
    for size in found["sizes"]:
        best, cap = size["largest_batch"], size["memory_gb"] * 2**30
        assert best > 0 and best % 4 == 0
        assert needs[best] <= cap < needs[best + 4]
        # the search's answer, checked by memory jobs the tracker caps at the size
        capped = [runner.run(tiny_job(method="grad_accum", batch_size=b, seq_len=32,
                                      capacity_gb=size["memory_gb"]))["status"]
                  for b in (best, best + 4)]
        assert capped == ["ok", "oom"]
    assert found["sizes"][0]["largest_batch"] < found["sizes"][1]["largest_batch"]


@pytest.mark.parametrize("method", ["adamw", "adama"])
def test_a_run_capped_at_its_own_peak_fits_and_one_byte_less_does_not(tiny_job, method):
    """Why a tracked search needs no capped runs: the cap raises exactly when the
    uncapped run's peak (over both steps) exceeds it."""
    free = runner.run(tiny_job(method=method, batch_size=8, seq_len=32))
    need = max(free["memory"]["peak_bytes"], free["first_step_peak_bytes"])
    status = [runner.run(tiny_job(method=method, batch_size=8, seq_len=32,
                                  capacity_gb=cap / 2**30))["status"] for cap in (need, need - 1)]
    assert status == ["ok", "oom"]


def test_simulated_search_answers_every_size_from_one_run_per_batch(tiny_job):
    # sizes a few MiB apart above the 0.5 GiB context: answers 5, 11 and 21 in 14 runs (at
    # 0.6, 0.7 and 0.8 GiB: 35, 80 and 128 in 31 runs, the same search, 3 times as long)
    job = tiny_job(kind="capacity", batch_size=512, seq_len=64, simulate=True,
                   memory_gb=[0.52, 0.54, 0.56])
    found = runner.run(job)["capacity"]
    batches = [r["batch_size"] for r in found["runs"]]
    assert len(batches) == len(set(batches))  # each batch simulated once
    needs = {r["batch_size"]: r["needed_bytes"] for r in found["runs"]}
    for size in found["sizes"]:
        best, cap = size["largest_batch"], size["memory_gb"] * 2**30
        assert needs[best] <= cap < needs[best + 1]
    # the search's steps count no FLOPs; an answer's cost is its memory job's
    best = found["sizes"][0]["largest_batch"]
    alone = runner.run(tiny_job(batch_size=best, seq_len=64, simulate=True))
    assert found["sizes"][0]["cost_at_largest"] == alone["cost"] and alone["cost"]["flops"] > 0


def test_a_failing_job_is_a_capacity_error_not_a_crash(tiny_job):
    record = runner.run(tiny_job(kind="capacity", seq_len=4096, memory_gb=[1.0]))
    assert record["status"] == "error" and "exceeds" in record["message"]
    assert record["capacity"]["sizes"][0]["largest_batch"] == 0


def test_simulation_accuracy_pairs_the_same_cell():
    import pandas as pd

    from bench.report.aggregate import SUMMARY_COLUMNS
    from bench.report.tables import _tidy, simulation_accuracy_table

    cell = dict(kind="memory", method="adamw", model="gpt2-small", batch_size=8, seq_len=512,
                dtype="bfloat16", status="ok")
    rows = [dict(cell, memory_tier="simulated", peak_bytes=100, reserved_peak_bytes=120),
            dict(cell, memory_tier="measured", peak_bytes=110, reserved_peak_bytes=126,
                 device_name="H100 80GB"),
            dict(cell, model="gpt2-xl", memory_tier="simulated", peak_bytes=5, reserved_peak_bytes=6)]
    table = simulation_accuracy_table(_tidy(pd.DataFrame(rows), SUMMARY_COLUMNS))
    assert list(table["model"]) == ["gpt2-small"]
    assert table["allocated_ratio"].iloc[0] == pytest.approx(1.10)
    assert table["reserved_ratio"].iloc[0] == pytest.approx(1.05)


# grad_accum and AdamA (micro-batches of 4) opt-in (`heavy`): test_fit holds grad_accum's
# answers from memory jobs
@pytest.mark.parametrize("method", ["adamw", pytest.param("grad_accum", marks=pytest.mark.heavy),
                                    pytest.param("adama", marks=pytest.mark.heavy), "galore", "roam"])
def test_a_searchs_batch_is_its_memory_job_in_every_byte(tiny_job, method):
    """Each batch of a simulated search is run as the memory job at that batch (a warm-up
    step and the step, both at the batch): the same bytes by category and the same trace,
    so the same GPU need, replayed from the first event or after the kept warm-up."""
    unit = 4 if method in ("grad_accum", "adama") else 1
    hparams = PAIR_HPARAMS.get(method, {})  # ROAM's budget as in its memory pair
    for batch in (8, 4 * unit):
        job = tiny_job(method=method, batch_size=batch, seq_len=64, simulate=True, hparams=hparams)
        sim = capacity._Simulation(replace(job, kind="capacity"))
        record, trace = sim.measure()
        alone = runner.run(job)
        for key in ("peak_bytes", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
                    "other_bytes", "predicted_allocated_peak_bytes", "reserved_peak_bytes", "predicted_gpu_bytes"):
            assert record["memory"][key] == alone["memory"][key], (batch, key)
        whole = allocator.replay(trace)
        assert record["memory"]["reserved_peak_bytes"] == whole.reserved_peak_bytes
        assert trace[:len(sim.prefix)] == sim.prefix and allocator.replay(trace, None, sim.resume) == whole


def test_a_batch_size_claim_compares_the_same_memory_size():
    import pandas as pd

    from bench.report.aggregate import SUMMARY_COLUMNS
    from bench.report.tables import _tidy, claim_table

    cell = dict(kind="capacity", model="bert-large", seq_len=384, dtype="float32",
                memory_tier="simulated", status="ok")
    rows = [dict(cell, method="adamw", capacity_gb=11, largest_batch=4),
            dict(cell, method="tempo", capacity_gb=11, largest_batch=6),
            dict(cell, method="adamw", capacity_gb=16, largest_batch=8),
            dict(cell, method="tempo", capacity_gb=16, largest_batch=13),
            dict(cell, method="tempo", capacity_gb=40, largest_batch=50)]  # no adamw: unpaired
    claim = dict(method="tempo", versus="adamw", metric="largest_batch_ratio", claim="2x",
                 setup="", source="")
    row = claim_table(_tidy(pd.DataFrame(rows), SUMMARY_COLUMNS), [claim]).iloc[0]
    assert row["n"] == 2 and row["ours"].startswith("1.50x to 1.62x")
    assert "11 GiB bert-large: 4 -> 6" in row["ours"]


def _boundary_runs(tiny_job, found, size, **kw):
    """Memory jobs (not the search's own runs) at the answer and the next size, capped."""
    ladder, best = found["ladder"], size["largest_model"]
    i = ladder.index(best)
    return [runner.run(tiny_job(model=name, capacity_gb=size["memory_gb"], **kw))["status"]
            for name in ladder[i:i + 2]]


def test_simulated_model_search_stops_where_the_next_size_does_not_fit(tiny_job):
    job = tiny_job(kind="model_capacity", batch_size=4, seq_len=64, simulate=True,
                   memory_gb=[0.56, 0.7])
    record = runner.run(job)
    assert record["status"] == "ok", record.get("message")
    found = record["capacity"]
    assert found["tier"] == "simulated" and found["ladder"][0] == "gpt2-tiny"
    answers = [found["ladder"].index(s["largest_model"]) for s in found["sizes"]]
    assert 0 < answers[0] < answers[1]  # more memory, a larger model
    for size in found["sizes"]:
        assert _boundary_runs(tiny_job, found, size, batch_size=4, seq_len=64,
                              simulate=True) == ["ok", "oom"]
    simulated = [r["model"] for r in found["runs"] if r["status"] == "ok"]
    assert len(simulated) == len(set(simulated)) < len(found["ladder"])  # a search, not a grid


def test_tracked_model_search_is_confirmed_by_capped_memory_jobs(tiny_job):
    record = runner.run(tiny_job(kind="model_capacity", method="grad_accum", batch_size=4,
                                 memory_gb=[0.02, 0.04]))
    assert record["status"] == "ok", record.get("message")
    found = record["capacity"]
    assert found["tier"] == "tracked"
    for size in found["sizes"]:
        assert size["n_params"] > 0 and not size["at_ladder_top"]
        assert _boundary_runs(tiny_job, found, size, method="grad_accum",
                              batch_size=4) == ["ok", "oom"]


def test_a_size_whose_weights_exceed_the_memory_is_not_built(tiny_job):
    record = runner.run(tiny_job(kind="model_capacity", model="llama-7b", batch_size=1,
                                 dtype="bfloat16", memory_gb=[4.0]))
    found = record["capacity"]
    assert record["status"] == "ok" and found["sizes"][0]["largest_model"] is None
    assert found["sizes"][0]["n_params"] == 0
    assert {r["status"] for r in found["runs"]} == {"weights exceed"}
    assert all(r["weight_bytes"] > 4 * 2**30 for r in found["runs"])


def test_a_model_search_needs_a_batch_the_micro_batches_divide(tiny_job):
    record = runner.run(tiny_job(kind="model_capacity", method="grad_accum", batch_size=6,
                                 memory_gb=[0.02]))
    assert record["status"] == "error" and "not divisible by micro_batches=4" in record["message"]

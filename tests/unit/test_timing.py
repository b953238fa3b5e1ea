"""Paired timing: the bootstrap interval's coverage under drift, and a method timed beside
itself."""
import math
import random

import pytest

from bench.measure import runner, timing


def drifting_pair(rng: random.Random, ratio: float, rounds: int):
    """Step times of a method `ratio` times as fast as its baseline, both under the same
    slow drift (a machine getting busier, then quieter) and independent noise."""
    a, b = [], []
    for i in range(rounds):
        drift = 1.0 + 0.5 * i / rounds + 0.3 * math.sin(i)
        b.append(drift * rng.lognormvariate(0, 0.05))
        a.append(drift / ratio * rng.lognormvariate(0, 0.05))
    return a, b


def test_bootstrap_interval_covers_the_true_ratio_at_about_its_nominal_rate():
    rng, true, covered, trials = random.Random(0), 1.3, 0, 200
    for t in range(trials):
        a, b = drifting_pair(rng, true, rounds=16)
        _, lo, hi = timing.bootstrap_median([tb / ta for ta, tb in zip(a, b)], seed=t)
        covered += lo <= true <= hi
    assert 0.85 <= covered / trials <= 0.995  # nominal 0.95


def test_pairing_cancels_drift_that_biases_unpaired_medians():
    rng = random.Random(1)
    a, b = drifting_pair(rng, 1.3, rounds=16)
    # the baseline timed first, then the method, as two separate runs: drift moves the ratio
    unpaired = sorted(b[:8])[4] / sorted(a[8:])[4]
    paired, lo, hi = timing.bootstrap_median([tb / ta for ta, tb in zip(a, b)])
    assert abs(paired - 1.3) < 0.05 < abs(unpaired - 1.3)
    assert lo <= 1.3 <= hi


def test_interleave_times_every_round_of_both_sides_in_a_seeded_order():
    calls = []
    a = timing.Side("a", lambda: calls.append("a"))
    b = timing.Side("b", lambda: calls.append("b"))
    timing.interleave(a, b, rounds=6, steps_per_round=2, seed=3)
    assert len(a.times) == len(b.times) == 6 and calls.count("a") == calls.count("b") == 12
    blocks = [calls[i] for i in range(0, len(calls), 2)]
    assert {tuple(blocks[i:i + 2]) for i in range(0, 12, 2)} == {("a", "b"), ("b", "a")}


@pytest.mark.parametrize("method", ["adamw", "grad_accum"])
def test_a_method_paired_with_itself_is_about_as_fast(tiny_job, method):
    record = runner.run(tiny_job(kind="throughput", method=method, baseline=method, steps=12,
                                 rounds=6, warmup_steps=1))
    assert record["status"] == "ok", record["message"]
    t = record["throughput"]
    assert t["baseline"] == method and len(t["round_ratios"]) == 6
    assert t["throughput_ratio_lo"] <= t["throughput_ratio"] <= t["throughput_ratio_hi"]
    # identical work on both sides: the ratio is 1 up to timing noise, never a real factor
    # (such as grad_accum's 4 micro-batches against one batch)
    assert 0.67 < t["throughput_ratio"] < 1.5

"""The throughput ratio's interval on many synthetic repeats: does it hold the ratio that
running the job again gives, at its stated rate?

A simulated job: its rounds' log ratios are the true log ratio, plus an effect of the run
(what every round of one run shares and the next run does not: the machine's load over the
minute the job ran), plus an effect per segment of rounds (the memory layout, the load of
the moment: drawn again for each segment), plus independent noise per round.
`timing.segment_interval` takes t over the segments and adds the between-runs spread it is
told; the bootstrap over rounds (`timing.bootstrap_median`, the interval before segments)
treats every round as independent, and sees no effect of the run."""
import importlib.util
import math
import random

import numpy as np
import pandas as pd
import pytest

from bench.measure import timing
from bench.report import compare
from conftest import REPO

TRUE = 0.8  # the method's tokens/s over the baseline's


def simulated_job(rng: random.Random, run: float, segment: float, within: float, rounds: int = 24,
                  outliers: float = 0.0) -> tuple[list, list]:
    """One run of a paired job: per-round ratios and the segment of each round; `run`,
    `segment` and `within` the sd (log) of each effect. A share `outliers` of the rounds
    carries four times the noise (a round another process slowed)."""
    segment_of = timing.segment_bounds(rounds)
    shared = rng.gauss(0, run)
    effect = [rng.gauss(0, segment) for _ in range(max(segment_of) + 1)]
    ratios = []
    for r in range(rounds):
        noise = rng.gauss(0, within * (4 if rng.random() < outliers else 1))
        ratios.append(TRUE * math.exp(shared + effect[segment_of[r]] + noise))
    return ratios, segment_of


def intervals(runs: list, kind: str, between_runs: float = 0.0) -> list[tuple[float, float, float]]:
    return [timing.segment_interval(r, s, between_runs=between_runs) if kind == "segments"
            else timing.bootstrap_median(r, seed=i) for i, (r, s) in enumerate(runs)]


def as_summary(results: list[tuple[float, float, float]]) -> pd.DataFrame:
    """Results of one run of many cells as the summary rows `membench compare` reads."""
    ratio, lo, hi = map(np.array, zip(*results))
    return pd.DataFrame(dict(kind="throughput", method=[f"m{i}" for i in range(len(ratio))], model="tiny",
                             batch_size=16, seq_len=128, throughput_ratio=ratio, throughput_ratio_lo=lo,
                             throughput_ratio_hi=hi))


def test_t_quantiles_are_students():
    # the textbook table (two-sided 95%: the 0.975 quantile) and a one-sided 95% one
    for df, q in [(1, 12.706), (2, 4.303), (3, 3.182), (5, 2.571), (7, 2.365), (10, 2.228), (30, 2.042)]:
        assert timing.t_quantile(0.975, df) == pytest.approx(q, abs=6e-4)
    assert timing.t_quantile(0.95, 5) == pytest.approx(2.015, abs=6e-4)
    assert timing.t_quantile(0.975, 100000) == pytest.approx(1.960, abs=1e-3)


@pytest.mark.parametrize("rounds", [2, 5, 8, 12, 24, 100])
def test_segments_are_consecutive_and_balanced(rounds):
    segment_of = timing.segment_bounds(rounds)
    k = min(timing.SEGMENTS, rounds)
    assert segment_of == sorted(segment_of) and set(segment_of) == set(range(k))
    sizes = [segment_of.count(s) for s in range(k)]
    assert max(sizes) - min(sizes) <= 1


def test_one_segment_falls_back_to_the_bootstrap_over_rounds():
    ratios = [0.8, 0.9, 0.85, 0.7, 0.95]
    assert timing.segment_interval(ratios, [0] * 5, between_runs=0.0) == timing.bootstrap_median(ratios)
    ratio, lo, hi = timing.segment_interval(ratios, [0] * 5, between_runs=0.05)
    _, blo, bhi = timing.bootstrap_median(ratios)
    assert lo < blo and hi > bhi and math.log(hi / ratio) == pytest.approx(math.hypot(math.log(bhi / ratio),
                                                                                       1.959964 * 0.05))


def test_the_between_runs_term_adds_in_quadrature():
    rng = random.Random(5)
    ratios, segment_of = simulated_job(rng, run=0.0, segment=0.0, within=0.1)
    r0, lo0, hi0 = timing.segment_interval(ratios, segment_of, between_runs=0.0)
    r1, lo1, hi1 = timing.segment_interval(ratios, segment_of, between_runs=0.05)
    assert r0 == r1 and lo1 < lo0 and hi1 > hi0
    inside = math.log(hi0 / r0) / timing.t_quantile(0.975, timing.SEGMENTS - 1)
    # between t(7) and the normal quantile: the sum has more degrees of freedom than its
    # estimated part alone
    assert 1.959 * math.hypot(inside, 0.05) < math.log(hi1 / r1) < 2.366 * math.hypot(inside, 0.05)


@pytest.mark.parametrize("run, segment, within, outliers", [
    (0.045, 0.0, 0.10, 0.0),  # what the shared 2-core CPU shows: noisy rounds, a run effect
    (0.045, 0.05, 0.02, 0.0),  # the layout or the load of the moment dominates the rounds' noise
    (0.02, 0.03, 0.05, 0.0),
    (0.0, 0.0, 0.10, 0.2),  # no effect of run or segment, heavy-tailed rounds
])
def test_the_interval_covers_the_true_ratio_at_its_nominal_rate(run, segment, within, outliers):
    """Told the run effect's spread (`between_runs`), the interval holds the true ratio,
    hence another run's at the rate of test_two_runs_hold_each_others_ratio..."""
    rng, trials = random.Random(0), 1000
    covered = 0
    for _ in range(trials):
        ratios, segment_of = simulated_job(rng, run, segment, within, outliers=outliers)
        _, lo, hi = timing.segment_interval(ratios, segment_of, between_runs=run)
        covered += lo <= TRUE <= hi
    assert 0.93 <= covered / trials <= 0.975  # nominal 0.95; binomial sd 0.007


def test_intervals_from_inside_one_run_do_not_cover_a_run_effect():
    """The rounds of one run share its effect: neither t over its segments alone nor the
    bootstrap over its rounds can see it (as on the shared CPU: docs/speed.md)."""
    rng, trials = random.Random(1), 300
    inside = rounds = 0
    for t in range(trials):
        ratios, segment_of = simulated_job(rng, run=0.045, segment=0.0, within=0.1)
        _, lo, hi = timing.segment_interval(ratios, segment_of, between_runs=0.0)
        inside += lo <= TRUE <= hi
        _, lo, hi = timing.bootstrap_median(ratios, seed=t)
        rounds += lo <= TRUE <= hi
    assert inside / trials < 0.85 and rounds / trials < 0.85  # stated 0.95


def test_the_bootstrap_over_rounds_does_not_cover_a_segment_effect():
    """The interval before segments: rounds of one process resampled as if independent.
    With an effect shared by neighbouring rounds it is too narrow; t over segments is not."""
    rng, trials = random.Random(1), 300
    covered = segments = 0
    for t in range(trials):
        ratios, segment_of = simulated_job(rng, run=0.0, segment=0.05, within=0.02)
        _, lo, hi = timing.bootstrap_median(ratios, seed=t)
        covered += lo <= TRUE <= hi
        _, lo, hi = timing.segment_interval(ratios, segment_of, between_runs=0.0)
        segments += lo <= TRUE <= hi
    assert covered / trials < 0.85 and segments / trials > 0.92  # stated 0.95


@pytest.mark.parametrize("run, segment, within", [(0.045, 0.0, 0.10), (0.0, 0.05, 0.02)])
def test_two_runs_hold_each_others_ratio_as_exact_intervals_would(run, segment, within):
    """Two independent runs of many jobs, compared as `membench compare --ratios` does: each
    run's interval holds the other run's ratio (both ways) about 83% of the time, as exact
    95% intervals would (tests/unit/test_compare.py), and the two agree within their
    combined interval about 95% of the time (a little more where t's factor for the
    segments' few degrees of freedom enters each half-width)."""
    rng, cells = random.Random(2), 1000
    jobs = [[simulated_job(rng, run, segment, within) for _ in range(cells)] for _ in range(2)]
    new = compare.ratio_agreement(*(as_summary(intervals(j, "segments", between_runs=run)) for j in jobs))
    assert 0.78 <= new["mutual_coverage"] <= 0.88
    assert 0.93 <= new["combined_agreement"] <= 0.99
    old = compare.ratio_agreement(*(as_summary(intervals(j[:300], "rounds")) for j in jobs))
    assert old["mutual_coverage"] < 0.65 and old["combined_agreement"] < 0.85


def test_without_any_shared_effect_t_over_segments_is_not_much_wider():
    """What t over 8 segments costs where the rounds are independent after all: a
    half-width about 1.1 times the bootstrap's (t with 7 degrees of freedom, and medians
    of 3 rounds, against the median of 24). The between-runs term costs more: it is there
    because the runs on a shared machine are not independent of their minute."""
    rng = random.Random(3)
    new, old = [], []
    for t in range(150):
        ratios, segment_of = simulated_job(rng, run=0.0, segment=0.0, within=0.1)
        _, lo, hi = timing.segment_interval(ratios, segment_of, between_runs=0.0)
        new.append(math.log(hi / lo))
        _, lo, hi = timing.bootstrap_median(ratios, seed=t)
        old.append(math.log(hi / lo))
    assert 0.9 < np.median(new) / np.median(old) < 1.35


def load_repeats_script():
    spec = importlib.util.spec_from_file_location("throughput_repeats", REPO / "scripts" / "throughput_repeats.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_repeats_benchmark_scores_runs_as_compare_does():
    """scripts/throughput_repeats.py's scoring of repeated runs of a job, on simulated
    records: every pair of repeats, as `compare.ratio_agreement` scores two summaries."""
    script = load_repeats_script()
    rng = random.Random(4)
    records = {}
    for m in ("a", "b"):
        records[m] = []
        for _ in range(5):
            ratios, segment_of = simulated_job(rng, run=0.04, segment=0.0, within=0.1)
            ratio, lo, hi = timing.segment_interval(ratios, segment_of)
            records[m].append({"throughput_ratio": ratio, "throughput_ratio_lo": lo, "throughput_ratio_hi": hi,
                               "round_ratios": ratios, "round_segments": segment_of})
    score = script.score(records)
    assert score["interval"]["pairs"] == score["bootstrap_rounds"]["pairs"] == 2 * 10
    # the same numbers as compare's, pair by pair
    one = compare.ratio_agreement(*(as_summary([(r["throughput_ratio"], r["throughput_ratio_lo"],
                                                 r["throughput_ratio_hi"]) for r in (records["a"][i], records["b"][i])])
                                    .assign(method=["a", "b"]) for i in (0, 1)))
    first = [p for p in script.pairs(records, "interval") if p["i"] == 0 and p["j"] == 1]
    assert np.median([p["abs_log"] for p in first]) == pytest.approx(one["median_abs_log"])
    assert np.mean([p["both"] for p in first]) == pytest.approx(one["mutual_coverage"])
    assert np.mean([p["combined"] for p in first]) == pytest.approx(one["combined_agreement"])
    components = script.components(records["a"])
    assert components["processes"] == 5 and components["segments"] == timing.SEGMENTS


@pytest.mark.parametrize("run", [0.0, 0.04])
def test_the_repeats_benchmark_recovers_the_between_runs_spread(run):
    """The estimate of `between_runs` from repeats: the spread of the runs' means beyond
    what their segments predict."""
    script = load_repeats_script()
    rng = random.Random(6)
    records = {m: [dict(zip(("round_ratios", "round_segments"), simulated_job(rng, run, 0.0, 0.1)))
                   for _ in range(40)] for m in "abc"}
    assert script.between_runs_estimate(records) == pytest.approx(run, abs=0.015)

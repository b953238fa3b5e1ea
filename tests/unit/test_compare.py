"""Comparing two summaries: exact numbers per cell, cells in one file only."""
import numpy as np
import pandas as pd

from bench.report import compare
from conftest import REPO

REFERENCE = REPO / "results" / "reference" / "cpu-2core" / "summary.csv"


def test_a_summary_equals_itself_and_a_changed_byte_is_found():
    a = pd.read_csv(REFERENCE)
    diffs, only, compared = compare.compare(a, a)
    assert diffs == [] and only == [] and compared > 100
    b = a.copy()
    row = b.index[b["kind"] == "memory"][0]
    b.loc[row, "activation_bytes"] += 1
    b = b.drop(b.index[b["kind"] == "convergence"][0])
    diffs, only, _ = compare.compare(a, b)
    assert len(diffs) == 1 and "activation_bytes" in diffs[0]
    assert len(only) == 1 and only[0].startswith("only in A")


def test_exact_intervals_agree_at_their_level_but_cover_each_other_less():
    """Two runs whose 95% intervals are exact: the combined test holds about 95% of the
    time, mutual coverage only about 83% (each ratio carries its own noise)."""
    rng = np.random.default_rng(0)
    n, sigma = 4000, 0.03
    truth = rng.uniform(0.5, 1.5, n)
    runs = []
    for _ in range(2):
        est = np.log(truth) + rng.normal(0, sigma, n)
        runs.append(pd.DataFrame(dict(
            kind="throughput", method=[f"m{i}" for i in range(n)], model="tiny", batch_size=16,
            seq_len=64, throughput_ratio=np.exp(est), throughput_ratio_lo=np.exp(est - 1.96 * sigma),
            throughput_ratio_hi=np.exp(est + 1.96 * sigma))))
    agreement = compare.ratio_agreement(*runs)
    assert agreement["cells"] == n
    assert 0.93 < agreement["combined_agreement"] < 0.97
    assert 0.80 < agreement["mutual_coverage"] < 0.87

"""Comparing two summaries: exact numbers per cell, cells in one file only."""
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

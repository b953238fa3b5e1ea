"""Compare two summary.csv files cell by cell: the numbers that must repeat exactly (peak
memory and its split, largest batch and model, final loss) and, with --ratios, the paired
throughput ratios (which repeat only within noise).

    membench compare results/reference/cpu-2core/summary.csv results/summary.csv

A cell is (kind, method, model, batch, sequence, dtype, tier, task, seed, memory size,
data-parallel ranks and scheme; a summary from before those columns: one rank, none).
Cells in only one file are listed, not counted as differences. Exit status 1 if any
compared number differs.
"""
from __future__ import annotations

import argparse
import math

import numpy as np
import pandas as pd

KEY = ["kind", "method", "model", "batch_size", "seq_len", "dtype", "memory_tier", "task", "seed",
       "capacity_gb", "world_size", "sharding"]
EXACT = {
    "memory": ["peak_bytes", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
               "other_bytes", "first_step_peak_bytes", "sharding_bytes", "max_rank_peak_bytes"],
    "capacity": ["largest_batch", "peak_bytes"],
    "model_capacity": ["largest_model", "n_params"],
    "convergence": ["final_loss"],
}


def _key(row) -> tuple:
    return tuple("" if (isinstance(v, float) and math.isnan(v)) else v for v in row)


def one_rank(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with `world_size` and `sharding` (from before data parallelism: 1, none)."""
    frame = frame.copy()
    frame["world_size"] = frame.get("world_size", pd.Series(1, index=frame.index)).fillna(1).astype(int)
    frame["sharding"] = frame.get("sharding", pd.Series("none", index=frame.index)).fillna("none").astype(str)
    return frame


def compare(a: pd.DataFrame, b: pd.DataFrame, rtol: float = 0.0) -> tuple[list[str], list[str], int]:
    """(differences, cells in only one file, numbers compared)."""
    a, b = one_rank(a), one_rank(b)
    diffs, only, compared = [], [], 0
    ia = {_key(r): r for r in a[KEY].assign(_i=range(len(a))).itertuples(index=False)}
    ib = {_key(r): r for r in b[KEY].assign(_i=range(len(b))).itertuples(index=False)}
    keys_a = {k[:-1]: k[-1] for k in ia}
    keys_b = {k[:-1]: k[-1] for k in ib}
    for key in sorted(set(keys_a) | set(keys_b), key=str):
        if key[0] not in EXACT:
            continue
        if key not in keys_a or key not in keys_b:
            only.append(f"{'only in B' if key not in keys_a else 'only in A'}: {key}")
            continue
        ra, rb = a.iloc[keys_a[key]], b.iloc[keys_b[key]]
        for col in EXACT[key[0]]:
            va, vb = ra.get(col), rb.get(col)
            if pd.isna(va) and pd.isna(vb):
                continue
            compared += 1
            same = (va == vb) if isinstance(va, str) or isinstance(vb, str) else (
                not pd.isna(va) and not pd.isna(vb) and math.isclose(float(va), float(vb),
                                                                    rel_tol=rtol, abs_tol=0))
            if not same:
                parallel = f" {key[11]} x{key[10]}" if (key[10], key[11]) != (1, "none") else ""
                diffs.append(f"{key[0]} {key[1]} {key[2]} bs{key[3]} seq{key[4]} {key[7]} seed{key[8]}"
                             f" cap{key[9]}{parallel}: {col} {va} -> {vb}")
    return diffs, only, compared


def ratio_agreement(a: pd.DataFrame, b: pd.DataFrame) -> dict:
    """Paired throughput ratios of the cells both runs have: |log(r1/r2)| per cell, whether
    each run's interval covers the other's ratio, and whether the two agree within their
    combined interval.

    Mutual coverage is not what a 95% interval promises: the other run's ratio carries its
    own noise, so even exact 95% intervals cover it only about 83% of the time (the
    difference of two estimates has sqrt(2) times their spread: P(|Z| < 1.96 / sqrt 2)).
    The test at the intervals' own level is `combined_agreement`: |log(r1 / r2)| within
    sqrt(h1^2 + h2^2), h being each interval's half-width in log space (about 95% when the
    intervals are right)."""
    cols = ["method", "model", "batch_size", "seq_len", "throughput_ratio", "throughput_ratio_lo",
            "throughput_ratio_hi"]
    if "throughput_ratio" not in a or "throughput_ratio" not in b:
        return {"cells": 0, "note": "a summary without paired ratios (made before pairing)"}
    ta = a[(a["kind"] == "throughput") & a["throughput_ratio"].notna()][cols]
    tb = b[(b["kind"] == "throughput") & b["throughput_ratio"].notna()][cols]
    m = ta.merge(tb, on=["method", "model", "batch_size", "seq_len"], suffixes=("_1", "_2"))
    if m.empty:
        return {"cells": 0}
    logs = np.abs(np.log(m["throughput_ratio_1"] / m["throughput_ratio_2"]))
    r1, r2 = m["throughput_ratio_1"], m["throughput_ratio_2"]
    cover = ((m["throughput_ratio_lo_1"] <= r2) & (r2 <= m["throughput_ratio_hi_1"])
             & (m["throughput_ratio_lo_2"] <= r1) & (r1 <= m["throughput_ratio_hi_2"]))
    half = [(np.log(m[f"throughput_ratio_hi_{i}"]) - np.log(m[f"throughput_ratio_lo_{i}"])) / 2
            for i in (1, 2)]
    combined = logs <= np.sqrt(half[0] ** 2 + half[1] ** 2)
    return {"cells": len(m), "max_abs_log": float(logs.max()), "median_abs_log": float(logs.median()),
            "cells_within_0.08": int((logs <= 0.08).sum()),
            "median_ratio_1": float(m["throughput_ratio_1"].median()),
            "median_ratio_2": float(m["throughput_ratio_2"].median()),
            "mutual_coverage": float(cover.mean()), "combined_agreement": float(combined.mean()),
            "worst": m.assign(abs_log=logs).sort_values("abs_log").tail(3)[
                ["method", "model", "throughput_ratio_1", "throughput_ratio_2"]].to_dict("records")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="membench compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", help="summary.csv A (e.g. a committed reference)")
    p.add_argument("b", help="summary.csv B (e.g. a new run)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default: exact)")
    p.add_argument("--ratios", action="store_true", help="also compare paired throughput ratios")
    args = p.parse_args(argv)
    a, b = pd.read_csv(args.a), pd.read_csv(args.b)
    diffs, only, compared = compare(a, b, args.rtol)
    for line in only:
        print(line)
    for line in diffs:
        print("DIFFERS", line)
    print(f"compare: {compared} numbers in {len(a)} / {len(b)} rows; {len(diffs)} differ; "
          f"{len(only)} cells in one file only")
    if args.ratios:
        print("throughput ratios:", ratio_agreement(a, b))
    return 1 if diffs else 0


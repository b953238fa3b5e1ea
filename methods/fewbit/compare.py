"""Our tables against the published ones: the L2 error of f' - q (w = 1 on [-100, 100],
the library's setting) of each, per function and bits.

    membench fewbit-compare                       # the tables quoted in METHODS.md 6.1
    membench fewbit-compare --published builtin.npz --out README.md

`--published`: fewbit's `fewbit/data/builtin.npz` (SkoltechAI/fewbit; arrays
`<name><bits:02d>-borders` with the outer borders -100 and 100, and `-levels`). Each
table's error is the direct quadrature of (f' - q)^2 (`tables.l2_error`), the same for
both; Approx-BP's 2-bit ReGELU2 / ReSiLU2 derivatives are listed beside our 2-bit ones.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from . import tables

# fewbit's published tables as quoted (rounded) in the suite's research notes, METHODS.md 6.1
QUOTED = {
    ("gelu", 1): ([-4.2e-5], [-2.1e-7, 1.0]),
    ("gelu", 2): ([-0.4536, 1.0e-5, 0.4536], [-0.00148, 0.32506, 0.67495, 1.00148]),
    ("gelu", 3): ([-2.41658, -0.71001, -0.32584, 1.07e-4, 0.32606, 0.71024, 2.41448],
                  [-0.000194, -0.088279, 0.125684, 0.372314, 0.627851, 0.874451, 1.088348, 1.000195]),
    ("silu", 3): ([-4.6004, -1.2530, -0.7156, -0.2907, 0.1014, 0.5044, 0.9722],
                  [-0.00048, -0.0695, 0.0808, 0.2603, 0.4531, 0.6482, 0.8356, 1.0027]),
}


def load_published(path: Path) -> dict:
    out = {}
    with np.load(path) as npz:
        for key in sorted({k.split("-", 1)[0] for k in npz.files}):
            name, bits = key[:-2], int(key[-2:])
            borders, levels = npz[f"{key}-borders"], npz[f"{key}-levels"]
            if (borders[0], borders[-1]) != tables.INTERVAL:
                raise ValueError(f"{key}: outer borders {borders[0]}, {borders[-1]}, expected -100, 100")
            out[(name, bits)] = (borders[1:-1].tolist(), levels.tolist())
    return out


def compare(published: dict) -> list[dict]:
    rows = []
    for (name, bits), (borders, levels) in sorted(published.items()):
        if name not in tables.ACTIVATIONS:
            continue
        integrals = tables.Integrals(name)
        theirs = tables.l2_error(integrals, borders, levels)
        ours = tables.table_error(name, bits)
        rows.append(dict(function=name, bits=bits, published=theirs, ours=ours, ratio=ours / theirs))
    return rows


def approx_bp_rows() -> list[dict]:
    from methods.approx_bp.activations import TABLES

    rows = []
    for which, name in (("regelu2", "gelu"), ("resilu2", "silu")):
        theirs = tables.l2_error(tables.Integrals(name), *TABLES[which])
        ours = tables.table_error(name, 2)
        rows.append(dict(function=f"{name} ({which})", bits=2, published=theirs, ours=ours, ratio=ours / theirs))
    return rows


def markdown(rows: list[dict], approx: list[dict]) -> str:
    lines = ["| function | bits | E published | E ours (DP) | ours / published |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['function']} | {r['bits']} | {r['published']:.9f} | {r['ours']:.9f} | {r['ratio']:.9f} |")
    worse = [r for r in rows if r["ours"] > r["published"] * (1 + 1e-12)]
    lines.append("")
    lines.append(f"{len(rows)} tables; ours worse than the published in {len(worse)}"
                 + (": " + ", ".join(f"{r['function']}/{r['bits']}" for r in worse) if worse else "")
                 + " (a tie within 1e-12 relative counts as equal).")
    lines += ["", "Approx-BP's 2-bit derivatives (fitted to the primitive f, not to f') against our 2-bit tables:", "",
              "| function | bits | E Approx-BP | E ours (DP) | ours / Approx-BP |", "|---|---|---|---|---|"]
    for r in approx:
        lines.append(f"| {r['function']} | {r['bits']} | {r['published']:.9f} | {r['ours']:.9f} | {r['ratio']:.9f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="membench fewbit-compare", description=__doc__.splitlines()[0])
    parser.add_argument("--published", type=Path,
                        help="fewbit's builtin.npz (default: the tables quoted in METHODS.md)")
    parser.add_argument("--out", type=Path, help="write the Markdown table here (default: print it)")
    args = parser.parse_args(argv)
    published = load_published(args.published) if args.published else QUOTED
    text = markdown(compare(published), approx_bp_rows())
    if args.out:
        args.out.write_text(text)
    print(text, end="")


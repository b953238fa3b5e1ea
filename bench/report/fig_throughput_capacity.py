"""Figure: estimated tokens/s at the largest batch that fits, per memory size.

For each capacity job (method, model) and memory size: the search's largest batch, times
the sequence length, over the estimated step time of that batch on an H100 SXM 80GB
(`bench.estimate`, from the exact cost of the largest batch's measured step: the summary's
`est_h100_tokens_per_s`). A panel per model, a line per method, memory size on x. What a
method's memory saving buys in speed when the batch grows into the saved memory, and what
its extra work costs. Estimated, and uncalibrated until `bench.estimate` has a fit for the
GPU (the label says which).

    membench throughput-capacity --summary results/summary.csv --out results/figures
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from bench.estimate import GPUS  # noqa: E402
from bench.measure.records import atomic_path  # noqa: E402
from bench.report.style import (FAIL_COLOR, LINESTYLES, MARKERS, finish,  # noqa: E402
                                method_colors, nudge)
from bench.report.tables import method_order, model_order, read_summary  # noqa: E402

NAME = "throughput_capacity"
GPU = "h100-sxm-80gb"  # the summary's est_h100_* columns


def table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (method, model, seq, dtype, memory size) of the capacity jobs finished
    ok: the largest batch and its estimated tokens/s (0 where nothing fits)."""
    cap = summary[(summary["kind"] == "capacity") & (summary["status"] == "ok")]
    cols = ["method", "model", "seq_len", "dtype", "memory_tier", "capacity_gb", "largest_batch",
            "est_h100_tokens_per_s", "est_h100_calibrated"]
    out = cap.reindex(columns=cols).reset_index(drop=True)
    out.loc[out["largest_batch"] == 0, "est_h100_tokens_per_s"] = 0.0
    return out


def figure(summary: pd.DataFrame) -> plt.Figure:
    rows = table(summary)
    drawn = rows.dropna(subset=["est_h100_tokens_per_s"])
    # rows where nothing fits carry no estimate, so no calibration flag: they do not count
    flags = drawn["est_h100_calibrated"].dropna().astype(bool)
    calibrated = bool(len(flags)) and bool(flags.all())
    label = f"estimated, {'calibrated' if calibrated else 'uncalibrated'}, {GPUS[GPU].name}"
    title = f"Tokens/s at the largest batch that fits\n({label})"
    if drawn.empty:
        fig, ax = plt.subplots(figsize=(6.4, 2.4))
        ax.set_axis_off()
        ax.set_title(title, fontsize=11)
        what = ("no capacity jobs in the summary" if rows.empty else
                "no capacity job has a cost of its largest batch")
        ax.text(0.5, 0.5, f"No data: {what}", ha="center", va="center", fontsize=11,
                transform=ax.transAxes, wrap=True)
        return fig
    methods = method_order(drawn["method"])
    colors = method_colors(methods)
    models = model_order(summary, drawn["model"])
    cells = (drawn.assign(_m=drawn["model"].map(models.index)).sort_values(["_m", "seq_len"])
             [["model", "seq_len", "dtype"]].drop_duplicates().to_dict("records"))
    ncols = min(4, len(cells))
    nrows = int(np.ceil(len(cells) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    axes = axes.ravel()
    for ax in axes[len(cells):]:
        ax.set_axis_off()
    for ax, cell in zip(axes, cells):
        part = drawn[(drawn["model"] == cell["model"]) & (drawn["seq_len"] == cell["seq_len"])
                     & (drawn["dtype"] == cell["dtype"])]
        positive = part.loc[part["est_h100_tokens_per_s"] > 0, "est_h100_tokens_per_s"]
        floor = 0.5 * positive.min() if len(positive) else 1.0
        for i, method in enumerate(methods):
            r = part[part["method"] == method].sort_values("capacity_gb")
            if r.empty:
                continue
            x = r["capacity_gb"] * nudge(i, len(methods))  # equal answers stay visible
            y = r["est_h100_tokens_per_s"].where(r["est_h100_tokens_per_s"] > 0, floor)
            ax.plot(x, y, color=colors[method], marker=MARKERS[i % len(MARKERS)],
                    linestyle=LINESTYLES[i % len(LINESTYLES)], linewidth=1.4, markersize=5,
                    label=method)
            none = r["est_h100_tokens_per_s"] <= 0
            ax.scatter(x[none], [floor] * int(none.sum()), marker="x", color=FAIL_COLOR, zorder=5, s=30)
        sizes = sorted({float(g) for g in part["capacity_gb"]})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{g:g}" for g in sizes])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("memory size (GiB)")
        ax.set_ylabel("tokens/s (estimated)")
        ax.set_title(f"{cell['model']} · seq {int(cell['seq_len'])} · {cell['dtype']}", fontsize=10)
    handles = [plt.Line2D([], [], color=colors[m], marker=MARKERS[i % len(MARKERS)],
                          linestyle=LINESTYLES[i % len(LINESTYLES)], label=m)
               for i, m in enumerate(methods)]
    note = ("Each point: the capacity search's largest batch at that memory size, times the "
            "sequence length, over the estimated step time of that batch (sum over the step's "
            "operators of max(FLOPs / dense peak, bytes / bandwidth) + a launch cost; "
            + ("the efficiencies and launch cost fitted on measured GPU rows, "
               "results/reference/gpu_efficiency.json" if calibrated else
               "spec-sheet figures, 5 us per launch") +
            "; no overlap, no fusion). x on the floor: nothing fits. Memory tier: "
            + (", ".join(sorted(set(drawn["memory_tier"].dropna()))) or "unknown") + ".")
    finish(fig, title, note, handles, ncol=min(len(methods), 5), title="method")
    return fig


def throughput_at_capacity(summary: pd.DataFrame | str | Path, out: str | Path) -> list[Path]:
    """Draw the figure from a summary (a frame, or the path of summary.csv) as
    <out>/throughput_capacity.png and .pdf."""
    if not isinstance(summary, pd.DataFrame):
        summary = read_summary(summary)
    fig = figure(summary)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for ext in ("png", "pdf"):
        target = out / f"{NAME}.{ext}"
        with atomic_path(target) as tmp:
            fig.savefig(tmp, format=ext, dpi=150, bbox_inches="tight")
        written.append(target)
    plt.close(fig)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="membench throughput-capacity",
                                description=__doc__.splitlines()[0])
    p.add_argument("--summary", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    for path in throughput_at_capacity(args.summary, args.out):
        print(path, file=sys.stderr)
    return 0


"""Figures from summary.csv and curves.csv.

    membench figures --summary results/summary.csv --curves results/curves.csv \\
        --out results/figures

Every name in `FIGURES` is written as <name>.png and <name>.pdf, always: a kind with no
rows gives a figure that says so. The numbers come from `bench.report.tables`, shared with
`bench.report.markdown`, so the report and the figures show the same numbers.

Conventions: the baseline is AdamW (`BASELINE`); methods are ordered baseline first, then
alphabetically; a job whose status is not ``ok`` is never dropped silently: it is drawn as
text (its status) where its bar or line would be.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from bench.measure.records import atomic_path  # noqa: E402
from bench.report import fig_throughput_capacity  # noqa: E402
from bench.report.tables import (BASELINE, CATEGORIES,  # noqa: E402
                          CONVERGENCE_CELL, GPUS_CELL, SCHEMES, THROUGHPUT_CELL, capacity_table, method_label,
                          convergence_table, largest_model_gpus_table, largest_model_table, memory_table,
                          dtype_text, method_order, scheme_name,
                          model_order, overview_table, parameters_text, read_curves, read_summary,
                          PHASES, reported, status_text, task_label, throughput_table, tuning_table)
from bench.report.style import (FAIL_COLOR, LINESTYLES, MARKERS, finish,  # noqa: E402
                                method_colors, method_linestyles, nudge)

FIGURES = ["overview", "memory_breakdown", "throughput_relative", "convergence", "sensitivity",
           "capacity", "model_capacity", "model_capacity_gpus", "throughput_capacity"]

DPI = 150
SMOOTH_POINTS = 50          # curves longer than this get a rolling mean over len // this steps


# ----------------------------------------------------------------------------- colours


def category_colors() -> dict[str, tuple]:
    palette = sns.color_palette("colorblind", len(CATEGORIES))
    colors = dict(zip(CATEGORIES, palette))
    colors["other"] = (0.72, 0.72, 0.72)
    return colors


# ----------------------------------------------------------------------------- drawing


def save(fig: plt.Figure, out: str | Path, name: str) -> list[Path]:
    """Write <out>/<name>.png (DPI) and .pdf, each atomically; close the figure."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for ext in ("png", "pdf"):
        target = out / f"{name}.{ext}"
        with atomic_path(target) as tmp:
            fig.savefig(tmp, format=ext, dpi=DPI, bbox_inches="tight")
        written.append(target)
    plt.close(fig)
    return written


def no_data_figure(title: str, what: str) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(6.4, 2.4))
    ax.set_axis_off()
    ax.set_title(title, fontsize=12)
    ax.text(0.5, 0.5, f"No data: {what}", ha="center", va="center", fontsize=12,
            transform=ax.transAxes, wrap=True)
    return fig


def _grid(n: int, ncols: int, panel_w: float, panel_h: float, **kw):
    ncols = max(1, min(ncols, n))
    nrows = int(np.ceil(n / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel_w * ncols, panel_h * nrows),
                             squeeze=False, **kw)
    axes = axes.ravel()
    for ax in axes[n:]:
        ax.set_axis_off()
    return fig, axes[:n]


def _fmt_num(v, digits=0) -> str:
    return "?" if v is None or pd.isna(v) else f"{int(v)}" if digits == 0 else f"{v:.{digits}f}"


def _cell_title(key: dict, show_device: bool) -> str:
    parts = [str(key["model"]), f"batch {_fmt_num(key['batch_size'])}",
             f"seq {_fmt_num(key['seq_len'])}"]
    if show_device:
        parts.append(str(key["device"]))
    return " · ".join(parts)


def _devices_text(summary_part: pd.DataFrame) -> str:
    pairs = sorted({(str(d), str(n)) for d, n in zip(summary_part["device"],
                                                     summary_part["device_name"].fillna(""))})
    return "; ".join(f"{d} ({n})" if n else d for d, n in pairs) or "unknown device"


def _tiers_text(summary_part: pd.DataFrame) -> str:
    return ", ".join(sorted(set(summary_part["memory_tier"].dropna()))) or "unknown"


def _method_label(method: str, micro_batches, world_size=1, sharding="none") -> str:
    """A bar's label: the method (under data parallelism with its scheme and ranks,
    `tables.method_label`) and its micro-batches."""
    label = method_label(method, world_size, sharding)
    if pd.notna(micro_batches) and micro_batches > 1:
        return f"{label}\n({int(micro_batches)} micro-batches)"
    return label


# a memory panel: one model, batch, sequence and device; its rows, every setting of data
# parallelism (one GPU, then each sharded setting's methods, labelled "adamw [fsdp x2]")
MEMORY_PANEL = ["model", "batch_size", "seq_len", "device"]


def _panel_rows(part: pd.DataFrame, methods: list[str]) -> list[tuple[str, pd.Series | None]]:
    """A memory panel's rows as (label, its memory_table row or None: no job): every one-GPU
    method (where the panel has one-GPU rows), then the sharded rows present, by world size,
    scheme and method."""
    one = (part["world_size"] == 1) & (part["sharding"] == "none")
    single = part[one].set_index("method")
    out = [(m, single.loc[m] if m in single.index else None) for m in methods] if one.any() else []
    sharded = part[~one].assign(_o=lambda t: t["method"].map(method_order(t["method"]).index))
    for _, row in sharded.sort_values(["world_size", "sharding", "_o"]).iterrows():
        out.append((row["method"], row))
    return out


def figure_memory_breakdown(summary: pd.DataFrame) -> plt.Figure:
    """Stacked horizontal bars of peak memory by category, one panel per cell."""
    title = "Peak training memory by category"
    table = memory_table(summary)
    if table.empty:
        return no_data_figure(title, "no memory jobs in the summary")
    mem = summary[summary["kind"] == "memory"]
    one_gpu = table[(table["world_size"] == 1) & (table["sharding"] == "none")]
    methods = method_order(one_gpu["method"])
    models = model_order(summary, table["model"])
    table = table.assign(_m=table["model"].map(models.index)).sort_values(
        ["_m", "batch_size", "seq_len", "device"])
    cells = table[MEMORY_PANEL].drop_duplicates().to_dict("records")
    show_device = table["device"].nunique() > 1
    per_model = table.groupby("model")[["batch_size", "seq_len", "device"]].apply(
        lambda g: len(g.drop_duplicates())).max()
    colors = category_colors()
    panels = [_panel_rows(table[_key_match(table, cell, MEMORY_PANEL)], methods) for cell in cells]
    n_rows = max(len(rows) for rows in panels)
    fig, axes = _grid(len(cells), min(len(cells), int(per_model) if per_model > 1 else 3), 6.2,
                      0.55 * n_rows + 1.5)
    for ax, cell, rows in zip(axes, cells, panels):
        part = table[_key_match(table, cell, MEMORY_PANEL)]
        ys = np.arange(len(rows))
        x_max = np.nanmax(part["peak_mib"].to_numpy(dtype=float), initial=0.0) or 1.0
        for y, (method, row) in zip(ys, rows):
            if row is None:
                ax.text(x_max * 0.02, y, "no job", va="center", color="0.5", style="italic")
                continue
            if row["n_ok"] == 0:
                ax.text(x_max * 0.02, y, f"{row['status']} (no bar)", va="center",
                        color=FAIL_COLOR, fontweight="bold")
                continue
            left = 0.0
            for c in CATEGORIES:
                width = 0.0 if pd.isna(row[f"{c}_mib"]) else row[f"{c}_mib"]
                ax.barh(y, width, left=left, color=colors[c], edgecolor="white", linewidth=0.5,
                        height=0.7)
                left += width
            label = f"{row['peak_mib']:.1f}"
            if method != BASELINE and pd.notna(row["pct_vs_baseline"]):
                label += f" ({row['pct_vs_baseline']:+.0f}%)"
            if row["status"] != "ok":
                label += f"  [{row['status']}]"
            agree = row["tiers_agree"]  # a real run and its simulated twin: the same bytes?
            if agree is not None and not pd.isna(agree):
                label += "  (tracked = simulated)" if bool(agree) else "  (tiers differ: mean)"
            ax.text(row["peak_mib"] + x_max * 0.02, y, label, va="center", fontsize=8.5)
        ax.set_yticks(ys, [m if row is None else _method_label(m, row["micro_batches"], row["world_size"],
                                                               row["sharding"]) for m, row in rows],
                      fontsize=9)
        ax.set_ylim(n_rows - 0.5, -0.5)
        ax.set_xlim(0, x_max * 1.45)
        ax.set_xlabel("peak memory (MiB)")
        ax.set_title(_cell_title(cell, show_device), fontsize=10)
        ax.grid(axis="y", visible=False)
    handles = [Patch(color=colors[c], label=c) for c in CATEGORIES]
    finish(fig, f"{title} (memory tier: {_tiers_text(mem)}; device: {_devices_text(mem)})",
           f"Number at each bar: peak MiB (change vs {BASELINE} in the same panel, under the same "
           f"data-parallel setting). A job that did not finish shows its status in red instead of a bar. "
           f"A sharded row (\"{BASELINE} [fsdp x2]\") is rank 0's memory of that many ranks.",
           handles, ncol=len(CATEGORIES), title="memory category (stacked left to right)")
    return fig


def _key_match(frame: pd.DataFrame, cell: dict, keys: list[str]) -> pd.Series:
    """Rows of `frame` equal to `cell` on `keys`, where missing equals missing."""
    mask = pd.Series(True, index=frame.index)
    for k in keys:
        v = cell[k]
        mask &= frame[k].isna() if pd.isna(v) else (frame[k] == v)
    return mask


def figure_throughput_relative(summary: pd.DataFrame) -> plt.Figure:
    """Tokens/s relative to the baseline, one panel per model (and per cell without one)."""
    title = f"Training throughput relative to {BASELINE}"
    table = throughput_table(summary)
    if table.empty:
        return no_data_figure(title, "no throughput jobs in the summary")
    thr = summary[summary["kind"] == "throughput"]
    methods = method_order(table["method"])
    models = model_order(summary, table["model"])
    colors = method_colors(method_order(summary["method"]))
    panels = []  # (model, relative?) -> cells
    for model in models:
        part = table[table["model"] == model]
        for relative in (True, False):
            cells = part[part["has_baseline"] == relative][
                ["batch_size", "seq_len", "device"]].drop_duplicates()
            if len(cells):
                panels.append((model, relative, cells.to_dict("records")))
    show_device = table["device"].nunique() > 1
    fig, axes = _grid(len(panels), 3, 5.6, 0.55 * len(methods) * max(
        len(c) for _, _, c in panels) ** 0.5 + 1.6)
    hatches = ["", "//", "..", "xx", "\\\\", "++"]
    for ax, (model, relative, cells) in zip(axes, panels):
        value, lo, hi = (("ratio", "ratio_lo", "ratio_hi") if relative
                         else ("tokens_per_s", "tokens_per_s", "tokens_per_s"))
        part = table[table["model"] == model]
        height = 0.8 / len(cells)
        ys = np.arange(len(methods))
        x_top = np.nanmax(np.r_[part[part["has_baseline"] == relative][hi].to_numpy(float),
                                part[part["has_baseline"] == relative][value].to_numpy(float),
                                1.0 if relative else 0.0])
        x_top = x_top if np.isfinite(x_top) and x_top > 0 else 1.0
        for j, cell in enumerate(cells):
            rows = part[_key_match(part, {"model": model, **cell}, THROUGHPUT_CELL)]
            rows = rows.set_index("method")
            offset = (j - (len(cells) - 1) / 2) * height
            for y, method in zip(ys, methods):
                yy = y + offset
                if method not in rows.index:
                    ax.text(x_top * 0.02, yy, "no job", va="center", color="0.5",
                            style="italic", fontsize=9)
                    continue
                row = rows.loc[method]
                if row["n_ok"] == 0 or pd.isna(row[value]):
                    ax.text(x_top * 0.02, yy, f"{row['status']} (no bar)", va="center",
                            color=FAIL_COLOR, fontweight="bold", fontsize=9)
                    continue
                err = None
                if relative and pd.notna(row[lo]) and pd.notna(row[hi]):
                    err = [[row[value] - row[lo]], [row[hi] - row[value]]]
                ax.barh(yy, row[value], height=height * 0.9, color=colors[method],
                        hatch=hatches[j % len(hatches)], edgecolor="white",
                        xerr=err, error_kw=dict(ecolor="black", capsize=3, lw=1))
                text = f"{row[value]:.2f}x" if relative else f"{row[value]:,.0f}"
                if len(cells) > 1:
                    text += f"  ({_fmt_num(cell['batch_size'])}x{_fmt_num(cell['seq_len'])})"
                ax.text(max(row[hi] if pd.notna(row[hi]) else 0, row[value]) + x_top * 0.02,
                        yy, text, va="center", fontsize=8.5)
        if relative:
            ax.axvline(1.0, color="black", ls="--", lw=1)
            ax.set_xlabel(f"tokens/s relative to {BASELINE} (ratio)")
        else:
            ax.set_xlabel("throughput (tokens/s, absolute)")
        ax.set_xlim(0, x_top * 1.35)
        labels = [_method_label(m, part.set_index("method")["micro_batches"].groupby(level=0)
                                .max().get(m)) for m in methods]
        ax.set_yticks(ys, labels, fontsize=9)
        ax.set_ylim(len(methods) - 0.5, -0.5)
        shape = (f"batch {_fmt_num(cells[0]['batch_size'])} · seq {_fmt_num(cells[0]['seq_len'])}"
                 if len(cells) == 1 else "labels: batch x seq")
        if show_device and len(cells) == 1:
            shape += f" · {cells[0]['device']}"
        ax.set_title(f"{model} ({shape})" + ("" if relative else
                     f"\nno ok {BASELINE} job: absolute tokens/s"), fontsize=10)
        ax.grid(axis="y", visible=False)
    finish(fig, f"{title} (device: {_devices_text(thr)})",
           f"Bars: tokens/s of the method / tokens/s of {BASELINE} with the same model, batch "
           f"and sequence length, both timed in the same process in interleaved rounds (dashed "
           f"line: 1.0 = as fast as {BASELINE}). Error bars: 95% interval for running the "
           "job again (over segments of rounds, plus the spread between runs: docs/speed.md). "
           "A job that did not finish shows its status in red instead of a bar.")
    return fig


def _smooth_window(n_steps: int) -> int:
    return max(1, n_steps // SMOOTH_POINTS)


def _failure_lines(conv: pd.DataFrame, has_partial: bool = False) -> list[str]:
    """'method: status xN' per method with a failed job, then the distinct messages."""
    bad = conv[conv["status"] != "ok"]
    if bad.empty:
        return []
    lines = ["failed jobs (not in the means; " + ("dotted: steps logged before failing):"
                                                  if has_partial else "no curve):")]
    for method in method_order(bad["method"]):
        g = bad[bad["method"] == method]
        lines.append(f"  {method}: {status_text(g['status'])}")
    for msg in list(dict.fromkeys(m for m in bad["message"] if isinstance(m, str)))[:2]:
        lines += textwrap.wrap(msg, 60, initial_indent="  ", subsequent_indent="    ")
    return lines


def _identical_groups(means: dict[str, pd.Series]) -> list[list[str]]:
    """Methods whose mean curves coincide (so their lines overlap)."""
    groups: list[list[str]] = []
    for method, curve in means.items():
        for g in groups:
            other = means[g[0]]
            if curve.index.equals(other.index) and np.allclose(curve, other, rtol=0, atol=1e-9):
                g.append(method)
                break
        else:
            groups.append([method])
    return [g for g in groups if len(g) > 1]


def figure_convergence(summary: pd.DataFrame, curves: pd.DataFrame) -> plt.Figure:
    """Training loss vs optimizer step per (task, model): mean over seeds, min-max band."""
    title = "Convergence: training loss per optimizer step"
    conv, curves = reported(summary[summary["kind"] == "convergence"]), reported(curves)
    keys = set(map(tuple, conv[CONVERGENCE_CELL].to_numpy().tolist())) | \
        set(map(tuple, curves[CONVERGENCE_CELL].to_numpy().tolist()))
    if not keys:
        return no_data_figure(title, "no convergence jobs in the summary or curves")
    models = model_order(summary, [k[1] for k in keys])
    phases = list(PHASES)
    panels = sorted(keys, key=lambda k: (phases.index(k[2]) if k[2] in phases else 9, str(k[0]), models.index(k[1])))
    every = method_order(set(summary["method"]) | set(curves["method"]))
    colors, styles = method_colors(every), method_linestyles(every)
    all_methods = method_order(set(conv["method"]) | set(curves["method"]))
    fig, axes = _grid(len(panels), 2, 6.4, 4.6)
    windows, drawn = set(), set()
    floor_drawn = start_drawn = False
    for ax, (task, model, phase, tuning) in zip(axes, panels):
        cell = {"task": task, "model": model, "phase": phase, "tuning": tuning}
        part = curves[_key_match(curves, cell, CONVERGENCE_CELL)]
        jobs = conv[_key_match(conv, cell, CONVERGENCE_CELL)]
        means, tails = {}, []
        partial = part[part["status"] != "ok"]
        for (method, seed), g in partial.groupby(["method", "seed"], dropna=False):
            ax.plot(g["step"], g["loss"], color=colors[method], ls=":", lw=1.2, marker=".",
                    markersize=3)
            drawn.add(method)
        for method in method_order(part["method"]):
            runs = part[(part["method"] == method) & (part["status"] == "ok")]
            if runs.empty:
                continue
            wide = runs.pivot_table(index="step", columns="seed", values="loss", aggfunc="mean")
            window = _smooth_window(len(wide))
            windows.add(window)
            wide = wide.rolling(window, min_periods=1).mean()
            mean = wide.mean(axis=1)
            means[method] = mean
            ax.plot(mean.index, mean, color=colors[method], ls=styles[method], lw=1.6)
            if wide.shape[1] > 1:
                ax.fill_between(wide.index, wide.min(axis=1), wide.max(axis=1),
                                color=colors[method], alpha=0.18, lw=0)
            drawn.add(method)
            tails.append(mean.iloc[len(mean) // 2:])
        floors = pd.concat([part["loss_floor"], jobs["loss_floor"]]).dropna()
        lines = bool(means) or not partial.empty
        if len(floors) and lines:
            floor = floors.mean()
            ax.axhline(floor, color="black", ls="--", lw=1)
            ax.annotate(f"loss floor (entropy rate) = {floor:.3f}", (1.0, floor),
                        xycoords=("axes fraction", "data"), xytext=(-4, -3),
                        textcoords="offset points", ha="right", va="top", fontsize=8.5)
            bottom, top = ax.get_ylim()
            ax.set_ylim(min(bottom, floor - 0.09 * (top - floor)), top)
            floor_drawn = True
        start = _start_loss(part) if phase == "finetune" else None
        if start is not None:
            ax.axhline(start, color="0.45", ls="-.", lw=1)
            ax.annotate(f"pre-trained model = {start:.3f}", (0.0, start), xycoords=("axes fraction", "data"),
                        xytext=(4, 3), textcoords="offset points", ha="left", va="bottom", fontsize=8.5)
            start_drawn = True
        notes = _failure_lines(jobs, has_partial=not partial.empty)
        same = _identical_groups(means)
        notes += [f"identical curves (lines overlap): {' = '.join(g)}" for g in same]
        if not lines and not notes:
            notes = ["no curve points"]
        if notes and not lines:   # nothing drawn: the failures are the panel
            ax.text(0.5, 0.5, "\n".join(notes), transform=ax.transAxes, va="center",
                    ha="center", fontsize=8.5, color=FAIL_COLOR,
                    bbox=dict(boxstyle="round", fc="white", ec="0.8"))
        elif notes:               # below the x-axis label, off the data
            ax.annotate("\n".join(notes), (0.0, 0.0), xycoords="axes fraction",
                        xytext=(0, -40), textcoords="offset points", va="top", ha="left",
                        fontsize=8.5, color=FAIL_COLOR if len(notes) > len(same) else "0.25")
        if means:
            _zoom_inset(ax, means, tails, floors.mean() if len(floors) else np.nan, colors,
                        styles)
        if lines:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("optimizer step")
            ax.set_ylabel("training loss (nats/token)")
        else:
            ax.set_xticks([])
            ax.set_yticks([])
        ax.set_title(f"{task_label(task, phase, tuning)} · {model}", fontsize=10)
    handles = [Line2D([], [], color=colors[m], ls=styles[m], lw=1.8, label=m)
               for m in all_methods if m in drawn]
    if not curves[curves["status"] != "ok"].empty:
        handles.append(Line2D([], [], color="0.4", ls=":", marker=".", lw=1.2,
                              label="failed job (partial)"))
    if floor_drawn:
        handles.append(Line2D([], [], color="black", ls="--", lw=1,
                              label="loss floor (entropy rate)"))
    if start_drawn:
        handles.append(Line2D([], [], color="0.45", ls="-.", lw=1,
                              label=f"pre-trained model's loss (step 1 of {BASELINE})"))
    smooth = (f"curves smoothed with a rolling mean over {', '.join(map(str, sorted(windows)))}"
              " steps; " if windows - {1} else "")
    finish(fig, title, f"Line: mean over seeds; band: min-max over seeds; {smooth}inset: "
           "second half of training, zoomed. No dashed line: no known floor for that task. "
           "Pre-training: the run fine-tuning starts from; fine-tuning: every method from its "
           f"weights, the dash-dot line its loss before any update (mean of {BASELINE}'s first "
           "step over seeds). Tuned lr: each method at the learning rate its tuning runs chose "
           "(figure sensitivity), on other seeds.",
           handles, ncol=min(len(handles), 5))
    return fig


def figure_sensitivity(summary: pd.DataFrame) -> plt.Figure:
    """Final loss against learning rate per method, from the tuning grids' runs (mean over
    the tuning seeds): how much each method's result depends on finding its rate."""
    title = "Sensitivity: final training loss against learning rate (tuning runs)"
    table = tuning_table(summary)
    if table.empty:
        return no_data_figure(title, "no tuning runs in the summary (a convergence section with `tuning`)")
    cell = [k for k in CONVERGENCE_CELL if k != "tuning"]
    keys = sorted(set(map(tuple, table[cell].to_numpy().tolist())), key=lambda k: (str(k[2]), str(k[0]), str(k[1])))
    every = method_order(summary["method"])
    colors, styles = method_colors(every), method_linestyles(every)
    fig, axes = _grid(len(keys), 2, 6.4, 4.6)
    drawn, failed_any = set(), False
    for ax, key in zip(axes, keys):
        part = table[np.logical_and.reduce([(table[k] == v).to_numpy() for k, v in zip(cell, key)])]
        ok = part.dropna(subset=["final_loss_mean"])
        top = ok["final_loss_mean"].max() if len(ok) else 1.0
        for method in method_order(part["method"]):
            g = part[part["method"] == method].sort_values("lr")
            good = g.dropna(subset=["final_loss_mean"])
            ax.plot(good["lr"], good["final_loss_mean"], color=colors[method], ls=styles[method], lw=1.5,
                    marker="o", markersize=3.5)
            best = good[good["chosen"]]
            ax.plot(best["lr"], best["final_loss_mean"], ls="", marker="*", markersize=12,
                    color=colors[method], markeredgecolor="black", markeredgewidth=0.6)
            bad = g[g["final_loss_mean"].isna()]
            if len(bad):
                failed_any = True
                ax.plot(bad["lr"], [top] * len(bad), ls="", marker="x", markersize=7, color=colors[method],
                        clip_on=False)
            drawn.add(method)
        floor = summary[(summary["kind"] == "convergence") & (summary["task"] == key[0])]["loss_floor"].dropna()
        if len(floor):
            ax.axhline(floor.mean(), color="black", ls="--", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel("learning rate (log scale)")
        ax.set_ylabel("final training loss (nats/token)")
        ax.set_title(f"{task_label(key[0], key[2])} · {key[1]}", fontsize=10)
    handles = [Line2D([], [], color=colors[m], ls=styles[m], marker="o", markersize=3.5, lw=1.5, label=m)
               for m in every if m in drawn]
    handles.append(Line2D([], [], ls="", marker="*", markersize=11, color="0.5", markeredgecolor="black",
                          label="chosen (its reported runs' rate)"))
    if failed_any:
        handles.append(Line2D([], [], ls="", marker="x", color="0.4", label="a tuning run failed (diverged)"))
    if (summary["loss_floor"].notna() & (summary["kind"] == "convergence")).any():
        handles.append(Line2D([], [], color="black", ls="--", lw=1, label="loss floor (entropy rate)"))
    grids = "; ".join(f"{m} {', '.join(f'{lr:g}' for lr in sorted(g['lr'].unique()))}"
                      for m, g in table.groupby("method", sort=False))
    seeds = sorted(summary[(summary["kind"] == "convergence") & (summary["tuning"] == "grid")]["seed"].unique())
    finish(fig, title, "Each point: a method at one learning rate of its grid, mean final loss (last tenth of "
           f"the steps) over the tuning seeds ({', '.join(str(int(x)) for x in seeds)}); the same number "
           "of rates for every method, log-spaced around its own default (methods that keep AdamW's "
           f"update share its grid). The star is the rate chosen (lowest mean). Rates tried: {grids}.",
           handles, ncol=min(len(handles), 5))
    return fig


def _start_loss(part: pd.DataFrame) -> float | None:
    """A fine-tuning panel's reference: the pre-trained model's loss before any update,
    the mean over seeds of the baseline's first step (its loss is computed before it
    updates; a method such as LoRA starts from the same function, QLoRA from a quantized
    one, so theirs may differ)."""
    first = part[(part["method"] == BASELINE) & (part["step"] == 1) & (part["status"] == "ok")]
    return float(first["loss"].mean()) if len(first) else None


def _zoom_inset(ax, means, tails, floor, colors, styles):
    """Upper-right inset over the second half of training, where methods differ little."""
    tail = pd.concat(tails)
    lo, hi = tail.min(), tail.max()
    if pd.notna(floor):
        lo = min(lo, floor)
    pad = (hi - lo) * 0.08 or abs(hi) * 0.01 or 0.01
    inset = ax.inset_axes([0.47, 0.42, 0.5, 0.44])
    for method, mean in means.items():
        half = mean.iloc[len(mean) // 2:]
        inset.plot(half.index, half, color=colors[method], ls=styles[method], lw=1.3)
    if pd.notna(floor):
        inset.axhline(floor, color="black", ls="--", lw=1)
    inset.set_ylim(lo - pad, hi + pad)
    inset.tick_params(labelsize=7)
    inset.set_title("second half, zoomed (nats/token)", fontsize=7.5)


def figure_overview(summary: pd.DataFrame) -> plt.Figure:
    """Peak-memory ratio vs throughput ratio per (method, model); final-loss gap beside."""
    title = f"Memory saved vs speed cost, relative to {BASELINE}"
    table = overview_table(summary)
    conv = convergence_table(summary)
    if (conv["tuning"] == "tuned").any():  # best vs best: a tuned method beside the tuned baseline only
        conv = conv[conv["tuning"] == "tuned"]
    conv_ok = conv[conv["method"] != BASELINE].dropna(subset=["gap_vs_baseline"]) \
        if len(conv) else conv
    if table.empty and conv.empty:
        return no_data_figure(title, "no memory, throughput or convergence jobs in the summary")
    methods = method_order(summary["method"])
    colors = method_colors(methods)
    models = model_order(summary, table["model"]) if len(table) else []
    markers = {m: MARKERS[i % len(MARKERS)] for i, m in enumerate(models)}
    # the loss-gap panel has one two-line label per (method, task, model): room for each,
    # and the method legend beside the scatter has one line per method
    height = max(5.6, 0.34 * len(conv_ok) + 1.6, 0.2 * len(methods) + 2.6)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, height),
                                  gridspec_kw=dict(width_ratios=[1.5, 1]))
    _overview_scatter(ax, table, colors, markers)
    missing = table[table[["mem_ratio", "thr_ratio"]].isna().any(axis=1) | (table["note"] != "")]
    notes = [f"{r.method} / {r.model}: {r.note or 'incomplete'}" for r in missing.itertuples()]
    _overview_loss_gap(ax2, conv, conv_ok, colors)
    more = f" (+{len(notes) - 6} more)" if len(notes) > 6 else ""
    caption = ("Incomplete comparisons (hollow markers in a grey strip, or not drawn): "
               + "; ".join(notes[:6]) + more) if notes else ""
    finish(fig, title, caption)
    return fig


def _overview_scatter(ax, table: pd.DataFrame, colors, markers) -> None:
    """Memory ratio (x) vs throughput ratio (y). A (method, model) with only one of the two
    is drawn hollow in a grey strip along the axis that lacks it, not dropped."""
    strip = 0.06  # axes fraction of the 'not measured' strips
    xs = np.r_[table["mem_ratio"].dropna().to_numpy(float), 1.0]
    ys = np.r_[table["thr_ratio"].dropna().to_numpy(float), 1.0]
    xpad, ypad = max(np.ptp(xs) * 0.12, 0.05), max(np.ptp(ys) * 0.12, 0.05)
    x0, y0 = max(0.0, xs.min() - xpad), max(0.0, ys.min() - ypad)
    no_thr, no_mem = table["thr_ratio"].isna(), table["mem_ratio"].isna()
    # leave room for the strips so that they cover no measured point
    if no_thr.any():
        y0 -= (ys.max() + ypad - y0) * strip / (1 - strip)
    if no_mem.any():
        x0 -= (xs.max() + xpad - x0) * strip / (1 - strip)
    ax.set_xlim(x0, xs.max() + xpad)
    ax.set_ylim(y0, ys.max() + ypad)
    ax.axvline(1.0, color="black", ls="--", lw=1)
    ax.axhline(1.0, color="black", ls="--", lw=1)
    ax.scatter([1.0], [1.0], s=90, color=colors[BASELINE], marker="*", zorder=3)
    ax.annotate(BASELINE, (1.0, 1.0), xytext=(-5, 6), textcoords="offset points", fontsize=9,
                ha="right")
    # beyond twenty methods colours come back: each measured point also carries its
    # method's number, which the legend spells out
    number = {m: i + 1 for i, m in enumerate(
        m for m in method_order(table["method"]) if m != BASELINE)}
    for r in table.itertuples():
        if pd.isna(r.mem_ratio) and pd.isna(r.thr_ratio):
            continue
        style = dict(s=80, marker=markers[r.model], zorder=3, linewidth=0.8)
        if pd.notna(r.mem_ratio) and pd.notna(r.thr_ratio):
            if pd.notna(r.thr_lo) and pd.notna(r.thr_hi):  # the paired ratio's 95% interval
                ax.errorbar(r.mem_ratio, r.thr_ratio, yerr=[[r.thr_ratio - r.thr_lo],
                                                            [r.thr_hi - r.thr_ratio]],
                            color=colors[r.method], lw=1, capsize=2, zorder=2)
            ax.scatter(r.mem_ratio, r.thr_ratio, color=colors[r.method], edgecolor="black",
                       **style)
            if r.method in number:
                ax.annotate(str(number[r.method]), (r.mem_ratio, r.thr_ratio), xytext=(5, 3),
                            textcoords="offset points", fontsize=7, color="0.15", zorder=4)
        elif pd.notna(r.mem_ratio):
            ax.scatter(r.mem_ratio, strip / 2, transform=ax.get_xaxis_transform(),
                       facecolor="none", edgecolor=colors[r.method], **style)
        else:
            ax.scatter(strip / 2, r.thr_ratio, transform=ax.get_yaxis_transform(),
                       facecolor="none", edgecolor=colors[r.method], **style)
    if no_thr.any():
        ax.add_patch(Rectangle((0, 0), 1, strip, transform=ax.transAxes, color="0.9",
                               zorder=0.5, lw=0))
        ax.text(0.99, strip / 2, "no throughput ratio", transform=ax.transAxes, ha="right",
                va="center", fontsize=8, color="0.35", zorder=1)
    if no_mem.any():
        ax.add_patch(Rectangle((0, 0), strip, 1, transform=ax.transAxes, color="0.9",
                               zorder=0.5, lw=0))
        ax.text(strip / 2, 0.5, "no memory ratio", transform=ax.transAxes, rotation=90,
                ha="center", va="center", fontsize=8, color="0.35", zorder=1)
    ax.set_xlabel(f"peak memory / {BASELINE} (ratio; left = less memory)")
    ax.set_ylabel(f"tokens/s / {BASELINE} (ratio; up = faster)")
    ax.set_title("each marker: one method on one model (geometric mean over batch sizes)",
                 fontsize=9.5)
    ax.text(0.02 + (strip if no_mem.any() else 0), 0.98, "better: up and left",
            transform=ax.transAxes, va="top", fontsize=9, color="0.35")
    shown = table.dropna(subset=["mem_ratio", "thr_ratio"], how="all")
    if shown.empty:
        ax.text(0.5, 0.7, f"No data: no method with a memory or throughput ratio vs "
                f"{BASELINE}", ha="center", va="center", transform=ax.transAxes,
                color=FAIL_COLOR)
        return
    methods = [m for m in method_order(shown["method"])]
    # the wide legend last: tight_layout makes room for an axes' own legend
    leg = ax.legend(handles=[Line2D([], [], ls="", marker=markers[m], color="0.4", label=m)
                             for m in markers if m in set(shown["model"])],
                    title="model (shape)", fontsize=8.5, title_fontsize=8.5, loc="lower left",
                    bbox_to_anchor=(1.01, 0.0))
    ax.add_artist(leg)
    ax.legend(handles=[Line2D([], [], ls="", marker="o", color=colors[m],
                              label=f"{number[m]} {m}" if m in number else m)
                       for m in methods], title="method (colour, number)", fontsize=8.5,
              title_fontsize=8.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _overview_loss_gap(ax, conv: pd.DataFrame, conv_ok: pd.DataFrame, colors) -> None:
    tuned = (conv["tuning"] == "tuned").any() if len(conv) else False
    ax.set_title(f"final training loss minus {BASELINE}'s (mean over seeds)"
                 + ("\neach at its best learning rate (tuned alike)" if tuned else ""), fontsize=9.5)
    ax.set_xlabel(f"final loss - {BASELINE}'s (nats/token; left = lower loss)\n"
                  "error bars: 95% interval of the gap, paired by seed", fontsize=9.5)
    if conv_ok.empty:
        ax.text(0.5, 0.5, "No data: no converged method\nwith a converged "
                f"{BASELINE} to compare", ha="center", va="center", transform=ax.transAxes,
                color=FAIL_COLOR)
        ax.set_xticks([])
        ax.set_yticks([])
    else:
        rows = conv_ok.assign(label=[f"{r.method}\n{task_label(r.task, r.phase, r.tuning)} · {r.model}"
                                     for r in conv_ok.itertuples()])
        rows = rows.assign(_o=rows["method"].map(method_order(rows["method"]).index))
        rows = rows.sort_values(["_o", "task", "model"]).reset_index(drop=True)
        ys = np.arange(len(rows))
        gap = rows["gap_vs_baseline"]
        lo, hi = (gap - rows["gap_lo"]).fillna(0).clip(lower=0), (rows["gap_hi"] - gap).fillna(0).clip(lower=0)
        ax.barh(ys, gap, color=[colors[m] for m in rows["method"]],
                height=0.6, xerr=[lo, hi], capsize=3, error_kw=dict(lw=1))
        ax.set_yticks(ys, rows["label"], fontsize=8.5)
        ax.invert_yaxis()
        ax.axvline(0.0, color="black", ls="--", lw=1)
        span = np.nanmax(np.abs(np.r_[gap + hi, gap - lo]))
        span = span if np.isfinite(span) and span > 0 else 1.0
        ax.set_xlim(-span * 1.45, span * 1.45)
        for y, g, left, right in zip(ys, gap, lo, hi):
            ax.annotate(f"{g:+.4f}", (g + right if g >= 0 else g - left, y),
                        xytext=(4 if g >= 0 else -4, 0), textcoords="offset points",
                        ha="left" if g >= 0 else "right", va="center", fontsize=8.5)
        ax.grid(axis="y", visible=False)
    floors = []
    base = conv[conv["method"] == BASELINE] if len(conv) else conv
    for r in base.itertuples():
        where = f"{task_label(r.task, r.phase, r.tuning)} · {r.model}"
        if r.n_ok == 0:
            floors.append(f"{where}: {BASELINE} {r.status}")
        elif pd.notna(r.loss_floor):
            floors.append(f"{where}: {BASELINE} {r.final_loss_mean:.3f}, floor "
                          f"{r.loss_floor:.3f} (+{r.gap_to_floor:.3f})")
        else:
            floors.append(f"{where}: {BASELINE} {r.final_loss_mean:.3f}, no known floor")
    failed = conv[(conv["n_ok"] == 0) & (conv["method"] != BASELINE)] if len(conv) else conv
    if len(failed):
        floors.append("no final loss: " + ", ".join(
            f"{r.method} ({task_label(r.task, r.phase, r.tuning)}, {r.status})" for r in failed.itertuples()))
    if floors:
        ax.annotate("\n".join(textwrap.fill(f, 70) for f in floors), (0.0, 0.0),
                    xycoords="axes fraction", xytext=(0, -52), textcoords="offset points",
                    va="top", ha="left", fontsize=8, color="0.3")


def _memory_axis(ax, sizes) -> None:
    sizes = sorted({float(g) for g in sizes})
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [f"{g:g}" for g in sizes])
    ax.minorticks_off()
    ax.set_xlabel("memory size (GiB)")


def _capacity_lines(ax, part: pd.DataFrame, x: str, y: str, methods, colors, floor: float,
                    open_marker: pd.Series | None = None) -> None:
    """One line per method; a point where nothing fits sits on the floor as an x. Methods
    are nudged apart along x (by a few percent, on a log axis) so equal answers stay visible."""
    for i, method in enumerate(methods):
        rows = part[part["method"] == method].sort_values(x)
        if rows.empty:
            continue
        rows = rows.assign(**{x: rows[x] * nudge(i, len(methods))})
        values = rows[y].astype(float).where(rows[y] > 0, floor)
        ax.plot(rows[x], values, color=colors[method], marker=MARKERS[i % len(MARKERS)],
                linestyle=LINESTYLES[i % len(LINESTYLES)], linewidth=1.4, markersize=5,
                label=method)
        none = rows[rows[y] <= 0]
        ax.scatter(none[x], [floor] * len(none), marker="x", color=FAIL_COLOR, zorder=5, s=30)
        if open_marker is not None:
            capped = rows[open_marker.reindex(rows.index).fillna(False).astype(bool)]
            ax.scatter(capped[x], capped[y], marker="^", s=70, facecolors="none",
                       edgecolors=colors[method], zorder=5)


def figure_capacity(summary: pd.DataFrame) -> plt.Figure:
    """Largest batch that fits vs GPU memory, one panel per model, a line per method."""
    title = "Largest batch that fits, per memory size"
    table = capacity_table(summary)
    if table.empty:
        return no_data_figure(title, "no capacity jobs in the summary")
    table, failed = _ok_and_failed(table)
    if table.empty:
        return no_data_figure(title, "no capacity job finished ok")
    methods = method_order(table["method"])
    models = model_order(summary, table["model"])
    colors = method_colors(methods)
    cells = (table.assign(_m=table["model"].map(models.index))
             .sort_values(["_m", "seq_len"])[["model", "seq_len", "dtype", "memory_tier"]]
             .drop_duplicates().to_dict("records"))
    fig, axes = _grid(len(cells), 4, 4.2, 3.4)
    for ax, cell in zip(axes, cells):
        part = table[_key_match(table, cell, list(cell))]
        _capacity_lines(ax, part, "capacity_gb", "largest_batch", methods, colors, 0.5,
                        part["at_max_batch"])
        ax.set_yscale("log", base=2)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
            lambda v, _: "none" if v < 1 else f"{v:g}"))
        _memory_axis(ax, part["capacity_gb"])
        ax.set_ylabel("largest batch (sequences)")
        ax.set_title(f"{cell['model']} · seq {_fmt_num(cell['seq_len'])} · {cell['dtype']}",
                     fontsize=10)
    _finish_capacity(fig, title, table,
                     "Each point is a search's answer: that batch fits and the next one (one "
                     "more micro-batch) does not, each answered by its step (run, or simulated from steps "
                     "run, byte for byte: shallow copies, the batch line). x on the floor: not even one "
                     "micro-batch fits. Open triangle: the search's largest batch fitted, so the "
                     "answer is at least that." + (
                         " Simulated tier: what a CUDA GPU needs is predicted by replaying the "
                         "step's allocations through a model of PyTorch's caching allocator, "
                         "plus 0.5 GiB of CUDA context (an assumption, not yet measured on a GPU)."
                         if (table["memory_tier"] == "simulated").any() else ""),
                     methods, colors, failed, "on")
    return fig


def _ok_and_failed(table: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The searches that finished ok, and (method, model, status) of those that did not."""
    failed = table[table["status"] != "ok"][["method", "model", "status"]].drop_duplicates()
    return table[table["status"] == "ok"], failed


def _finish_capacity(fig, title: str, table: pd.DataFrame, note: str, methods, colors,
                     failed: pd.DataFrame, where: str) -> None:
    """A capacity figure's title (with the memory tiers of `table`, its drawn rows), a
    legend line per method and the note, which lists the searches that failed (`failed`:
    method, model, status)."""
    handles = [Line2D([], [], color=colors[m], marker=MARKERS[i % len(MARKERS)],
                      linestyle=LINESTYLES[i % len(LINESTYLES)], label=m)
               for i, m in enumerate(methods)]
    if not failed.empty:
        note += " Not drawn (search failed): " + "; ".join(
            f"{r.method} {where} {r.model} ({r.status})" for r in failed.itertuples()) + "."
    finish(fig, f"{title} (memory tier: {_tiers_text(table)})", note, handles,
           ncol=min(len(methods), 5), title="method")


def figure_model_capacity(summary: pd.DataFrame) -> plt.Figure:
    """Largest model of each family that trains at a batch vs GPU memory (AdamA's figure)."""
    title = "Largest model that trains, per memory size"
    table = largest_model_table(summary)
    if table.empty:
        return no_data_figure(title, "no model_capacity jobs in the summary")
    table, failed = _ok_and_failed(table)
    if table.empty:
        return no_data_figure(title, "no model_capacity job finished ok")
    methods = method_order(table["method"])
    colors = method_colors(methods)
    cells = (table[["family", "seq_len", "dtype", "precision", "memory_tier", "batch_size"]]
             .drop_duplicates().sort_values(["family", "batch_size"]).to_dict("records"))
    fig, axes = _grid(len(cells), 3, 5.0, 4.0)
    for ax, cell in zip(axes, cells):
        part = table[_key_match(table, cell, list(cell))]
        fitted = part.loc[part["n_params"] > 0, "n_params"]
        floor = 0.5 * fitted.min() if len(fitted) else 1e6
        _capacity_lines(ax, part, "capacity_gb", "n_params", methods, colors, floor,
                        part["at_ladder_top"])
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: parameters_text(v)))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        _memory_axis(ax, part["capacity_gb"])
        ax.set_ylabel("largest model that trains (parameters)")
        ax.set_title(f"{cell['family']} from {part['model'].iloc[0]} · batch "
                     f"{_fmt_num(cell['batch_size'])} · seq {_fmt_num(cell['seq_len'])} · "
                     f"{dtype_text(cell['dtype'], cell['precision'])}", fontsize=10)
    _finish_capacity(fig, title, table,
                     "Each point is a search's answer along the family's ladder of sizes (its "
                     "published sizes, and sizes between them with width and depth grown "
                     "together, about 1.25x the layer weights per step): that size trains at the "
                     "batch and the next does not, each answered by its step (run, or simulated from "
                     "shallow copies, byte for byte), or its weights alone exceed the memory. x on "
                     "the floor: not even the first size fits. Open triangle: the "
                     "ladder's largest size fits, so at least it.", methods, colors, failed, "from")
    return fig


# a scheme's line in figure_model_capacity_gpus: its style and marker (the one-GPU point,
# which every scheme's line of a method starts from, is a filled circle; "^" is kept for
# the ladder's top)
SCHEME_STYLE = {"fsdp": ("-", "s"), "zero3": ("--", "D"), "zero2": ("-.", "v"), "zero1": (":", "P"),
                "none": (":", "X")}
ONE_GPU_MARKER = "o"


def _gpus_nudge(i: int, n: int) -> float:
    """Line i of n moved along the GPU-count axis (its ticks are octaves apart), within
    +-25% of the count, so that equal answers stay apart."""
    step = min(1.12, 1.5 ** (1 / max(n - 1, 1)))
    return step ** (i - (n - 1) / 2)


def _scheme_style(sharding: str) -> tuple[str, str]:
    return SCHEME_STYLE.get(sharding, ("-.", "*"))


def figure_model_capacity_gpus(summary: pd.DataFrame) -> plt.Figure:
    """Largest model that trains per GPU of N vs N (the GPU count), one panel per memory
    size (a row of panels per family, batch, sequence and dtype), a line per method and
    scheme starting from the method's one-GPU answer."""
    title = "Largest model that trains on each of N GPUs, per memory size"
    table = largest_model_gpus_table(summary)
    if table.empty:
        return no_data_figure(title, "no model_capacity rows of more than one GPU (world_size > 1 or a "
                                     "sharding scheme) in the summary: the gpu-capacity suite's "
                                     "sharded_model_capacity section makes them")
    failed = table[table["status"] != "ok"][["label", "model", "batch_size", "status"]].drop_duplicates()
    table = table[table["status"] == "ok"]
    if table.empty:
        return no_data_figure(title, "no model_capacity search of more than one GPU finished ok")
    methods = method_order(table["method"])
    colors = method_colors(methods)
    schemes = [s for s in SCHEMES if s in set(table["sharding"])] + sorted(
        set(table["sharding"]) - set(SCHEMES))
    schemes = [s for s in schemes if ((table["sharding"] == s) & ~((table["world_size"] == 1)
                                                                   & (table["sharding"] == "none"))).any()]
    cells = table[GPUS_CELL].drop_duplicates().sort_values(GPUS_CELL).to_dict("records")
    sizes = sorted(table["capacity_gb"].unique())
    counts = sorted(table["world_size"].astype(int).unique())
    fig, axes = plt.subplots(len(cells), len(sizes), figsize=(3.7 * len(sizes), 4.0 * len(cells)),
                             squeeze=False, sharey="row")
    lines = [(m, s) for m in methods for s in schemes]
    any_top = any_none = False
    for row_axes, cell in zip(axes, cells):
        part = table[_key_match(table, cell, GPUS_CELL)]
        fitted = part.loc[part["n_params"] > 0, "n_params"]
        floor = 0.5 * fitted.min() if len(fitted) else 1e6
        for j, (ax, gb) in enumerate(zip(row_axes, sizes)):
            here = part[part["capacity_gb"] == gb]
            tops = []
            for i, (method, sharding) in enumerate(lines):
                mine = here[here["method"] == method]
                own = mine[(mine["sharding"] == sharding)
                           & ~((mine["world_size"] == 1) & (mine["sharding"] == "none"))]
                if own.empty:
                    continue
                one = mine[(mine["world_size"] == 1) & (mine["sharding"] == "none")]
                pts = pd.concat([one if not (own["world_size"] == 1).any() else one.iloc[0:0], own])
                pts = pts.sort_values("world_size")
                # lines of one method share its one-GPU point; equal answers elsewhere are
                # nudged apart along x (a few percent, on the log axis)
                mine_lines = [k for k, (m, _) in enumerate(lines) if m == method]
                shared = np.exp(np.mean([np.log(_gpus_nudge(k, len(lines))) for k in mine_lines]))
                x = pts["world_size"].to_numpy(float) * np.where(
                    (pts["world_size"] == 1) & (pts["sharding"] == "none"), shared, _gpus_nudge(i, len(lines)))
                y = pts["n_params"].astype(float).where(pts["n_params"] > 0, floor).to_numpy()
                style, marker = _scheme_style(sharding)
                ax.plot(x, y, color=colors[method], linestyle=style, linewidth=1.4, zorder=3)
                single = ((pts["world_size"] == 1) & (pts["sharding"] == "none")).to_numpy()
                fits = (pts["n_params"] > 0).to_numpy()
                top = (pts["at_ladder_top"] == 1).to_numpy() & fits
                plain = fits & ~top
                ax.scatter(x[~single & plain], y[~single & plain], marker=marker, color=colors[method], s=28,
                           zorder=4)
                ax.scatter(x[single & plain], y[single & plain], marker=ONE_GPU_MARKER, color=colors[method],
                           s=34, zorder=4)
                ax.scatter(x[~fits], y[~fits], marker="x", color=FAIL_COLOR, s=30, zorder=5)
                any_none |= bool((~fits).any())
                # the ladder's top fitted: an open triangle instead of the point's marker
                ax.scatter(x[top], y[top], marker="^", s=60, facecolors="white", edgecolors=colors[method],
                           linewidths=1.3, zorder=5)
                tops += list(zip(x[top], y[top]))
                any_top |= bool(top.any())
            if tops:
                tx, ty = max(tops, key=lambda p: (p[1], p[0]))
                ax.annotate("ladder's top", (tx, ty), xytext=(0, 8), textcoords="offset points",
                            ha="right" if tx > counts[-1] / 2 else "center", va="bottom", fontsize=7.5, color="0.35")
            if (here["n_params"] <= 0).any():
                ax.axhline(floor, color=FAIL_COLOR, lw=0.6, ls=":", zorder=1)
                ax.annotate("none fits", (0.98, floor), xycoords=("axes fraction", "data"), xytext=(0, -6),
                            textcoords="offset points", ha="right", va="top", fontsize=7.5, color=FAIL_COLOR)
            ax.set_xscale("log", base=2)
            ax.set_xticks(counts, [str(c) for c in counts])
            ax.set_xlim(counts[0] / 1.6, counts[-1] * 1.6)
            ax.minorticks_off()
            ax.set_xlabel("GPU count (data-parallel ranks)")
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            # no parameter count at or below the floor, where a point means "none fits"
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
                lambda v, _, floor=floor: "" if v <= floor * 1.01 else parameters_text(v)))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            if j == 0:
                ax.set_ylabel("largest model that trains\n(parameters)")
            ax.set_title(f"{gb:g} GiB per GPU" + ("" if len(cells) == 1 else
                         f"\n{cell['family']} · batch {_fmt_num(cell['batch_size'])} per GPU · seq "
                         f"{_fmt_num(cell['seq_len'])} · {cell['dtype']}"), fontsize=10 if len(cells) == 1 else 9)
        lo, hi = row_axes[0].get_ylim()
        row_axes[0].set_ylim(min(lo, floor / 2.2), hi * 1.6)   # room for the floor's label and the triangles
    single = (table["world_size"] == 1) & (table["sharding"] == "none")
    by_scheme = {scheme_name(s): ", ".join(sorted(set(table.loc[(table["sharding"] == s) & ~single,
                                                                "memory_tier"].dropna()))) for s in schemes}
    if single.any():
        by_scheme["one GPU"] = ", ".join(sorted(set(table.loc[single, "memory_tier"].dropna())))
    tiers = (next(iter(by_scheme.values())) if len(set(by_scheme.values())) == 1
             else "; ".join(f"{k} {v}" for k, v in by_scheme.items()))
    heading = f"{title} (memory tier: {tiers})"
    if len(cells) == 1:
        c = cells[0]
        heading = (f"{title}\n{c['family']}, batch {_fmt_num(c['batch_size'])} per GPU, seq "
                   f"{_fmt_num(c['seq_len'])}, {c['dtype']} (memory tier: {tiers})")
    # a legend column per method (its schemes' lines), then the markers' columns
    drawn = set(zip(table.loc[~single, "method"], table.loc[~single, "sharding"]))
    handles = [Line2D([], [], color=colors[m], linestyle=_scheme_style(s)[0], marker=_scheme_style(s)[1],
                      markersize=5, label=f"{m}, {scheme_name(s)}") for m, s in lines if (m, s) in drawn]
    handles.append(Line2D([], [], ls="", marker=ONE_GPU_MARKER, color="0.3", label="one GPU (each line's start)"))
    if any_top:
        handles.append(Line2D([], [], ls="", marker="^", markerfacecolor="none", markeredgecolor="0.3",
                              markersize=8, label="the ladder's top: at least this"))
    if any_none:
        handles.append(Line2D([], [], ls="", marker="x", color=FAIL_COLOR, label="none fits"))
    starts = []
    for model, g in sorted(table.groupby("model"), key=lambda mg: (mg[1]["world_size"].min(), mg[0])):
        counts_of = sorted(int(w) for w in g["world_size"].unique())
        starts.append(f"{model} ({', '.join(map(str, counts_of))} GPU{'' if counts_of == [1] else 's'})")
    starts = ", ".join(starts)
    note = ("Each point is a search's answer along the family's ladder of sizes: that size trains at the batch "
            "on each GPU (rank 0's memory under FSDP2; under ZeRO the largest rank's) and the next does not "
            "(or a rank's share of its weights alone exceeds the memory). Lines of one colour are one method "
            "under each scheme, from the same one-GPU point. Each GPU holds a batch of its own. Searches start "
            f"at {starts}: 'none fits' is not even that size. Memory only: no communication time is counted.")
    if not failed.empty:
        note += " Not drawn (search failed): " + "; ".join(
            f"{r.label} from {r.model} at batch {_fmt_num(r.batch_size)} ({r.status})"
            for r in failed.itertuples()) + "."
    finish(fig, heading, note, handles, ncol=int(np.ceil(len(handles) / max(len(schemes), 1))),
           title="method (colour), scheme (line, marker)")
    return fig


def builders(summary: pd.DataFrame, curves: pd.DataFrame) -> dict:
    """Figure name -> a function drawing it, in the order of `FIGURES`."""
    table = {
        "overview": lambda: figure_overview(summary),
        "memory_breakdown": lambda: figure_memory_breakdown(summary),
        "throughput_relative": lambda: figure_throughput_relative(summary),
        "convergence": lambda: figure_convergence(summary, curves),
        "sensitivity": lambda: figure_sensitivity(summary),
        "capacity": lambda: figure_capacity(summary),
        "model_capacity": lambda: figure_model_capacity(summary),
        "model_capacity_gpus": lambda: figure_model_capacity_gpus(summary),
        "throughput_capacity": lambda: fig_throughput_capacity.figure(summary),
    }
    assert list(table) == FIGURES
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="membench figures",
        description="Draw the membench figures from the aggregated tables. Every figure ("
                    + ", ".join(FIGURES) + ") is written as <name>.png and <name>.pdf, even "
                    "when its kind has no rows (the figure then says so).",
        epilog="figures: " + ", ".join(FIGURES) + "; what each shows: bench/report/captions/<name>.rst "
               "(the captions of both reports).")
    p.add_argument("--summary", required=True, help="summary.csv from bench.report.aggregate")
    p.add_argument("--curves", help="curves.csv from bench.report.aggregate (optional; without it "
                                    "the convergence figure lists jobs but draws no curves)")
    p.add_argument("--out", required=True, help="folder for the figures (created if needed)")
    args = p.parse_args(argv)
    summary, curves = read_summary(args.summary), read_curves(args.curves)
    sns.set_theme(style="whitegrid", context="notebook", font_scale=0.9)
    for name, build in builders(summary, curves).items():
        save(build(), args.out, name)
    print(f"plots: {len(FIGURES)} figures (png + pdf) in {args.out}", file=sys.stderr)
    return 0


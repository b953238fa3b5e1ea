"""The results report: paper/results.md, generated from summary.csv only.

    membench report --summary results/summary.csv --out paper/results.md

Provenance first, then the figures (linked relative to the report), then one table per
kind of measurement and the list of failed jobs. The numbers come from the same table
functions as the figures (`bench.report.tables`), so the two never disagree. The file is written
atomically (temporary file, then `os.replace`).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pandas as pd
import yaml

from bench.report.figures import FIGURES
from bench.measure.records import write_text_atomic
from bench.report.tables import (BASELINE, CATEGORIES, MODEL_CAPACITY_CELL, capacity_table, claim_table, dtype_text,
                          convergence_table, largest_model_gpus_finding, largest_model_gpus_text,
                          largest_model_table, memory_table, method_order, tuning_table,
                          model_order, parameters_text, read_summary, simulation_accuracy_table,
                          task_label, throughput_table)
from bench.tuning import RULE, TARGET_GAP, WINDOW

CAPTIONS = Path(__file__).resolve().parent / "captions"


def caption(name: str) -> str:
    """A figure's caption: bench/report/captions/<name>.rst, shared with the HTML report."""
    path = CAPTIONS / f"{name}.rst"
    return path.read_text().strip() if path.exists() else name


# ----------------------------------------------------------------------------- markdown


def cell(value) -> str:
    """One table cell: missing -> '–', pipes escaped, line breaks flattened."""
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return "–"
    text = str(value).replace("\r", " ").replace("\n", " ").replace("|", "\\|")
    return text.strip() or "–"


def markdown_table(rows: list[list], header: list[str], align: str | None = None) -> str:
    """A GitHub-flavoured Markdown table; `align` is one letter per column (l, r, c)."""
    align = align or "l" * len(header)
    rule = {"l": ":--", "r": "--:", "c": ":-:"}
    lines = ["| " + " | ".join(cell(h) for h in header) + " |",
             "| " + " | ".join(rule[a] for a in align) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def num(value, fmt: str = ".1f") -> str | None:
    return None if value is None or pd.isna(value) else format(value, fmt)


def pct(value) -> str | None:
    """A relative change in percent, signed: '-82.4%'."""
    return None if value is None or pd.isna(value) else f"{value:+.1f}%"


def integer(value) -> str | None:
    return None if value is None or pd.isna(value) else str(int(value))


def _ordered(table: pd.DataFrame, summary: pd.DataFrame, first: list[str]) -> pd.DataFrame:
    """Sort by `first` (models by family and size), then the method order."""
    if table.empty:
        return table
    models = model_order(summary, table["model"])
    methods = method_order(table["method"])
    keyed = table.assign(_model=table["model"].map(models.index),
                         _method=table["method"].map(methods.index))
    by = [("_model" if c == "model" else c) for c in first] + ["_method"]
    return keyed.sort_values(by, kind="stable").drop(columns=["_model", "_method"])


# ----------------------------------------------------------------------------- sections


def provenance(summary: pd.DataFrame, source: str) -> str:
    def values(col):
        found = sorted({str(v) for v in summary[col].dropna() if str(v).strip()})
        return ", ".join(f"`{v}`" for v in found) or "unknown"

    dates = pd.to_datetime(summary["date"], utc=True, errors="coerce", format="ISO8601").dropna()
    span = (f"{dates.min():%Y-%m-%d %H:%M} to {dates.max():%Y-%m-%d %H:%M} UTC"
            if len(dates) else "unknown")
    not_ok = summary[summary["status"] != "ok"]
    by_status = ", ".join(f"{n} {s}" for s, n in not_ok["status"].value_counts().items())
    by_kind = ", ".join(f"{n} {k}" for k, n in summary["kind"].value_counts().sort_index().items())
    devices = sorted({f"{d} ({n})" if isinstance(n, str) and n else str(d)
                      for d, n in zip(summary["device"], summary["device_name"])})
    return "\n".join([
        f"- source: `{source}`",
        f"- commit(s): {values('commit')}",
        f"- torch version(s): {values('torch_version')}",
        f"- device(s): {', '.join(devices) or 'unknown'}",
        *([f"- CPU(s): {values('cpu_id')}"] if "cpu_id" in summary else []),
        f"- memory tier(s): {values('memory_tier')}",
        f"- dates: {span}",
        f"- jobs: {len(summary)}" + (f" ({by_kind})" if by_kind else ""),
        f"- not ok: {len(not_ok)}" + (f" ({by_status})" if by_status else ""),
    ])


def figures_section(out: Path, figures: Path) -> str:
    rel = Path(os.path.relpath(figures.resolve(), out.resolve().parent)).as_posix()
    return "\n\n".join(f"![{name}]({rel}/{name}.png)\n\n"
                       f"*{caption(name)}* ([PDF]({rel}/{name}.pdf))"
                       for name in FIGURES)


MEMORY_HEADER = ["model", "batch", "seq", "device", "method", "micro-batches", "status",
                 "peak MiB", f"change vs {BASELINE}"] + [f"{c} MiB" for c in CATEGORIES]


def memory_section(summary: pd.DataFrame) -> str:
    table = _ordered(memory_table(summary), summary, ["model", "batch_size", "seq_len", "device"])
    if table.empty:
        return "_No memory jobs._"
    rows = []
    for _, r in table.iterrows():
        change = "baseline" if r["method"] == BASELINE else pct(r["pct_vs_baseline"])
        rows.append([r["model"], integer(r["batch_size"]), integer(r["seq_len"]), r["device"],
                     r["label"], integer(r["micro_batches"]), r["status"], num(r["peak_mib"]),
                     change] + [num(r[f"{c}_mib"]) for c in CATEGORIES])
    tiers = ", ".join(sorted(set(summary.loc[summary["kind"] == "memory", "memory_tier"]
                                 .dropna()))) or "unknown"
    return (f"Peak bytes of one training step, split by category (memory tier: {tiers}); "
            f"1 MiB = 2^20 bytes. Change vs {BASELINE} = (peak - peak of {BASELINE}) / peak "
            f"of {BASELINE}, with the same model, batch, sequence length and device.\n\n"
            + markdown_table(rows, MEMORY_HEADER, "lrrllrlrr" + "r" * len(CATEGORIES)))


THROUGHPUT_HEADER = ["model", "batch", "seq", "device", "method", "status", "tokens/s",
                     "baseline", "ratio (95% CI)", "step time median (ms)"]


def throughput_section(summary: pd.DataFrame) -> str:
    table = _ordered(throughput_table(summary), summary,
                     ["model", "batch_size", "seq_len", "device"])
    if table.empty:
        return "_No throughput jobs._"
    rows = []
    for _, r in table.iterrows():
        ratio = (f"{r['ratio']:.3f} ({r['ratio_lo']:.3f}–{r['ratio_hi']:.3f})"
                 if r["has_baseline"] else "no paired ratio")
        rows.append([r["model"], integer(r["batch_size"]), integer(r["seq_len"]), r["device"],
                     r["method"], r["status"], num(r["tokens_per_s"], ",.0f"), r["baseline"],
                     ratio, num(r["step_median_s"] * 1e3)])
    return ("Ratio = tokens/s of the method / tokens/s of its baseline, both timed in the same "
            "process, in interleaved rounds on the same batches (above 1: faster), with its 95% interval "
            "for running the job again (docs/speed.md). Measured on the device named in the "
            "row; compare ratios, not tokens/s, across machines.\n\n"
            + markdown_table(rows, THROUGHPUT_HEADER, "lrrllllrrr"))


CONVERGENCE_HEADER = ["task", "model", "method", "lr", "seeds ok", "status",
                      "final loss (mean ± std)", "loss floor", "gap to floor",
                      f"gap to {BASELINE} (95% interval)", "steps to target"]


def convergence_section(summary: pd.DataFrame) -> str:
    table = _ordered(convergence_table(summary), summary, ["phase", "tuning", "task", "model"])
    if table.empty:
        return "_No convergence jobs._"
    rows = []
    for _, r in table.iterrows():
        loss = num(r["final_loss_mean"], ".4f")
        if loss is not None and pd.notna(r["final_loss_std"]):
            loss += f" ± {r['final_loss_std']:.4f}"
        floor = num(r["loss_floor"], ".4f") or "none known"
        gap = "baseline" if r["method"] == BASELINE else num(r["gap_vs_baseline"], "+.4f")
        if gap and r["method"] != BASELINE and pd.notna(r["gap_lo"]):
            gap += f" ({r['gap_lo']:+.3f} to {r['gap_hi']:+.3f})"
        reached = ("" if pd.isna(r["target_loss"]) else "none reached" if r["n_reached"] == 0 else
                   f"{r['steps_to_target']:.0f}" + ("" if r["n_reached"] == r["n_ok"] else
                                                    f" ({int(r['n_reached'])}/{int(r['n_ok'])} reached)"))
        rows.append([task_label(r["task"], r["phase"], r["tuning"]), r["model"], r["method"], num(r["lr"], "g"),
                     f"{r['n_ok']}/{r['n_jobs']}", r["status"], loss, floor, num(r["gap_to_floor"], "+.4f"),
                     gap, reached])
    return ("Final training loss in nats/token (the mean of a run's last tenth of steps) over the "
            "seeds that finished (± sample standard deviation over seeds). The loss floor is the "
            "task's entropy rate where it is known; gap to floor = mean final loss - floor; gap to "
            f"{BASELINE} = mean final loss - {BASELINE}'s in the same cell, with its 95% interval "
            "paired by seed. Tuned lr: each method ran at the learning rate its tuning runs chose "
            f"(next table), {BASELINE} included, so a gap compares best with best; elsewhere every "
            "method ran at its default rate. Steps to target: the first step where the running "
            f"mean loss over {WINDOW} steps is within {TARGET_GAP} nats of the floor (mean over "
            "the seeds that got there).\n\n"
            + markdown_table(rows, CONVERGENCE_HEADER, "lllrrlrrrrr") + tuning_section(summary))


TUNING_HEADER = ["task", "model", "method", "learning rates tried: mean final loss (tuning seeds)", "chosen"]


def tuning_section(summary: pd.DataFrame) -> str:
    """The tuning grids behind the tuned rows: each rate's mean final loss, the chosen one."""
    table = tuning_table(summary)
    if table.empty:
        return ""
    rows = []
    for (task, model, phase, method), g in table.groupby(["task", "model", "phase", "method"], sort=False):
        tried = ", ".join(f"{r.lr:g}: " + (f"{r.final_loss_mean:.3f}" if pd.notna(r.final_loss_mean) else r.status)
                          for r in g.sort_values("lr").itertuples())
        best = g[g["chosen"]]
        edge = len(g) > 2 and len(best) and best["lr"].iloc[0] in (g["lr"].min(), g["lr"].max())
        rows.append([task_label(task, phase), model, method, tried,
                     (f"{best['lr'].iloc[0]:g}" + (" (the grid's edge)" if edge else "")) if len(best)
                     else "none (every rate failed)"])
    return ("\n\n**Tuning.** Every method, the baseline included, ran the same number of learning "
            "rates, log-spaced around its own default, on tuning seeds of their own; the rate with the "
            f"lowest mean final loss (none of its runs failed) is chosen ({RULE}). A rate chosen at the "
            "grid's edge says the best may lie beyond it: a wider grid is the next run.\n\n"
            + markdown_table(rows, TUNING_HEADER, "lllll"))


def capacity_section(summary: pd.DataFrame) -> str:
    models, gpus, batches = (largest_model_section(summary), largest_model_gpus_section(summary),
                             largest_batch_section(summary))
    if models is None and gpus is None and batches is None:
        return "_No capacity jobs._"
    return ("Each answer is a search's boundary: that size (or batch) trains and the next "
            "does not, each answered by its step (run, or in the simulated tier derived byte for byte "
            "from steps run: shallow copies, the batch line). In the simulated tier a run fits when its allocations, "
            "replayed through a model of PyTorch's CUDA caching allocator, stay within the "
            "memory size minus 0.5 GiB of CUDA context (an assumption until calibrated on a "
            "GPU).\n\n" + "\n\n".join(p for p in (models, gpus, batches) if p is not None))


def largest_model_gpus_section(summary: pd.DataFrame) -> str | None:
    """The largest model per GPU of several (the `model_capacity_gpus` figure's numbers):
    a finding, then per method, scheme and GPU count the answer per memory size. None
    without model_capacity rows of more than one GPU."""
    table = largest_model_gpus_text(summary)
    if table.empty:
        return None
    sizes = [c for c in table.columns if c.endswith(" GiB")]
    rows = [[r["family"], integer(r["batch_size"]), integer(r["seq_len"]),
             dtype_text(r["dtype"], r["precision"]), r["method"], r["scheme"],
             integer(r["world_size"]), r["memory_tier"], r["model"]] + [r[c] for c in sizes]
            for _, r in table.iterrows()]
    return ("### Largest model on several GPUs\n\nThe same search per GPU of N data-parallel GPUs, each "
            "training its own batch (under FSDP2 rank 0's memory, which holds the most; under ZeRO the "
            "largest rank's; docs/sharding.md), from the size in 'ladder from'. Memory only: "
            "communication time is not counted. "
            "Parameters of the largest size that trains; '>=': the ladder's largest size fits.\n\n"
            f"**Finding.** {largest_model_gpus_finding(summary)}\n\n"
            + markdown_table(rows, ["family", "batch per GPU", "seq", "dtype", "method", "scheme", "GPUs", "tier",
                                    "ladder from"] + sizes, "lrrlllrll" + "r" * len(sizes)))


def largest_model_section(summary: pd.DataFrame) -> str | None:
    """Headline and table: the largest model of each family per memory size and method."""
    table = largest_model_table(summary)
    if table.empty:
        return None
    lines, rows = [], []
    cell = [c for c in MODEL_CAPACITY_CELL if c != "capacity_gb"]
    sizes = sorted(table["capacity_gb"].unique())
    for key, g in table.groupby(cell, dropna=False, sort=True):
        family, seq, dtype, precision, tier, batch = key
        dtype = dtype_text(dtype, precision)
        for gb, h in g.groupby("capacity_gb", sort=True):
            lines.append(f"- {gb:g} GiB, {family} at batch {integer(batch)} (seq {integer(seq)}, "
                         f"{dtype}, {tier}): {_largest_model_headline(h)}")
        for method in method_order(g["method"]):
            mine = g[g["method"] == method].set_index("capacity_gb")
            rows.append([family, integer(batch), integer(seq), dtype, tier, method]
                        + [_largest_model_text(mine.loc[gb]) if gb in mine.index else None
                           for gb in sizes])
    return ("### Largest model\n\nThe largest size of each family that trains at the batch, "
            "per memory size, searched along the family's ladder (its published sizes and "
            "sizes between them with width and depth grown together; shape names read "
            "<family>-d<width>-l<layers>[-v<vocab>]), with its parameters. '>=': the ladder's "
            "largest size fits. Headline: the method that trains the largest.\n\n"
            + "\n".join(lines) + "\n\n"
            + markdown_table(rows, ["family", "batch", "seq", "dtype", "tier", "method"]
                             + [f"{gb:g} GiB" for gb in sizes], "lrrlll" + "r" * len(sizes)))


def _largest_model_text(r: pd.Series) -> str:
    if r["status"] != "ok":
        return r["status"]
    if not r["n_params"]:
        return "none"
    return (">= " if r["at_ladder_top"] == 1 else "") + f"{r['largest_model']} ({parameters_text(r['n_params'])})"


def _largest_model_headline(g: pd.DataFrame) -> str:
    ok = g[g["n_params"] > 0]
    if ok.empty:
        return f"no method trains even {g['model'].iloc[0]}."
    top = ok[ok["n_params"] == ok["n_params"].max()]
    best = top.iloc[0]
    base = g[(g["method"] == BASELINE) & (g["status"] == "ok")]
    if base.empty:
        versus = f"no {BASELINE} run"
    elif base["n_params"].iloc[0] == 0:
        versus = f"{BASELINE} trains none of the ladder"
    else:
        versus = (f"{best['n_params'] / base['n_params'].iloc[0]:.2f}x the parameters of "
                  f"{BASELINE}'s {base['largest_model'].iloc[0]}")
    names = ", ".join(method_order(top["method"]))
    return (f"{names} train{'s' if len(top) == 1 else ''} {best['largest_model']} "
            f"({parameters_text(best['n_params'])} parameters"
            f"{', the top of the ladder' if best['at_ladder_top'] == 1 else ''}); {versus}.")


def largest_batch_section(summary: pd.DataFrame) -> str | None:
    """Table: the largest batch per model, method and memory size."""
    cap = capacity_table(summary)
    if cap.empty:
        return None
    rows = []
    for _, r in _ordered(cap, summary, ["model", "seq_len", "capacity_gb"]).iterrows():
        batch = integer(r["largest_batch"])
        if r["at_max_batch"] == 1:
            batch = f">= {batch}"
        rows.append([r["model"], integer(r["seq_len"]), r["dtype"], r["memory_tier"],
                     num(r["capacity_gb"], "g"), r["method"], integer(r["micro_batches"]),
                     r["status"], batch])
    return ("### Largest batch\n\nThe largest batch that fits, per model, method and memory "
            "size (a multiple of the method's micro-batches).\n\n"
            + markdown_table(rows, ["model", "seq", "dtype", "tier", "memory GiB", "method",
                                    "micro-batches", "status", "largest batch"], "lrllrlrlr"))


def accuracy_section(summary: pd.DataFrame) -> str:
    table = simulation_accuracy_table(summary)
    if table.empty:
        return ("_No cell has both a simulated and a GPU-measured memory job yet: run the "
                "`paper-memory` and `full` suites (their batch-8 cells match) to measure how "
                "close the simulation is._")
    rows = [[r["model"], r["method"], integer(r["batch_size"]), integer(r["seq_len"]), r["dtype"],
             r["device_name"], num(r["peak_bytes_simulated"] / 2**20), num(r["peak_bytes_measured"] / 2**20),
             num(r["allocated_ratio"], ".3f"), num(r["reserved_peak_bytes_simulated"] / 2**20),
             num(r["reserved_peak_bytes_measured"] / 2**20), num(r["reserved_ratio"], ".3f")]
            for _, r in table.iterrows()]
    return ("The same cells simulated on a CPU and measured on a GPU. Allocated: the tracker's "
            "simulated peak vs the CUDA allocator's peak allocated bytes; reserved: the "
            "allocator model's prediction vs the allocator's peak reserved bytes (MiB).\n\n"
            + markdown_table(rows, ["model", "method", "batch", "seq", "dtype", "GPU",
                                    "allocated simulated", "allocated measured", "ratio",
                                    "reserved predicted", "reserved measured", "ratio"],
                             "llrrllrrrrrr"))


FAILED_HEADER = ["kind", "method", "model", "task", "batch", "seed", "status", "message"]


def failed_section(summary: pd.DataFrame) -> str:
    bad = summary[summary["status"] != "ok"]
    if bad.empty:
        return "_Every job finished with status ok._"
    bad = bad.sort_values(["kind", "model", "method", "task", "batch_size", "seed"],
                          kind="stable")
    rows = [[r["kind"], r["method"], r["model"], r["task"], integer(r["batch_size"]),
             integer(r["seed"]), r["status"], r["message"]] for _, r in bad.iterrows()]
    return markdown_table(rows, FAILED_HEADER, "llllrrll")


CLAIMS_HEADER = ["method", "versus", "metric", "published claim", "their setup", "ours",
                 "our setup", "source"]


def claims_section(summary: pd.DataFrame, claims_file: Path) -> str:
    if not claims_file.exists():
        return f"_No claims file ({claims_file})._"
    claims = yaml.safe_load(claims_file.read_text()) or []
    table = claim_table(summary, claims)
    rows = [[r["method"], r["versus"], r["metric"], r["claim"], r["setup"], r["ours"],
             r["our_setup"], r["source"]] for _, r in table.iterrows()]
    intro = (f"Published claims (from `{claims_file.as_posix()}`) beside our measurement of the "
             "same comparison. Ours are ranges over the cells measured (models, batch sizes, "
             "seeds); the settings differ from the papers' (see each setup), so a difference "
             "is a finding to explain, not a failed reproduction by itself.")
    return intro + "\n\n" + markdown_table(rows, CLAIMS_HEADER)


def report(summary: pd.DataFrame, source: str, out: Path, figures: Path,
           claims_file: Path = Path("paper/claims.yaml")) -> str:
    sections = [
        "# membench results",
        f"_Generated by `membench report` from `{source}`; do not edit by hand: "
        "rerun the workflow instead._",
        "## Provenance", provenance(summary, source),
        "## Figures", figures_section(out, figures),
        "## Claims and ours", claims_section(summary, claims_file),
        "## Peak memory", memory_section(summary),
        "## Throughput", throughput_section(summary),
        "## Convergence", convergence_section(summary),
        "## Capacity: what fits in a GPU's memory", capacity_section(summary),
        "## Simulation vs GPU", accuracy_section(summary),
        "## Failed jobs", failed_section(summary),
    ]
    return "\n\n".join(sections) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="membench report",
        description="Write the Markdown results report from summary.csv: provenance, links "
                    "to the figures, tables of peak memory, throughput and convergence "
                    f"(each compared with {BASELINE}), and the list of failed jobs.")
    p.add_argument("--summary", required=True, help="summary.csv from bench.report.aggregate")
    p.add_argument("--out", required=True,
                   help="report path, e.g. paper/results.md (written atomically)")
    p.add_argument("--figures", default="results/figures",
                   help="folder of the figures from bench.report.figures; linked relative to --out "
                        "(default: results/figures)")
    p.add_argument("--claims", default="paper/claims.yaml",
                   help="published claims to set beside ours (default: paper/claims.yaml)")
    args = p.parse_args(argv)
    summary = read_summary(args.summary)
    out = Path(args.out)
    write_text_atomic(out, report(summary, args.summary, out, Path(args.figures), Path(args.claims)))
    print(f"paper: {out} ({len(summary)} jobs, {(summary['status'] != 'ok').sum()} not ok)",
          file=sys.stderr)
    return 0


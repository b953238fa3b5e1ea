"""The article: what the runs found, as prose around figures and compact tables.

    membench article --sources paper/sources.yaml --out paper/       # the committed references
    membench article --summary results/summary.csv --curves results/curves.csv --out results/paper/

One job: summaries -> `article.md` (+ the figures it shows, drawn from the same data, and
`article.html` by `bench.report.render`). Every number in the text comes from the
summaries passed in; where they lack what a sentence needs, it says "not measured in this
run". A manifest (`--sources`) gives each section its own summaries (the quick suite for
memory and speed, the capacity searches for capacity, the H100 run for trust); with
`--summary` every section reads the same one (a user's own run).
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from bench.measure.records import write_text_atomic
from bench.report.markdown import markdown_table
from bench.report.tables import (BASELINE, CATEGORIES, CLAIM_METRICS, MIB, T975, capacity_table, claim_pairs,
                                 claim_table, convergence_table, geomean, largest_model_gpus_finding,
                                 largest_model_gpus_table, largest_model_table, memory_table,
                                 model_order, parameters_text, read_curves, read_summary, scheme_name,
                                 simulation_accuracy_table, task_label, throughput_table)

SIZES = (16, 24, 40, 80)           # GPU memory sizes the recommendations are made for (GiB)
ROLES = ("memory", "speed", "convergence", "capacity", "trust")
KINDS = {"memory": ["memory"], "speed": ["throughput"], "convergence": ["convergence"],
         "capacity": ["capacity", "model_capacity"], "trust": ["memory", "throughput"]}
ON_PAR = 0.02                      # nats/token: a loss gap this small (or an interval holding 0) is "on par"
NOT_MEASURED = "not measured in this run"
DEDUPE = ["kind", "method", "model", "batch_size", "seq_len", "dtype", "precision", "world_size", "sharding",
          "device", "memory_tier", "capacity_gb", "seed", "task", "phase", "tuning"]


# ----------------------------------------------------------------------------- inputs


@dataclass
class Sources:
    """Each section's rows (role -> summary rows), curves, and where they came from."""
    frames: dict[str, pd.DataFrame]
    curves: dict[str, pd.DataFrame]
    described: list[str] = field(default_factory=list)
    title: str = "Memory-reduction methods for training: what fits, what it costs, whether it converges"

    def role(self, name: str) -> pd.DataFrame:
        return self.frames[name]

    def everything(self) -> pd.DataFrame:
        """Every section's rows once (the claims audit reads them all)."""
        parts = [f[f["kind"].isin(KINDS[r])] for r, f in self.frames.items() if r != "trust" and len(f)]
        if not parts:
            return self.frames["memory"].iloc[0:0]
        return pd.concat(parts, ignore_index=True).drop_duplicates(DEDUPE, keep="last").reset_index(drop=True)


def _filtered(frame: pd.DataFrame, where: dict | None, exclude: dict | None) -> pd.DataFrame:
    for col, allowed in (where or {}).items():
        frame = frame[frame[col].astype(str).isin([str(a) for a in allowed])]
    for col, banned in (exclude or {}).items():
        frame = frame[~frame[col].astype(str).isin([str(b) for b in banned])]
    return frame


def from_summary(summary: str | Path, curves: str | Path | None = None) -> Sources:
    """A run's own article: every section reads the one summary."""
    s, c = read_summary(summary), read_curves(curves)
    return Sources({r: s for r in ROLES}, {r: c for r in ROLES},
                   [f"every section: `{Path(summary).as_posix()}`"])


def from_manifest(path: str | Path, root: str | Path = ".") -> Sources:
    """The sections' summaries as a manifest names them (paper/sources.yaml): `sources`
    (name -> summary, curves, what) and `roles` (section -> list of a source's name, or
    {source, where, exclude} to keep some rows: column -> values)."""
    spec = yaml.safe_load(Path(path).read_text())
    root = Path(root)
    loaded = {}
    for name, s in spec["sources"].items():
        loaded[name] = (read_summary(root / s["summary"]), read_curves(root / s["curves"] if s.get("curves") else None))
    frames, curves, described = {}, {}, []
    for role in ROLES:
        parts, cparts, names = [], [], []
        for entry in spec["roles"].get(role, []):
            entry = {"source": entry} if isinstance(entry, str) else entry
            s, c = loaded[entry["source"]]
            kept = _filtered(s, entry.get("where"), entry.get("exclude"))
            parts.append(kept)
            cparts.append(_filtered(c, {k: v for k, v in (entry.get("where") or {}).items() if k in c},
                                    {k: v for k, v in (entry.get("exclude") or {}).items() if k in c}))
            names.append(f"`{spec['sources'][entry['source']]['summary']}`"
                         + (" (" + "; ".join(f"{k} {', '.join(map(str, v))}" for k, v in
                                             (entry.get("where") or {}).items()) + ")" if entry.get("where") else ""))
        empty = read_summary_like(loaded)
        frames[role] = (pd.concat(parts, ignore_index=True).drop_duplicates(DEDUPE, keep="last")
                        .reset_index(drop=True) if parts else empty)
        curves[role] = pd.concat(cparts, ignore_index=True) if cparts else read_curves(None)
        described.append(f"{role}: " + (", ".join(names) or "none"))
    return Sources(frames, curves, described, spec.get("title", Sources.__dataclass_fields__["title"].default))


def read_summary_like(loaded: dict) -> pd.DataFrame:
    first = next(iter(loaded.values()))[0] if loaded else None
    return first.iloc[0:0] if first is not None else pd.DataFrame()


# ----------------------------------------------------------------------------- words


def _f(value, fmt=".2f", missing=NOT_MEASURED) -> str:
    return missing if value is None or pd.isna(value) else format(value, fmt)


def _pct(value) -> str:
    return NOT_MEASURED if value is None or pd.isna(value) else f"{value:+.1f}%"


def _methods(names) -> str:
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _models_text(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "none"
    if "n_params" not in frame or "family" not in frame:   # a table without sizes: family, then name
        return ", ".join(sorted(set(frame["model"]), key=lambda m: (m.split("-")[0], m)))
    return ", ".join(model_order(frame))


# ----------------------------------------------------------------------------- memory


def memory_savings(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (memory tier, method): the cells measured, the median change of peak vs the
    baseline's (%), its range, and each category's median change in % of the baseline's
    peak of the same cell (where the bytes saved come from)."""
    table = memory_table(frame)
    if len(table):  # one GPU: a sharded row's baseline is the sharded baseline (docs/sharding.md)
        table = table[(table["world_size"] == 1) & (table["sharding"] == "none")]
    if table.empty:
        return pd.DataFrame(columns=["tier", "method", "cells", "models", "median", "best", "worst"] + list(CATEGORIES))
    keys = ["model", "batch_size", "seq_len", "device"]
    base = table[table["method"] == BASELINE].set_index(keys)
    rows = []
    for (tier, method), g in table.groupby(["memory_tier", "method"], sort=True):
        if method == BASELINE:
            continue
        g = g[g["pct_vs_baseline"].notna()]
        if g.empty:
            continue
        shares = {c: [] for c in CATEGORIES}
        for _, r in g.iterrows():
            b = base.loc[tuple(r[k] for k in keys)]
            for c in CATEGORIES:
                shares[c].append(100 * (r[f"{c}_mib"] - b[f"{c}_mib"]) / b["peak_mib"])
        rows.append({"tier": tier, "method": method, "cells": len(g), "models": _models_text(g),
                     "median": g["pct_vs_baseline"].median(), "best": g["pct_vs_baseline"].min(),
                     "worst": g["pct_vs_baseline"].max(), **{c: float(np.median(v)) for c, v in shares.items()}})
    return pd.DataFrame(rows).sort_values(["tier", "median"], kind="stable").reset_index(drop=True)


def memory_finding(savings: pd.DataFrame) -> str:
    if savings.empty:
        return f"Peak memory: {NOT_MEASURED}."
    out = []
    for tier, g in savings.groupby("tier", sort=True):
        top = g.iloc[0]
        cut = (g["median"] <= -10).sum()
        where = min(CATEGORIES, key=lambda c: top[c])
        out.append(f"In the {tier} tier ({top['models']}), {top['method']} cuts the peak most: "
                   f"{_pct(top['median'])} against {BASELINE} (median of {int(top['cells'])} cells), "
                   f"mostly in {where} bytes ({top[where]:+.1f}% of {BASELINE}'s peak); {cut} of {len(g)} "
                   f"methods cut it by 10% or more.")
    return " ".join(out)


def memory_section(savings: pd.DataFrame) -> str:
    if savings.empty:
        return f"_Peak memory: {NOT_MEASURED}._"
    rows = [[r["tier"], r["method"], int(r["cells"]), _pct(r["median"]),
             f"{r['best']:+.1f}% to {r['worst']:+.1f}%"] + [f"{r[c]:+.1f}" for c in CATEGORIES]
            for _, r in savings.iterrows()]
    return (f"Peak bytes of one training step against {BASELINE}'s in the same cell (model, batch, "
            "sequence, device). The category columns say where the change comes from: each "
            f"category's change in % of {BASELINE}'s peak (median over the cells), so they add up to "
            "about the peak's change where the peak falls at the same moment of the step.\n\n"
            + markdown_table(rows, ["tier", "method", "cells", "peak vs adamw (median)", "range"]
                             + [f"{c} (% of peak)" for c in CATEGORIES], "llrrr" + "r" * len(CATEGORIES)))


# ----------------------------------------------------------------------------- speed


def speed_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (device, method): the geometric mean of the paired ratios over its cells and of
    their interval ends, the models, the number of cells."""
    table = throughput_table(frame)
    table = table[table["has_baseline"] & (table["method"] != BASELINE)] if len(table) else table
    if table.empty:
        return pd.DataFrame(columns=["device", "method", "cells", "models", "ratio", "lo", "hi"])
    names = frame.groupby("device")["device_name"].agg(lambda s: next((v for v in s if isinstance(v, str)), ""))
    rows = []
    for (device, method), g in table.groupby(["device", "method"], sort=True):
        rows.append({"device": f"{device}: {names.get(device, '')}" if names.get(device) else device,
                     "method": method, "cells": len(g), "models": _models_text(g), "ratio": geomean(g["ratio"]),
                     "lo": geomean(g["ratio_lo"]), "hi": geomean(g["ratio_hi"])})
    return pd.DataFrame(rows).sort_values(["device", "ratio"], ascending=[True, False], kind="stable")


def speed_finding(speed: pd.DataFrame) -> str:
    if speed.empty:
        return f"Throughput: {NOT_MEASURED}."
    out = []
    for device, g in speed.groupby("device", sort=True):
        fast, slow = g.iloc[0], g.iloc[-1]
        near = ((g["lo"] <= 1) & (g["hi"] >= 1)).sum()
        out.append(f"Measured on {device} ({fast['models']}): {near} of {len(g)} methods are as fast as "
                   f"{BASELINE} within their 95% interval; the slowest, {slow['method']}, runs at "
                   f"{slow['ratio']:.2f}x {BASELINE}'s tokens/s, the fastest, {fast['method']}, "
                   f"at {fast['ratio']:.2f}x.")
    return " ".join(out)


def speed_section(speed: pd.DataFrame) -> str:
    if speed.empty:
        return f"_Throughput: {NOT_MEASURED}._"
    rows = [[r["device"], r["method"], r["models"], int(r["cells"]), f"{r['ratio']:.2f}",
             f"{r['lo']:.2f}–{r['hi']:.2f}"] for _, r in speed.iterrows()]
    return ("Tokens/s of the method over its baseline's, both timed in one process in interleaved "
            "rounds (measured; geometric mean over the cells, with the geometric mean of the 95% "
            "intervals' ends). A ratio belongs to its device: compare ratios, not tokens/s.\n\n"
            + markdown_table(rows, ["device", "method", "models", "cells", "ratio", "95% interval"], "lllrrr"))


# ----------------------------------------------------------------------------- convergence


def convergence_gaps(frame: pd.DataFrame) -> pd.DataFrame:
    """The tuned cells (each method at its best learning rate): one row per method and cell."""
    table = convergence_table(frame)
    if table.empty:
        return table
    return table[(table["tuning"] == "tuned") & (table["method"] != BASELINE)].reset_index(drop=True)


def convergence_finding(gaps: pd.DataFrame) -> str:
    if gaps.empty:
        return (f"Convergence at each method's best learning rate: {NOT_MEASURED} (no tuned cells).")
    out = []
    for key, g in gaps.groupby(["task", "model", "phase"], sort=True):
        g = g[g["gap_vs_baseline"].notna()]
        if g.empty:
            continue
        par = g[_on_par(g)]
        worst = g.loc[g["gap_vs_baseline"].idxmax()]
        out.append(f"On {task_label(key[0], key[2], 'tuned')} ({key[1]}, {int(g['steps'].max())} steps, "
                   f"{int(g['n_ok'].max())} seeds), {len(par)} of {len(g)} methods end on par with {BASELINE} "
                   f"(gap within {ON_PAR} nats/token or its 95% interval holding 0); the largest gap is "
                   f"{worst['method']}'s, {worst['gap_vs_baseline']:+.3f} nats/token.")
    return " ".join(out) or f"Convergence: {NOT_MEASURED}."


def _on_par(g: pd.DataFrame) -> pd.Series:
    return (g["gap_vs_baseline"] <= ON_PAR) | (g["gap_lo"] <= 0)


def convergence_section(gaps: pd.DataFrame) -> str:
    if gaps.empty:
        return f"_Convergence at tuned learning rates: {NOT_MEASURED}._"
    rows = []
    for _, r in gaps.sort_values(["task", "phase", "gap_vs_baseline"]).iterrows():
        gap = _f(r["gap_vs_baseline"], "+.3f")
        if pd.notna(r["gap_lo"]):
            gap += f" ({r['gap_lo']:+.3f} to {r['gap_hi']:+.3f})"
        rows.append([task_label(r["task"], r["phase"]), r["model"], int(r["steps"]), int(r["n_ok"]), r["method"],
                     _f(r["lr"], "g"), _f(r["final_loss_mean"], ".3f"), gap])
    return (f"Final training loss (nats/token, mean over seeds) minus {BASELINE}'s in the same cell, every "
            f"method, {BASELINE} included, at the learning rate its own tuning runs chose, with the 95% "
            "interval paired by seed.\n\n"
            + markdown_table(rows, ["task", "model", "steps", "seeds", "method", "lr", "final loss",
                                    f"gap to {BASELINE} (95% interval)"], "llrrlrrr"))


def loss_cost(gaps: pd.DataFrame, method: str) -> str:
    """A method's convergence gap for the recommendation table: its tuned cell with the most
    steps; `checkpointing+X` takes X's (checkpointing recomputes the same values)."""
    part = gaps[(gaps["method"] == method) & gaps["gap_vs_baseline"].notna()] if len(gaps) else gaps
    note = ""
    if part.empty and method.startswith("checkpointing+"):
        inner = method.split("+", 1)[1]
        part = gaps[(gaps["method"] == inner) & gaps["gap_vs_baseline"].notna()] if len(gaps) else gaps
        note = f" ({inner}'s; checkpointing recomputes the same values)"
    if method == BASELINE:
        return "baseline"
    if part.empty:
        return "not measured at this scale"
    r = part.sort_values(["steps", "n_ok"]).iloc[-1]
    return (f"{r['gap_vs_baseline']:+.3f} nats/token{note} ({r['model']}, {task_label(r['task'], r['phase'])}, "
            f"{int(r['steps'])} steps)")


# ----------------------------------------------------------------------------- capacity and recommendations


def _largest_models(frame: pd.DataFrame) -> pd.DataFrame:
    t = largest_model_table(frame)
    return t[t["status"] == "ok"] if len(t) else t


def recommend_model(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (memory size, family): the method(s) that train the largest model of the
    family's ladder at the searched batch, and the baseline's largest."""
    t = _largest_models(frame)
    rows = []
    if t.empty:
        return pd.DataFrame(columns=["capacity_gb", "family", "precision", "batch_size", "methods", "model",
                                     "n_params", "at_top", "base_model", "base_params"])
    for (gb, fam, precision, batch), g in t.groupby(["capacity_gb", "family", "precision", "batch_size"], sort=True):
        best = g["n_params"].max()
        top = g[g["n_params"] == best]
        base = g[g["method"] == BASELINE]
        rows.append({"capacity_gb": gb, "family": fam, "precision": precision, "batch_size": batch,
                     "methods": sorted(top["method"]), "model": top["largest_model"].iloc[0],
                     "n_params": best, "at_top": bool((top["at_ladder_top"] == 1).any()),
                     "base_model": base["largest_model"].iloc[0] if len(base) else None,
                     "base_params": base["n_params"].iloc[0] if len(base) else np.nan})
    out = pd.DataFrame(rows)  # by family, pure precision first, then the others (mixed)
    return out.assign(_mixed=out["precision"] != "pure").sort_values(
        ["family", "_mixed", "precision", "capacity_gb", "batch_size"], kind="stable").drop(columns="_mixed")


def family_text(row) -> str:
    """A row's family as the capacity tables name it: with its precision where it is not pure
    ('llama, mixed precision': float32 master copy and optimizer state, autocast)."""
    precision = row.get("precision", "pure")
    pure = precision is None or pd.isna(precision) or precision == "pure"
    return row["family"] if pure else f"{row['family']}, {precision} precision"


def recommend_batch(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (memory size, family): on the family's largest model that any method fits, the
    method(s) with the largest batch, the baseline's batch, and estimated tokens/s of each
    at its largest batch (est_h100_*, labelled estimated)."""
    cap = capacity_table(frame)
    cols = ["capacity_gb", "family", "model", "seq_len", "methods", "batch", "at_max", "base_batch",
            "est_tokens_per_s", "base_est_tokens_per_s"]
    if cap.empty:
        return pd.DataFrame(columns=cols)
    est = frame[frame["kind"] == "capacity"].set_index(["method", "model", "capacity_gb"])["est_h100_tokens_per_s"]
    cap = cap[cap["status"] == "ok"]
    rows = []
    for (gb, fam), g in cap.groupby(["capacity_gb", "family"], sort=True):
        fits = g[g["largest_batch"] > 0]
        if fits.empty:
            continue
        model = fits.sort_values("n_params").iloc[-1]["model"]
        g = g[g["model"] == model]
        best = g["largest_batch"].max()
        top = g[g["largest_batch"] == best]
        base = g[g["method"] == BASELINE]
        first = sorted(top["method"])[0]
        rows.append({"capacity_gb": gb, "family": fam, "model": model, "seq_len": g["seq_len"].iloc[0],
                     "methods": sorted(top["method"]), "batch": best, "at_max": bool((top["at_max_batch"] == 1).any()),
                     "base_batch": base["largest_batch"].iloc[0] if len(base) else np.nan,
                     "est_tokens_per_s": est.get((first, model, gb), np.nan),
                     "base_est_tokens_per_s": est.get((BASELINE, model, gb), np.nan) if len(base) else np.nan})
    return pd.DataFrame(rows, columns=cols)


def measured_speed(speed_rows: pd.DataFrame, method: str, family: str) -> tuple[float, str]:
    """A method's measured paired ratio (geometric mean over cells) and its label, from a
    GPU where one measured it, else the CPU; the family's own models where measured.
    (NaN, "not measured") without a cell; the baseline is 1 by definition."""
    if method == BASELINE:
        return 1.0, "baseline"
    table = throughput_table(speed_rows)
    table = table[table["has_baseline"] & (table["method"] == method)] if len(table) else table
    if table.empty:
        return np.nan, "not measured"
    fam = speed_rows.groupby("model")["family"].first()
    table = table.assign(_gpu=table["device"].str.startswith("cuda"), _fam=table["model"].map(fam).eq(family))
    first = table.sort_values(["_gpu", "_fam"]).iloc[-1]
    pick = table[(table["_gpu"] == first["_gpu"]) & (table["_fam"] == first["_fam"])]
    ratio = geomean(pick["ratio"])
    return ratio, f"{ratio:.2f}x measured ({_models_text(pick)}, {'GPU' if first['_gpu'] else 'CPU'})"


def speed_cost(speed_rows: pd.DataFrame, method: str, family: str) -> str:
    return measured_speed(speed_rows, method, family)[1]


def by_speed(speed_rows: pd.DataFrame, methods: list[str], family: str) -> list[str]:
    """Tied methods, the fastest measured first (unmeasured last, then by name): the first
    is the one recommended."""
    def key(m):
        ratio = measured_speed(speed_rows, m, family)[0]
        return (0, -ratio, m) if pd.notna(ratio) else (1, 0.0, m)
    return sorted(methods, key=key)


def _estimated(frame: pd.DataFrame, method: str, model: str, gb: float) -> float:
    rows = frame[(frame["kind"] == "capacity") & (frame["method"] == method) & (frame["model"] == model)
                 & (frame["capacity_gb"] == gb)]["est_h100_tokens_per_s"].dropna()
    return float(rows.iloc[-1]) if len(rows) else np.nan


def recommend_gpus(frame: pd.DataFrame) -> pd.DataFrame:
    """Per (memory size per GPU, GPU count above 1, family, precision and batch): the
    (method, scheme) pairs that train the largest model per GPU, AdamW's largest on as many
    GPUs (its best scheme) and on one. Empty without searches of several GPUs."""
    cols = ["capacity_gb", "world_size", "family", "precision", "batch_size", "top", "model", "n_params", "at_top",
            "tiers", "base_label", "base_params", "one_gpu_params"]
    t = largest_model_gpus_table(frame)
    t = t[t["status"] == "ok"] if len(t) else t
    rows = []
    groups = t.groupby(["capacity_gb", "family", "precision", "batch_size"], sort=True) if len(t) else []
    for (gb, fam, precision, batch), g in groups:
        one = g[(g["world_size"] == 1) & (g["method"] == BASELINE)]["n_params"]
        for n, h in g[g["world_size"] > 1].groupby("world_size", sort=True):
            best = h["n_params"].max()
            top = h[h["n_params"] == best]
            base = h[h["method"] == BASELINE]
            base = base[base["n_params"] == base["n_params"].max()]  # its best scheme(s)
            rows.append({"capacity_gb": gb, "world_size": n, "family": fam, "precision": precision,
                         "batch_size": batch, "top": list(zip(top["method"], top["sharding"])),
                         "model": top["largest_model"].iloc[0], "n_params": best,
                         "at_top": bool((top["at_ladder_top"] == 1).any()),
                         "tiers": sorted(set(top["memory_tier"].dropna())),
                         "base_label": (f"{parameters_text(base['n_params'].iloc[0])} ("
                                        + ", ".join(scheme_name(x, n) for x in base["sharding"]) + ")")
                         if len(base) else None,
                         "base_params": base["n_params"].iloc[0] if len(base) else np.nan,
                         "one_gpu_params": one.iloc[0] if len(one) else np.nan})
    return pd.DataFrame(rows, columns=cols)


def gpus_recommendations(cap: pd.DataFrame, speed_rows: pd.DataFrame) -> str:
    """The recommendation table per GPU of several (empty text without such searches)."""
    best = recommend_gpus(cap)
    if best.empty:
        return ""
    rows, first = [], {}  # first: per row of `best`, the (method, scheme) recommended
    for i, r in best.iterrows():
        size = (">= " if r["at_top"] else "") + f"{r['model']} ({parameters_text(r['n_params'])})"
        one = r["one_gpu_params"]
        order = by_speed(speed_rows, list(dict.fromkeys(m for m, _ in r["top"])), r["family"])
        top = sorted(r["top"], key=lambda pair: order.index(pair[0]))  # the fastest first
        labels = [f"{m} ({scheme_name(scheme, r['world_size'])})" for m, scheme in top]
        first[i] = labels[0]
        rows.append([f"{r['capacity_gb']:g}", str(int(r["world_size"])), family_text(r), " = ".join(labels),
                     size + f", {', '.join(r['tiers'])}", r["base_label"] or NOT_MEASURED,
                     (f"{parameters_text(one)}; {r['n_params'] / one:.2f}x" if pd.notna(one) and one else "–"),
                     speed_cost(speed_rows, order[0], r["family"])])
    batch = ", ".join(str(int(b)) for b in sorted(best["batch_size"].unique()))
    pick = best[best["capacity_gb"] == 24] if (best["capacity_gb"] == 24).any() else best
    r = pick.sort_values("world_size").iloc[0]
    finding = (f"**Finding.** On {int(r['world_size'])} GPUs of {r['capacity_gb']:g} GiB each ({family_text(r)}, "
               f"batch {int(r['batch_size'])} per GPU), {first[r.name]} trains "
               f"{'at least ' if r['at_top'] else 'up to '}a {parameters_text(r['n_params'])} model"
               + (f", {r['n_params'] / r['base_params']:.1f}x {BASELINE}'s {r['base_label']}"
                  if pd.notna(r["base_params"]) and r["base_params"] else "") + ".")
    return "\n\n".join([
        f"### On several GPUs: the largest model (batch {batch} per GPU)", finding,
        "Each GPU of N trains its own batch, within the memory size per GPU (under FSDP2 rank 0's memory, "
        "simulated; under ZeRO the largest rank's, modelled). Memory only: the collectives' time is "
        "not in these searches (`membench fit --gpus N` estimates it per step). Only the methods "
        "searched on several GPUs enter; which methods can shard at all: docs/sharding.md.",
        markdown_table(rows, ["GiB per GPU", "GPUs", "family", "method (scheme)", "largest model",
                              f"{BASELINE} on as many", f"{BASELINE} on one GPU; ratio", "speed vs adamw"],
                       "rrllllll")])


def recommendations(sources: Sources) -> str:
    cap, speed_rows = sources.role("capacity"), sources.role("speed")
    gaps = convergence_gaps(sources.role("convergence"))
    models, batches = recommend_model(cap), recommend_batch(cap)
    sizes = sorted(set(SIZES) | set(models["capacity_gb"]) | set(batches["capacity_gb"]))
    families = sorted(set(models["family"]) | set(batches["family"]))
    if not families:
        return f"_Recommendations need capacity searches: {NOT_MEASURED}._"
    m_rows, b_rows = [], []
    for gb in sizes:
        for fam in families:
            m = models[(models["capacity_gb"] == gb) & (models["family"] == fam)]
            if m.empty:
                m_rows.append([f"{gb:g}", fam, NOT_MEASURED, "", "", "", ""])
            for _, r in m.iterrows():
                methods = by_speed(speed_rows, r["methods"], fam)
                method = methods[0]
                size = ("none fits" if not r["n_params"] else
                        (">= " if r["at_top"] else "") + f"{r['model']} ({parameters_text(r['n_params'])})")
                base = ("none fits" if not r["base_params"] or pd.isna(r["base_params"]) else
                        f"{r['base_model']} ({parameters_text(r['base_params'])})")
                ratio = (f"{r['n_params'] / r['base_params']:.2f}x" if r["base_params"] and pd.notna(r["base_params"])
                         else "–")
                m_rows.append([f"{gb:g}", family_text(r), " = ".join(methods), size, f"{base}; {ratio}",
                               speed_cost(speed_rows, method, fam), loss_cost(gaps, method)])
            b = batches[(batches["capacity_gb"] == gb) & (batches["family"] == fam)]
            if b.empty:
                b_rows.append([f"{gb:g}", fam, NOT_MEASURED, "", "", "", "", ""])
            for _, r in b.iterrows():
                methods = by_speed(speed_rows, r["methods"], fam)
                method = methods[0]
                r["est_tokens_per_s"] = _estimated(cap, method, r["model"], gb)
                est = (f"{r['est_tokens_per_s']:,.0f} vs {r['base_est_tokens_per_s']:,.0f} tokens/s (estimated, H100)"
                       if pd.notna(r["base_est_tokens_per_s"]) and pd.notna(r["est_tokens_per_s"]) else
                       f"{r['est_tokens_per_s']:,.0f} tokens/s (estimated, H100; {BASELINE} fits no batch)"
                       if pd.notna(r["est_tokens_per_s"]) else "not estimated")
                b_rows.append([f"{gb:g}", fam, r["model"], " = ".join(methods),
                               (">= " if r["at_max"] else "") + str(int(r["batch"])),
                               _f(r["base_batch"], ".0f", "–"), est + "; " + speed_cost(speed_rows, method, fam),
                               loss_cost(gaps, method)])
    batch_size = ", ".join(str(int(b)) for b in sorted(models["batch_size"].unique())) or "–"
    return ("\n\n".join([
        "What a user came for: per GPU memory size and model family, the method (or stack) that "
        "trains the largest model, and the one that fits the largest batch, with what each costs. "
        "Speed: the paired throughput ratio to AdamW, measured (on a GPU where the run has one, "
        "else on the CPU's tiny models of the family: a ratio of small models, not a promise at "
        "this size); for the batch, tokens/s at each one's largest batch on an H100, estimated "
        "from the step's operators (calibrated as the trust section says). Loss: the final-loss "
        "gap to AdamW at each one's tuned learning rate, measured on tiny models only, or "
        "'not measured at this scale'. Precision: pure (parameters, gradients and optimizer state in "
        "the searches' dtype) unless the family says 'mixed precision' (a float32 master copy, "
        "gradients and optimizer state, the compute under autocast), where AdamW is searched under "
        "mixed precision too.",
        f"### The largest model that trains (batch {batch_size})",
        markdown_table(m_rows, ["GiB", "family", "method", "largest model", f"{BASELINE}'s; ratio",
                                "speed vs adamw", "loss gap to adamw"], "rllllll"),
        "'=' lists the methods that tie, the one recommended (the fastest measured) first; its speed "
        "and loss are in the row.",
        "### The largest batch",
        markdown_table(b_rows, ["GiB", "family", "model", "method", "largest batch", f"{BASELINE}'s",
                                "speed (estimated at the largest batch; measured ratio)", "loss gap to adamw"],
                       "rlllrrll"),
        gpus_recommendations(cap, speed_rows)]).rstrip())


def capacity_finding(sources: Sources) -> str:
    models = recommend_model(sources.role("capacity"))
    if models.empty:
        return f"Largest model per memory size: {NOT_MEASURED}."
    gb = 24 if (models["capacity_gb"] == 24).any() else models["capacity_gb"].iloc[0]
    out = []
    for _, r in models[models["capacity_gb"] == gb].iterrows():
        if not r["n_params"]:
            out.append(f"no method trains the first {family_text(r)} size")
            continue
        vs = (f", {r['n_params'] / r['base_params']:.1f}x {BASELINE}'s {parameters_text(r['base_params'])}"
              if r["base_params"] and pd.notna(r["base_params"]) else f"; {BASELINE} trains none")
        top = " (the ladder's top, so at least that)" if r["at_top"] else ""
        out.append(f"{family_text(r)} up to {parameters_text(r['n_params'])}{top} with {_methods(r['methods'])}{vs}")
    return (f"In {gb:g} GiB at batch {int(models['batch_size'].iloc[0])}, the largest models that train "
            f"are: {'; '.join(out)} (simulated).")


def capacity_section(sources: Sources) -> str:
    models = recommend_model(sources.role("capacity"))
    if models.empty:
        return f"_Capacity: {NOT_MEASURED}._"
    sizes = sorted(models["capacity_gb"].unique())
    rows = []
    for _, g in models.groupby(["family", "precision"], sort=False):  # in recommend_model's order
        fam = family_text(g.iloc[0])
        g = g.set_index("capacity_gb")
        rows.append([fam, "best"] + [f"{parameters_text(g.loc[s, 'n_params'])} ({_methods(g.loc[s, 'methods'])})"
                                     if s in g.index else "–" for s in sizes])
        rows.append([fam, BASELINE] + [parameters_text(g.loc[s, "base_params"]) if s in g.index else "–"
                                       for s in sizes])
    return ("Each number is a search's boundary (that size trains, the next does not, each answered by "
            "its step: run, or derived byte for byte from shallow copies or steps run at other batches), "
            "in the simulated tier: the step on fake tensors, its allocations replayed through a "
            "model of PyTorch's caching allocator, within the memory size less an assumed CUDA "
            "context.\n\n" + markdown_table(rows, ["family", "method"] + [f"{s:g} GiB" for s in sizes],
                                             "ll" + "r" * len(sizes)) + several_gpus(sources))


def several_gpus(sources: Sources) -> str:
    """A paragraph on the same search per GPU of several (the `model_capacity_gpus` figure),
    with its finding from the data; empty without such rows."""
    finding = largest_model_gpus_finding(sources.role("capacity"))
    if finding is None:
        return ""
    return ("\n\n**On several GPUs.** The same search per GPU of N data-parallel GPUs, each training its "
            "own batch (under FSDP2 rank 0's memory, under ZeRO the largest rank's); memory only, no "
            f"communication time. {finding}")


# ----------------------------------------------------------------------------- claims


def claimed_number(metric: str, text: str) -> float | None:
    """The claim's number in the metric's unit: a % change for *_change metrics, a ratio
    (`2x`, `>= 0.98`) for the ratios; None where the claim states none."""
    text = str(text).replace("−", "-")
    if metric.endswith("_change"):
        m = re.search(r"([+-]?\d+(?:\.\d+)?)\s*%", text)
    elif metric in ("largest_batch_ratio", "largest_model_ratio"):
        m = re.search(r"(\d+(?:\.\d+)?)\s*x", text)
    elif metric == "throughput_ratio":
        m = re.search(r"(\d+(?:\.\d+)?)", text)
    else:
        return None
    return float(m.group(1)) if m else None


def claim_cells(pairs: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Our number per cell: `value` (% change, ratio, or loss gap), with `lo`/`hi` for gaps."""
    if pairs.empty:
        return pd.DataFrame(columns=["value", "lo", "hi"])
    if metric.endswith("_change"):
        return pd.DataFrame({"value": 100 * (pairs["m"] / pairs["v"] - 1), "lo": np.nan, "hi": np.nan})
    if metric.endswith("_ratio"):
        p = pairs[pairs["v"] > 0]
        return pd.DataFrame({"value": p["m"] / p["v"], "lo": np.nan, "hi": np.nan})
    keys = [k for k in CLAIM_METRICS[metric][2] if k != "seed"]
    rows = []
    for _, g in pairs.assign(gap=pairs["m"] - pairs["v"]).groupby(keys, dropna=False):
        n, mean = len(g), g["gap"].mean()
        half = T975[min(n - 1, len(T975)) - 1] * g["gap"].std(ddof=1) / np.sqrt(n) if n > 1 else np.nan
        rows.append({"value": mean, "lo": mean - half, "hi": mean + half})
    return pd.DataFrame(rows)


VERDICT_RULE = (
    "The rule. A claim is **not testable here** when no cell compares the two methods or its setting is "
    "marked not comparable. A claimed saving (a peak, state or optimizer-memory change below 0, a "
    "batch, model or speed ratio above 1) is **reproduced** when our most favourable cell reaches the "
    "claimed number, **reproduced in part** when it goes the claimed way but not as far, **not "
    "reproduced** when it goes the other way; a claim without a number is judged by its direction "
    "(reproduced when our median cell goes that way, in part when only some cells do). A bound on "
    "a cost (a speed ratio of at least 0.98) is reproduced when our median cell keeps it, in part "
    "when some cell does. A loss claim ('on par', 'comparable') is reproduced when every cell's gap "
    f"is within {ON_PAR} nats/token or its 95% interval holds 0, in part when some are, not reproduced "
    "when none are; 'better' or 'faster' claims need every gap's interval below 0 for reproduced, and "
    "on par for in part.")


def verdict(claim: dict, cells: pd.DataFrame) -> tuple[str, str]:
    """(verdict, reason) for one claim by `VERDICT_RULE`."""
    metric, text = claim["metric"], str(claim["claim"])
    if "not comparable" in str(claim.get("setup", "")).lower():
        return "not testable here", "the claim's setting has no counterpart here (its setup says so)"
    if cells.empty:
        return "not testable here", "no cell compares the two methods in these runs"
    values = cells["value"].astype(float)
    if metric == "final_loss_gap":
        par = (values <= ON_PAR) | (cells["lo"] <= 0)
        better = cells["hi"] < 0
        gaps = f"gaps {values.min():+.3f} to {values.max():+.3f} nats/token over {len(values)} cell(s)"
        if re.search(r"on par|comparable|competitive|same", text, re.I) or not re.search(
                r"better|superior|faster", text, re.I):
            v = ("reproduced" if par.all() else "reproduced in part" if par.any() else "not reproduced")
            return v, f"claimed on par; {gaps}, {int(par.sum())} on par"
        v = ("reproduced" if better.all() else "reproduced in part" if par.any() or better.any()
             else "not reproduced")
        return v, f"claimed better; {gaps}, {int(better.sum())} better, {int(par.sum())} on par"
    sign, neutral, unit = (-1, 0.0, "%") if metric.endswith("_change") else (1, 1.0, "x")
    best = values.min() if sign < 0 else values.max()
    median = float(values.median())
    shown = (lambda v: f"{v:+.1f}%") if unit == "%" else (lambda v: f"{v:.2f}x")
    ours = f"our best cell {shown(best)}, median {shown(median)} over {len(values)} cell(s)"
    target = claimed_number(metric, text)
    if target is None:
        if sign * (median - neutral) > 0:
            return "reproduced", f"the claim states a direction only; {ours}"
        if sign * (best - neutral) > 0:
            return "reproduced in part", f"the claim states a direction only; {ours}: only some cells go that way"
        return "not reproduced", f"the claim states a direction only; {ours}: the other way"
    claimed = f"claimed {shown(target)}"
    if sign * (target - neutral) > 0:   # a saving
        if sign * best >= sign * target:
            return "reproduced", f"{claimed}; {ours}"
        if sign * (best - neutral) > 0:
            return "reproduced in part", f"{claimed}; {ours}: the same way, smaller"
        return "not reproduced", f"{claimed}; {ours}: the other way"
    if sign * median >= sign * target:   # a bound on a cost
        return "reproduced", f"{claimed} at most as a cost; {ours}"
    if sign * best >= sign * target:
        return "reproduced in part", f"{claimed} at most as a cost; {ours}: only some cells keep it"
    return "not reproduced", f"{claimed} at most as a cost; {ours}: every cell costs more"


def claims_audit(summary: pd.DataFrame, claims: list[dict]) -> pd.DataFrame:
    table = claim_table(summary, claims)
    verdicts = [verdict(c, claim_cells(claim_pairs(summary, c), c["metric"])) for c in claims]
    table["verdict"] = [v for v, _ in verdicts]
    table["reason"] = [r for _, r in verdicts]
    return table


def claims_section(audit: pd.DataFrame) -> str:
    if audit.empty:
        return "_No claims to audit._"
    rows = [[f"{r['method']} vs {r['versus']}" + (f" ({r['sharding']}, several GPUs)" if isinstance(r["sharding"], str)
                                                   else ""),
             r["metric"], r["claim"], r["ours"], r["verdict"], r["reason"]]
            for _, r in audit.iterrows()]
    counts = audit["verdict"].value_counts()
    finding = ("Of " + str(len(audit)) + " published claims, " + ", ".join(
        f"{counts.get(v, 0)} {v}" for v in ("reproduced", "reproduced in part", "not reproduced",
                                            "not testable here")) + ".")
    return (finding + " Each claim's own setting differs from ours (its source and setup: "
            "`paper/claims.yaml`); ours is the closest setting these runs have.\n\n" + VERDICT_RULE + "\n\n"
            + markdown_table(rows, ["claim", "metric", "published", "ours (range over cells)", "verdict",
                                    "reason"], "llllll"))


# ----------------------------------------------------------------------------- trust


def calibration_cells(frame: pd.DataFrame) -> pd.DataFrame:
    """The estimated tier against measurement: per GPU throughput cell, the measured median
    step time and the estimate (`est_h100_step_time_s`) of the same job's memory row."""
    keys = ["method", "model", "batch_size", "seq_len", "dtype"]
    thr = frame[(frame["kind"] == "throughput") & (frame["status"] == "ok") & frame["device"].str.startswith("cuda")]
    est = frame[(frame["kind"] == "memory") & (frame["status"] == "ok")].groupby(keys)["est_h100_step_time_s"].mean()
    both = thr.groupby(keys)["step_time_median_s"].mean().to_frame().join(est, how="inner").dropna()
    both["error"] = both["est_h100_step_time_s"] / both["step_time_median_s"] - 1
    return both.reset_index()


def trust_section(sources: Sources) -> tuple[str, str]:
    """(finding, body) of the trust section."""
    frame = sources.role("trust")
    acc = simulation_accuracy_table(frame)
    parts, finding = [], []
    if acc.empty:
        finding.append(f"Simulation against GPU measurement: {NOT_MEASURED}.")
        parts.append(f"_No cell was both simulated and measured on a GPU: {NOT_MEASURED}._")
    else:
        live = (acc["peak_bytes_measured"] - acc["peak_bytes_simulated"]).abs() / MIB
        gpu = ", ".join(sorted(set(acc["device_name"].dropna())))
        finding.append(f"On {gpu}, the allocator's measured peak allocated bytes exceeded the simulated "
                       f"peak of live tensor bytes by a median {live.median():.1f} MiB (at most {live.max():.1f} "
                       f"MiB; measured / simulated {acc['allocated_ratio'].min():.3f} to "
                       f"{acc['allocated_ratio'].max():.3f}) over {len(acc)} cells; "
                       f"the measured reserved peak was {acc['reserved_ratio'].median():.3f}x the allocator model's "
                       f"prediction at the median (range {acc['reserved_ratio'].min():.3f} to "
                       f"{acc['reserved_ratio'].max():.3f}).")
        rows = []
        for model, g in acc.groupby("model", sort=False):
            d = (g["peak_bytes_measured"] - g["peak_bytes_simulated"]).abs() / MIB
            rows.append([model, len(g), f"{d.median():.2f}", f"{d.max():.2f}",
                         f"{g['allocated_ratio'].min():.4f}–{g['allocated_ratio'].max():.4f}",
                         f"{g['reserved_ratio'].min():.3f}–{g['reserved_ratio'].max():.3f}"])
        parts.append("The same cells simulated on a CPU and measured on the GPU (memory tier `measured`: "
                     "the CUDA caching allocator's peak allocated and peak reserved bytes). Allocated: the simulated "
                     "peak of live tensor bytes against the allocator's peak allocated, which also holds "
                     "memory no tensor of the step owns (library workspaces); the GPU run's own live-byte "
                     "count is in its result files, not in summary.csv, and is not compared here. "
                     "Reserved: the allocator model's prediction against the allocator's peak reserved "
                     "(measured / predicted).\n\n"
                     + markdown_table(rows, ["model", "cells", "allocated - simulated, median (MiB)", "max (MiB)",
                                             "allocated measured / simulated", "reserved measured / predicted"],
                                      "lrrrrr"))
    cal = calibration_cells(frame)
    if cal.empty:
        finding.append(f"The estimated tier's error against measured GPU steps: {NOT_MEASURED}.")
        parts.append(f"_Estimated step times against measured ones: {NOT_MEASURED}; estimates stay "
                     "labelled `estimated`._")
    else:
        err = cal["error"]
        within = (err.abs() <= 0.30).sum()
        worst_lo, worst_hi = cal.loc[err.idxmin()], cal.loc[err.idxmax()]
        finding.append(f"The estimated step time was within ±30% of the measured one in {within} of {len(cal)} "
                       f"GPU cells (median |error| {100 * err.abs().median():.0f}%, worst "
                       f"{100 * worst_lo['error']:+.0f}% for {worst_lo['method']} on {worst_lo['model']} and "
                       f"{100 * worst_hi['error']:+.0f}% for {worst_hi['method']} on {worst_hi['model']}).")
        rows = [[r["model"], r["method"], f"{r['step_time_median_s'] * 1e3:.1f}",
                 f"{r['est_h100_step_time_s'] * 1e3:.1f}", f"{100 * r['error']:+.0f}%"]
                for _, r in cal.sort_values("error").iterrows()]
        parts.append("The estimated tier (a per-operator roofline on the H100's spec sheet, its efficiencies "
                     "fitted to these measured steps) against the measured median step: in-sample, so "
                     "an estimate elsewhere errs at least this much.\n\n"
                     + markdown_table(rows, ["model", "method", "measured step (ms)", "estimated step (ms)",
                                             "error"], "llrrr"))
    everything = pd.concat([f for f in sources.frames.values()], ignore_index=True).drop_duplicates(DEDUPE)
    bad = everything[everything["status"] != "ok"]
    parts.append("### Limitations\n\n" + "\n".join(f"- {line}" for line in limitations(sources, bad)))
    return " ".join(finding), "\n\n".join(parts)


def limitations(sources: Sources, bad: pd.DataFrame) -> list[str]:
    conv = sources.role("convergence")
    conv_models = _models_text(conv[conv["kind"] == "convergence"]) if len(conv) else "none"
    speed = sources.role("speed")
    thr = speed[speed["kind"] == "throughput"] if len(speed) else speed
    devices = ", ".join(sorted(set(thr["device"].dropna()))) or "none"
    tiers = sorted(set(sources.role("capacity")["memory_tier"].dropna()))
    lines = [
        f"Convergence was measured on {conv_models} only: a gap there is a hint for a paper-sized "
        "model, not a measurement of it; the recommendation tables say 'not measured at this scale' "
        "where a method has no tuned cell.",
        f"Measured speed comes from the devices {devices}; a ratio of tiny models on a CPU is not the "
        "ratio on a GPU at the paper's sizes. Estimated tokens/s are a roofline with fitted "
        "efficiencies, not a measurement: no kernel overlap or fusion, one efficiency for every matmul.",
        f"Capacity answers are in the {', '.join(tiers) or 'unknown'} tier: they fit when the replayed "
        "allocations stay within the memory size less an assumed CUDA context; an answer within a few "
        "percent of a boundary is uncertain, and fragmentation over a long run is not modelled.",
        ("Beside one GPU, only the largest-model search per GPU of several enters (sharded, memory only: no "
         "communication time); no offloading or host-memory limits enter these tables."
         if not largest_model_gpus_table(sources.role("capacity")).empty else
         "One GPU, one process: no multi-GPU sharding, offloading or host-memory limits enter these tables."),
        "Published claims come from other settings (other models, data, hardware, kernels): a verdict "
        "says what our closest setting shows, not whether the paper is right.",
    ]
    if len(bad):
        by = ", ".join(f"{n} {s}" for s, n in bad["status"].value_counts().items())
        lines.append(f"{len(bad)} job(s) did not finish ok ({by}); they appear as such in the run's "
                     "report, never as numbers.")
    else:
        lines.append("Every job behind this article finished with status ok.")
    return lines


# ----------------------------------------------------------------------------- setup, abstract


def setup_section(sources: Sources) -> str:
    everything = pd.concat(list(sources.frames.values()), ignore_index=True).drop_duplicates(DEDUPE)
    fam_rows = []
    for fam, g in everything.groupby("family", sort=True):
        sizes = g.groupby("model")["n_params"].max().dropna()
        fam_rows.append([fam, len(sizes), f"{parameters_text(sizes.min())} to {parameters_text(sizes.max())}"
                         if len(sizes) else "–"])
    tiers = everything.groupby(["kind", "memory_tier"], dropna=False).size().reset_index(name="n")
    tier_rows = [[k, t if isinstance(t, str) else "–", int(n)] for k, t, n in tiers.itertuples(index=False)]
    methods = sorted(set(everything["method"]))
    return "\n\n".join([
        f"{len(methods)} methods and stacks, {everything['model'].nunique()} model shapes in "
        f"{len(fam_rows)} families, {len(everything)} jobs (capacity searches give one row per memory size). "
        "What is **measured**: peak bytes on a GPU (the CUDA allocator), paired throughput ratios on the "
        "device at hand, and loss curves; **tracked**: exact live tensor bytes of a real step on a CPU; "
        "**simulated**: the same accounting on fake tensors, so paper-sized models run on a CPU, with the "
        "allocator modelled; **estimated**: step times on an H100 from the step's operators (labelled "
        "`estimated` wherever they appear).",
        markdown_table(fam_rows, ["family", "models", "parameters"], "lrl"),
        markdown_table(tier_rows, ["kind of job", "memory tier", "rows"], "llr"),
        "Where each section's numbers come from:\n\n" + "\n".join(f"- {d}" for d in sources.described),
    ])


def abstract(sources: Sources, savings, speed, gaps, audit, trust_finding) -> str:
    parts = []
    models = recommend_model(sources.role("capacity"))
    at24 = models[models["capacity_gb"] == 24]
    if len(at24):
        best = at24.loc[at24["n_params"].idxmax()]
        vs = (f", {best['n_params'] / best['base_params']:.1f}x the {parameters_text(best['base_params'])} "
              f"{BASELINE} trains" if best["base_params"] and pd.notna(best["base_params"]) else "")
        verb = "trains" if len(best["methods"]) == 1 else "each train"
        parts.append(f"On a 24 GiB GPU at batch {int(best['batch_size'])}, {_methods(best['methods'])} {verb} "
                     f"a {best['family']} of {parameters_text(best['n_params'])} parameters{vs} (simulated).")
    else:
        parts.append(f"Capacity on a 24 GiB GPU: {NOT_MEASURED}.")
    if len(savings):
        top = savings.sort_values("median").iloc[0]
        parts.append(f"The largest median cut of peak memory is {top['method']}'s, {_pct(top['median'])} "
                     f"against {BASELINE} ({top['tier']}, {top['models']}).")
    if len(speed):
        slow = speed.sort_values("ratio").iloc[0]
        parts.append(f"Measured speed costs run down to {slow['ratio']:.2f}x {BASELINE}'s tokens/s "
                     f"({slow['method']} on {slow['device']}).")
    if len(gaps) and gaps["gap_vs_baseline"].notna().any():
        g = gaps[gaps["gap_vs_baseline"].notna()]
        parts.append(f"At tuned learning rates, {int(_on_par(g).sum())} of {len(g)} method cells end on par "
                     f"with {BASELINE} on tiny models.")
    else:
        parts.append(f"Convergence at tuned learning rates: {NOT_MEASURED}.")
    if len(audit):
        c = audit["verdict"].value_counts()
        parts.append(f"Of {len(audit)} published claims, {c.get('reproduced', 0)} are reproduced, "
                     f"{c.get('reproduced in part', 0)} in part, {c.get('not reproduced', 0)} not, and "
                     f"{c.get('not testable here', 0)} cannot be tested here.")
    parts.append(trust_finding)
    return " ".join(parts)


# ----------------------------------------------------------------------------- figures


# section -> (figure name, role, caption lead)
FIGURE_PLAN = {
    "memory": [("memory_breakdown", "memory")],
    "speed": [("throughput_relative", "speed"), ("throughput_capacity", "capacity")],
    "convergence": [("convergence", "convergence")],
    "capacity": [("model_capacity", "capacity"), ("model_capacity_gpus", "capacity"), ("capacity", "capacity")],
}
# figures drawn only where their rows exist (name -> does this role's summary have them?)
FIGURE_IF = {"model_capacity_gpus": lambda frame: not largest_model_gpus_table(frame).empty}


def draw_figures(sources: Sources, out: Path) -> dict[str, list[str]]:
    """Draw each section's figures from its own rows into out/figures/; section -> markdown."""
    from bench.report import figures as fig
    from bench.report.markdown import caption

    fig.sns.set_theme(style="whitegrid", context="notebook", font_scale=0.9)
    made = {}
    for section, plan in FIGURE_PLAN.items():
        made[section] = []
        for name, role in plan:
            if name in FIGURE_IF and not FIGURE_IF[name](sources.role(role)):
                continue
            build = fig.builders(sources.role(role), sources.curves[role])[name]
            figure = build()
            path = out / "figures" / f"{name}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            figure.savefig(path, dpi=110, bbox_inches="tight")
            fig.plt.close(figure)
            made[section].append(f"![{name}](figures/{name}.png)\n\n*{caption(name)}*")
    return made


# ----------------------------------------------------------------------------- the article


def article(sources: Sources, claims: list[dict], figures: dict[str, list[str]] | None = None) -> str:
    figures = figures or {}
    savings = memory_savings(sources.role("memory"))
    speed = speed_summary(sources.role("speed"))
    gaps = convergence_gaps(sources.role("convergence"))
    audit = claims_audit(sources.everything(), claims)
    trust_finding, trust_body = trust_section(sources)

    def section(title, finding, body, key=None):
        return "\n\n".join([f"## {title}", f"**Finding.** {finding}", *figures.get(key, []), body])

    return "\n\n".join([
        f"# {sources.title}",
        "_Generated by `membench article` from the runs' summaries; do not edit by hand._",
        "## Abstract", abstract(sources, savings, speed, gaps, audit, trust_finding),
        "## Setup", setup_section(sources),
        section("Memory: what each method saves, and where the bytes go", memory_finding(savings),
                memory_section(savings), "memory"),
        section("Speed: what it costs", speed_finding(speed), speed_section(speed), "speed"),
        section("Convergence: does it still learn", convergence_finding(gaps), convergence_section(gaps),
                "convergence"),
        section("Capacity: how far it stretches a GPU", capacity_finding(sources), capacity_section(sources),
                "capacity"),
        "## Recommendations per GPU memory size", recommendations(sources),
        "## The claims audit", claims_section(audit),
        "## How much to trust the numbers", f"**Finding.** {trust_finding}", trust_body,
    ]) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="membench article",
        description="Write the article (article.md, its figures, article.html and, where a renderer "
                    "is installed, article.pdf) from one run's summary or from a manifest of summaries.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--sources", help="manifest naming each section's summaries (e.g. paper/sources.yaml)")
    src.add_argument("--summary", help="one summary.csv for every section (a run's own article)")
    p.add_argument("--curves", help="curves.csv beside --summary (for the convergence figure)")
    p.add_argument("--claims", default="paper/claims.yaml", help="published claims (default: paper/claims.yaml)")
    p.add_argument("--out", required=True, help="folder for article.md, figures/, article.html (and .pdf)")
    p.add_argument("--no-figures", action="store_true", help="skip drawing the figures")
    p.add_argument("--no-pdf", action="store_true", help="skip the PDF even where a renderer is installed")
    args = p.parse_args(argv)
    sources = from_manifest(args.sources) if args.sources else from_summary(args.summary, args.curves)
    claims = yaml.safe_load(Path(args.claims).read_text()) if Path(args.claims).exists() else []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    figures = {} if args.no_figures else draw_figures(sources, out)
    text = article(sources, claims or [], figures)
    write_text_atomic(out / "article.md", text)
    from bench.report import render

    made = render.render(out / "article.md", out / "article.html", None if args.no_pdf else out / "article.pdf")
    print(f"article: {', '.join(str(m) for m in [out / 'article.md', *made])}", file=sys.stderr)
    return 0

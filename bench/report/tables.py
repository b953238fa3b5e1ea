"""Tables from summary.csv: the numbers behind the figures and the report.

Plain pandas, no drawing: `bench.report.figures` draws these tables and `bench.report.markdown` prints them,
so the two always show the same numbers. The baseline is AdamW (`BASELINE`); methods are
ordered baseline first, then alphabetically.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from bench.job import CATEGORIES
from bench.report.aggregate import CURVE_COLUMNS, SUMMARY_COLUMNS

BASELINE = "adamw"
MIB = 2 ** 20
# a memory cell's data-parallel setting (world_size, sharding) keeps sharded rows apart from
# one-GPU rows: a row compares with the baseline under the same setting (`method_label`)
MEMORY_CELL = ["model", "batch_size", "seq_len", "device", "world_size", "sharding"]
THROUGHPUT_CELL = ["model", "batch_size", "seq_len", "device"]
# phase: scratch, pretrain, finetune (aggregate.phase); tuning: fixed or tuned learning rate
# (aggregate.tuning_role; a tuning grid's own runs are not reported: `reported`)
CONVERGENCE_CELL = ["task", "model", "phase", "tuning"]

TEXT_COLUMNS = ["kind", "method", "model", "largest_model", "family", "dtype", "precision", "sharding", "device",
                "device_name", "cpu_id", "memory_tier", "phase", "tuning", "init", "task", "status", "message",
                "commit", "torch_version", "date"]


# ----------------------------------------------------------------------------- data


def _tidy(frame: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    frame = frame.reindex(columns=columns)
    for col in columns:
        if col in TEXT_COLUMNS:
            frame[col] = frame[col].astype("object").where(frame[col].notna(), None)
        elif col != "hparams" and col != "result_file":
            frame[col] = pd.to_numeric(frame[col], errors="coerce")
    # results from before fine-tuning and tuning: from scratch, at a fixed learning rate
    missing = {"status": "unknown", "phase": "scratch", "tuning": "fixed"}
    for col in ("kind", "method", "model", "task", "device", "status", "phase", "tuning"):
        if col in frame:
            frame[col] = frame[col].fillna(missing.get(col, "?")).astype(str)
    return one_rank_defaults(frame)


def one_rank_defaults(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with `world_size`, `sharding` and `precision` filled where missing (rows from
    before data parallelism: one rank, no sharding; before the precision field: pure), so
    that they key cells."""
    if all(col in frame and frame[col].notna().all() for col in ("world_size", "sharding", "precision")):
        return frame
    frame = frame.copy()
    frame["world_size"] = (frame["world_size"] if "world_size" in frame else pd.Series(1, index=frame.index)
                           ).fillna(1).astype(int)
    for col, default in (("sharding", "none"), ("precision", "pure")):
        frame[col] = (frame[col] if col in frame else pd.Series(default, index=frame.index)
                      ).astype("object").where(lambda c: c.notna(), default).astype(str)
    return frame


def dtype_text(dtype: str, precision: str) -> str:
    """A cell's dtype as tables and titles name it, with its precision where not pure
    ('bfloat16', 'bfloat16 mixed')."""
    return dtype if precision == "pure" else f"{dtype} {precision}"


def method_label(method: str, world_size=1, sharding="none") -> str:
    """A row's method as tables and figures name it: the method, and under data parallelism
    its scheme and ranks ("adamw [fsdp x2]"; DDP-style replicas: "adamw [ddp x2]")."""
    world_size = 1 if world_size is None or pd.isna(world_size) else int(world_size)
    sharding = sharding if isinstance(sharding, str) else "none"
    if world_size == 1 and sharding == "none":
        return method
    return f"{method} [{'ddp' if sharding == 'none' else sharding} x{world_size}]"


def read_summary(path: str | Path) -> pd.DataFrame:
    """summary.csv with every column of `SUMMARY_COLUMNS`, numbers as numbers."""
    return _tidy(pd.read_csv(path), SUMMARY_COLUMNS)


def read_curves(path: str | Path | None) -> pd.DataFrame:
    """curves.csv (or an empty frame when there is none)."""
    if path is None or not Path(path).exists():
        return _tidy(pd.DataFrame(columns=CURVE_COLUMNS), CURVE_COLUMNS)
    return _tidy(pd.read_csv(path), CURVE_COLUMNS)


PHASES = {"scratch": "", "pretrain": "pre-training", "finetune": "fine-tuning"}


def task_label(task: str, phase: str, tuning: str = "fixed") -> str:
    """A convergence cell's task as the report and the figures name it: the task, how its
    model started unless from scratch, and whether each method ran at its tuned learning
    rate ("markov_shift, fine-tuning, tuned lr")."""
    parts = [task] + ([PHASES[phase]] if PHASES.get(phase) else []) + (["tuned lr"] if tuning == "tuned" else [])
    return ", ".join(parts)


def reported(frame: pd.DataFrame) -> pd.DataFrame:
    """The convergence rows (of summary or curves) that report a method: all but a tuning
    grid's runs, which only choose the learning rate of the reported ones."""
    return frame[frame["tuning"] != "grid"]


def method_order(methods) -> list[str]:
    """The baseline first, then alphabetical."""
    methods = sorted({str(m) for m in methods})
    return ([BASELINE] if BASELINE in methods else []) + [m for m in methods if m != BASELINE]


def model_order(summary: pd.DataFrame, models=None) -> list[str]:
    """Models by family, then size (n_params), then name: llama-60m before llama-1b."""
    models = set(summary["model"]) if models is None else set(models)
    size = summary.groupby("model")["n_params"].max() if len(summary) else pd.Series(dtype=float)
    fam = summary.groupby("model")["family"].first() if len(summary) else pd.Series(dtype=object)

    def key(m):
        f = fam.get(m)
        n = size.get(m)
        return (str(f) if isinstance(f, str) else str(m).split("-")[0],
                float(n) if n is not None and pd.notna(n) else np.inf, str(m))

    return sorted(models, key=key)


def status_text(statuses) -> str:
    """'ok' when every job is ok; else e.g. 'oom' or 'ok 2/3, diverged 1'."""
    counts = pd.Series(list(statuses), dtype=object).value_counts()
    if list(counts.index) == ["ok"]:
        return "ok"
    if "ok" not in counts.index:
        return ", ".join(s if n == 1 else f"{s} x{n}" for s, n in counts.items())
    total = int(counts.sum())
    return ", ".join(f"{s} {n}/{total}" for s, n in counts.items())


def first_message(messages) -> str:
    for m in messages:
        if isinstance(m, str) and m.strip():
            return m.strip()
    return ""


def geomean(values) -> float:
    values = np.asarray([v for v in values if pd.notna(v) and v > 0], dtype=float)
    return float(np.exp(np.log(values).mean())) if len(values) else np.nan


def group_cells(frame: pd.DataFrame, keys: list[str]):
    """Group by `keys` keeping missing values, in a stable order."""
    return frame.groupby(keys, dropna=False, sort=True)


def _pct_vs_baseline(table: pd.DataFrame, cell: list[str], column: str) -> np.ndarray:
    """% change of `column` vs the baseline's row of the same cell (NaN without one, or
    where the baseline's value is 0)."""
    base = table[table["method"] == BASELINE].set_index(cell)[column]
    base_value = np.asarray(table.set_index(cell).index.map(lambda k: base.get(k, np.nan)), float)
    with np.errstate(divide="ignore", invalid="ignore"):
        pct = (table[column].to_numpy(float) / base_value - 1.0) * 100.0
    return np.where(np.isfinite(pct), pct, np.nan)


def memory_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (memory cell, method): status, peak and categories in MiB (mean over ok
    seeds), and the change of peak vs the baseline in the same cell (in %)."""
    mem = one_rank_defaults(summary[summary["kind"] == "memory"])
    cols = MEMORY_CELL + ["method", "label", "micro_batches", "memory_tier", "tiers_agree", "device_name",
                          "status", "message", "n_jobs", "n_ok", "peak_mib", "pct_vs_baseline"] + \
        [f"{c}_mib" for c in CATEGORIES] + ["sharding_mib", "max_rank_peak_mib"]
    rows = []
    for key, g in group_cells(mem, MEMORY_CELL + ["method"]):
        ok = g[g["status"] == "ok"]
        row = dict(zip(MEMORY_CELL + ["method"], key))
        tiers = sorted(set(ok["memory_tier"].dropna()))
        row.update(label=method_label(row["method"], row["world_size"], row["sharding"]),
                   micro_batches=g["micro_batches"].max(),
                   memory_tier=", ".join(sorted(set(g["memory_tier"].dropna()))) or None,
                   # tiers that measured the same cell (a sharded run and its simulated twin):
                   # whether they gave the same peak (None: one tier)
                   tiers_agree=bool(ok["peak_bytes"].nunique() == 1) if len(tiers) > 1 else None,
                   device_name=first_message(g["device_name"]) or None,
                   status=status_text(g["status"]), message=first_message(g["message"]),
                   n_jobs=len(g), n_ok=len(ok),
                   peak_mib=ok["peak_bytes"].mean() / MIB if len(ok) else np.nan)
        for c in CATEGORIES:
            row[f"{c}_mib"] = ok[f"{c}_bytes"].mean() / MIB if len(ok) else np.nan
        row["sharding_mib"] = ok["sharding_bytes"].mean() / MIB if len(ok) else np.nan
        row["max_rank_peak_mib"] = ok["max_rank_peak_bytes"].mean() / MIB if len(ok) else np.nan
        rows.append(row)
    table = pd.DataFrame(rows, columns=cols)
    if table.empty:
        return table
    table["pct_vs_baseline"] = _pct_vs_baseline(table, MEMORY_CELL, "peak_mib")
    return table


def throughput_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (throughput cell, method): tokens/s and step-time quartiles (mean over
    ok seeds), and the paired ratio to the job's baseline (the method's tokens/s over the
    baseline's, timed side by side in the same process: bench.measure.timing) with its 95%
    interval (`ratio_lo`..`ratio_hi`, docs/speed.md). `has_baseline` is False where no ok
    job gave a paired ratio."""
    thr = summary[summary["kind"] == "throughput"]
    cols = THROUGHPUT_CELL + ["method", "baseline", "micro_batches", "status", "message", "n_jobs",
                              "n_ok", "tokens_per_s", "baseline_tokens_per_s", "step_median_s",
                              "step_q1_s", "step_q3_s", "has_baseline", "ratio", "ratio_lo",
                              "ratio_hi"]
    rows = []
    for key, g in group_cells(thr, THROUGHPUT_CELL + ["method"]):
        ok = g[g["status"] == "ok"]
        row = dict(zip(THROUGHPUT_CELL + ["method"], key))
        row.update(baseline=first_message(g["baseline"]) if "baseline" in g else None,
                   micro_batches=g["micro_batches"].max(), status=status_text(g["status"]),
                   message=first_message(g["message"]), n_jobs=len(g), n_ok=len(ok),
                   tokens_per_s=ok["tokens_per_s"].mean(),
                   baseline_tokens_per_s=ok["baseline_tokens_per_s"].mean(),
                   step_median_s=ok["step_time_median_s"].mean(),
                   step_q1_s=ok["step_time_q1_s"].mean(), step_q3_s=ok["step_time_q3_s"].mean(),
                   ratio=ok["throughput_ratio"].mean(), ratio_lo=ok["throughput_ratio_lo"].mean(),
                   ratio_hi=ok["throughput_ratio_hi"].mean())
        rows.append(row)
    table = pd.DataFrame(rows, columns=cols)
    table["has_baseline"] = np.isfinite(table["ratio"].to_numpy(dtype=float))
    return table


def convergence_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (task, model, phase, tuning, method) of the reported runs: the learning
    rate, final loss mean and std over ok seeds, the loss floor (NaN: none known), the gap
    to it and to the baseline's mean final loss with a 95% interval (t, over the seeds both
    ran: `gap_lo`..`gap_hi`), and steps to the target loss (mean over the seeds that reached
    it, `n_reached` of `n_ok`)."""
    conv = reported(summary[summary["kind"] == "convergence"])
    cols = CONVERGENCE_CELL + ["method", "batch_size", "seq_len", "steps", "lr", "status", "message",
                               "n_jobs", "n_ok", "final_loss_mean", "final_loss_std",
                               "loss_floor", "gap_to_floor", "gap_vs_baseline", "gap_lo", "gap_hi",
                               "target_loss", "steps_to_target", "n_reached"]
    rows = []
    for key, g in group_cells(conv, CONVERGENCE_CELL + ["method"]):
        ok = g[g["status"] == "ok"]
        floors = conv[(conv["task"] == key[0]) & (conv["model"] == key[1])]["loss_floor"]
        row = dict(zip(CONVERGENCE_CELL + ["method"], key))
        row.update(batch_size=g["batch_size"].max(), seq_len=g["seq_len"].max(),
                   steps=g["steps"].max(), status=status_text(g["status"]),
                   message=first_message(g["message"]), n_jobs=len(g), n_ok=len(ok),
                   final_loss_mean=ok["final_loss"].mean() if len(ok) else np.nan,
                   final_loss_std=ok["final_loss"].std(ddof=1) if len(ok) > 1 else np.nan,
                   loss_floor=floors.dropna().mean() if floors.notna().any() else np.nan,
                   lr=ok["lr"].iloc[0] if ok["lr"].nunique() == 1 else np.nan,
                   target_loss=g["target_loss"].max(), steps_to_target=ok["steps_to_target"].mean(),
                   n_reached=int(ok["steps_to_target"].notna().sum()))
        row.update(_gap_interval(conv, row))
        rows.append(row)
    table = pd.DataFrame(rows, columns=cols)
    if table.empty:
        return table
    table["gap_to_floor"] = table["final_loss_mean"] - table["loss_floor"]
    base = table[table["method"] == BASELINE].set_index(CONVERGENCE_CELL)["final_loss_mean"]
    base_loss = np.asarray(table.set_index(CONVERGENCE_CELL).index.map(
        lambda k: base.get(k, np.nan)), dtype=float)
    table["gap_vs_baseline"] = table["final_loss_mean"].to_numpy(dtype=float) - base_loss
    return table


# Student's t 0.975 quantile for 1..30 degrees of freedom (the last serves more)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042)


def _gap_interval(conv: pd.DataFrame, cell: dict) -> dict:
    """The 95% interval of a method's final loss minus the baseline's in one cell, paired
    by seed (t over the seeds both ran ok; NaN with fewer than two)."""
    ok = conv[(conv["status"] == "ok") & np.logical_and.reduce(
        [(conv[k] == cell[k]).to_numpy() for k in CONVERGENCE_CELL])]
    mine = ok[ok["method"] == cell["method"]].groupby("seed")["final_loss"].mean()
    base = ok[ok["method"] == BASELINE].groupby("seed")["final_loss"].mean()
    diff = (mine - base).dropna()
    if len(diff) < 2:
        return {"gap_lo": np.nan, "gap_hi": np.nan}
    half = T975[min(len(diff) - 1, len(T975)) - 1] * diff.std(ddof=1) / np.sqrt(len(diff))
    return {"gap_lo": diff.mean() - half, "gap_hi": diff.mean() + half}


def tuning_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The tuning grids: one row per (cell, method, learning rate) of the grid runs, with
    the mean final loss over the tuning seeds (NaN if one failed), their statuses, and
    whether the protocol chose that rate (the rate its reported runs ran at)."""
    conv = summary[summary["kind"] == "convergence"]
    grid, tuned = conv[conv["tuning"] == "grid"], conv[conv["tuning"] == "tuned"]
    cell = [k for k in CONVERGENCE_CELL if k != "tuning"]
    cols = cell + ["method", "lr", "n_jobs", "n_ok", "final_loss_mean", "steps_to_target", "status", "chosen"]
    chosen = set(map(tuple, tuned[cell + ["method", "lr"]].dropna().to_numpy().tolist()))
    rows = []
    for key, g in group_cells(grid, cell + ["method", "lr"]):
        ok = g[g["status"] == "ok"]
        rows.append({**dict(zip(cell + ["method", "lr"], key)), "n_jobs": len(g), "n_ok": len(ok),
                     "final_loss_mean": ok["final_loss"].mean() if len(ok) == len(g) else np.nan,
                     "steps_to_target": ok["steps_to_target"].mean(), "status": status_text(g["status"]),
                     "chosen": tuple(key) in chosen})
    return pd.DataFrame(rows, columns=cols)


def overview_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (method, model), baseline excluded: peak-memory ratio and throughput
    ratio vs the baseline (with the paired ratio's 95% interval, `thr_lo`..`thr_hi`), each
    a geometric mean over that model's cells (batch sizes), and
    a note on cells that could not be compared (a failed job, no baseline)."""
    mem, thr = memory_table(summary), throughput_table(summary)
    rows = []
    pairs = set()
    for t in (mem, thr):
        pairs |= set(zip(t["method"], t["model"])) if len(t) else set()
    for method, model in sorted(pairs):
        if method == BASELINE:
            continue
        m = mem[(mem["method"] == method) & (mem["model"] == model)] if len(mem) else mem
        t = thr[(thr["method"] == method) & (thr["model"] == model)] if len(thr) else thr
        mem_ratio = geomean(1.0 + m["pct_vs_baseline"] / 100.0) if len(m) else np.nan
        thr_ratio = geomean(t["ratio"]) if len(t) else np.nan
        thr_lo = geomean(t["ratio_lo"]) if len(t) else np.nan
        thr_hi = geomean(t["ratio_hi"]) if len(t) else np.nan
        notes = []
        for kind, part, value in (("memory", m, "pct_vs_baseline"), ("throughput", t, "ratio")):
            if not len(part):
                notes.append(f"no {kind} job")
                continue
            bad = part[part[value].isna()]
            if len(bad):
                why = sorted(set(s for s in bad["status"] if s != "ok")) or ["no ok baseline"]
                notes.append(f"{kind}: {len(bad)}/{len(part)} cells not compared "
                             f"({', '.join(why)})")
        rows.append(dict(method=method, model=model, mem_ratio=mem_ratio, thr_ratio=thr_ratio,
                         thr_lo=thr_lo, thr_hi=thr_hi, note="; ".join(notes)))
    return pd.DataFrame(rows, columns=["method", "model", "mem_ratio", "thr_ratio", "thr_lo",
                                       "thr_hi", "note"])


MODEL_CAPACITY_CELL = ["family", "seq_len", "dtype", "precision", "memory_tier", "batch_size", "capacity_gb"]


def capacity_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (method, model, memory size) of the capacity jobs: the largest batch
    that fits (0: none; `at_max_batch`: the search's cap fitted, so at least that)."""
    cap = summary[summary["kind"] == "capacity"]
    cols = ["method", "model", "family", "n_params", "seq_len", "dtype", "memory_tier",
            "capacity_gb", "largest_batch", "at_max_batch", "micro_batches", "status", "message"]
    return cap.reindex(columns=cols).reset_index(drop=True)


def parameters_text(n) -> str:
    """A parameter count for people: '3.49 M', '1.56 B' ('none' for 0)."""
    return "none" if not n or n <= 0 else (f"{n / 1e9:.3g} B" if n >= 1e9 else f"{n / 1e6:.3g} M")


def one_gpu(frame: pd.DataFrame) -> pd.Series:
    """Rows of one GPU: world_size 1, no sharding (rows from before data parallelism too)."""
    frame = one_rank_defaults(frame)
    return (frame["world_size"] == 1) & (frame["sharding"] == "none")


def largest_model_table(summary: pd.DataFrame) -> pd.DataFrame:
    """One row per (family, sequence, dtype, tier, batch, memory size, method) of the
    one-GPU model_capacity jobs: the largest size of the family that trains at that batch
    (`largest_model`, None and `n_params` 0 when not even the first size does;
    `at_ladder_top`: the ladder's largest size fits, so at least that), from the size the
    ladder starts at (`model`); `pct_vs_baseline` compares parameters with AdamW's. The
    same search per GPU of several (world_size > 1, or a sharding scheme) is
    `largest_model_gpus_table`'s."""
    cap = one_rank_defaults(summary[summary["kind"] == "model_capacity"])
    cap = cap[one_gpu(cap)]
    cols = MODEL_CAPACITY_CELL + ["world_size", "sharding", "method", "model", "largest_model", "n_params",
                                  "at_ladder_top", "status", "message"]
    out = cap.reindex(columns=cols).reset_index(drop=True)
    out["n_params"] = out["n_params"].where(out["status"] == "ok")
    out["pct_vs_baseline"] = _pct_vs_baseline(out, MODEL_CAPACITY_CELL, "n_params") if len(out) else []
    return out


# a cell of the search per GPU of several: the family's ladder at one batch per GPU (the
# ladders may start at different sizes, and the tiers differ by scheme)
GPUS_CELL = ["family", "batch_size", "seq_len", "dtype", "precision"]
SCHEMES = {"none": "one GPU", "fsdp": "FSDP2", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}


def scheme_name(sharding: str, world_size=2) -> str:
    """A data-parallel scheme as people name it: 'FSDP2', 'ZeRO-3'; replicas of more than
    one GPU are 'DDP (replicas)'."""
    if sharding == "none":
        return "one GPU" if world_size == 1 else "DDP (replicas)"
    return SCHEMES.get(sharding, str(sharding))


def largest_model_gpus_table(summary: pd.DataFrame) -> pd.DataFrame:
    """The model_capacity search per GPU of several (docs/sharding.md): one row per (cell
    `GPUS_CELL`, method, scheme `sharding`, GPU count `world_size`, memory size), for the
    cells and methods that have rows with world_size > 1 or a scheme, and beside them the
    same method's one-GPU answer (world_size 1, sharding none), which every scheme of the
    method starts from. Columns as `largest_model_table`'s (no `pct_vs_baseline`), plus
    `world_size`, `sharding` and `label` ("adamw [fsdp x8]"). Where a setting has more
    than one row (ladders from different starts, a rerun), its largest ok answer counts.
    Empty without such rows."""
    cols = GPUS_CELL + ["method", "sharding", "world_size", "capacity_gb", "label", "memory_tier", "model",
                        "largest_model", "n_params", "at_ladder_top", "status", "message"]
    cap = one_rank_defaults(summary[summary["kind"] == "model_capacity"])
    if cap.empty:
        return pd.DataFrame(columns=cols)
    single = one_gpu(cap)
    sharded = cap[~single]
    if sharded.empty:
        return pd.DataFrame(columns=cols)
    wanted = sharded[GPUS_CELL + ["method"]].drop_duplicates()
    rows = pd.concat([sharded, cap[single].merge(wanted, on=GPUS_CELL + ["method"])], ignore_index=True)
    rows = rows.assign(n_params=rows["n_params"].where(rows["status"] == "ok"),
                       _ok=rows["status"] == "ok", _n=rows["n_params"].fillna(-1))
    key = GPUS_CELL + ["method", "sharding", "world_size", "capacity_gb"]
    rows = (rows.sort_values(["_ok", "_n"], ascending=False, kind="stable")
            .drop_duplicates(key).reset_index(drop=True))
    rows["label"] = [method_label(m, w, s) for m, w, s in zip(rows["method"], rows["world_size"], rows["sharding"])]
    methods = method_order(rows["method"])
    schemes = list(SCHEMES)
    rows = rows.assign(_m=rows["method"].map(methods.index),
                       _s=rows["sharding"].map(lambda s: schemes.index(s) if s in schemes else len(schemes)))
    rows = rows.sort_values(GPUS_CELL + ["_m", "_s", "world_size", "capacity_gb"], kind="stable")
    return rows.reindex(columns=cols).reset_index(drop=True)


def largest_model_text(row) -> str:
    """One search's answer as text: its parameters ('1.5 B'; '>= 65.3 B' at the ladder's
    top; 'none': not even the first size), or the status of a search that failed."""
    if row["status"] != "ok":
        return str(row["status"])
    if not row["n_params"] or pd.isna(row["n_params"]) or row["n_params"] <= 0:
        return "none"
    return (">= " if row["at_ladder_top"] == 1 else "") + parameters_text(row["n_params"])


def largest_model_gpus_text(summary: pd.DataFrame) -> pd.DataFrame:
    """`largest_model_gpus_table` for a report: one row per (cell, method, scheme, GPU
    count), a column per memory size ("24 GiB") with the largest model that trains on
    each GPU as text (`largest_model_text`), and `scheme` named as people name it. The
    one-GPU row (scheme 'one GPU') is each method's first."""
    table = largest_model_gpus_table(summary)
    sizes = sorted(table["capacity_gb"].dropna().unique())
    lead = GPUS_CELL + ["method", "scheme", "world_size", "memory_tier", "model"]
    cols = lead + [f"{gb:g} GiB" for gb in sizes]
    rows = []
    for key, g in table.groupby(GPUS_CELL + ["method", "sharding", "world_size"], sort=False, dropna=False):
        *cell, method, sharding, world_size = key
        by_size = g.set_index("capacity_gb")
        rows.append(dict(zip(GPUS_CELL, cell), method=method, scheme=scheme_name(sharding, world_size),
                         world_size=int(world_size),
                         memory_tier=", ".join(sorted(set(g["memory_tier"].dropna()))) or None,
                         model=", ".join(sorted(set(g["model"].dropna()))) or None,
                         **{f"{gb:g} GiB": largest_model_text(by_size.loc[gb]) if gb in by_size.index else None
                            for gb in sizes}))
    return pd.DataFrame(rows, columns=cols)


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _up_to(row) -> str:
    """A search's answer in a sentence: 'up to 13 B', 'at least 65.3 B (the ladder's top)',
    'no size of the ladder from llama-1b', 'no answer (error)'."""
    if row["status"] != "ok":
        return f"no answer ({row['status']})"
    if not row["n_params"] or pd.isna(row["n_params"]) or row["n_params"] <= 0:
        return f"no size of the ladder from {row['model']}"
    if row["at_ladder_top"] == 1:
        return f"at least {parameters_text(row['n_params'])} (the ladder's top)"
    return f"up to {parameters_text(row['n_params'])}"


def largest_model_gpus_finding(summary: pd.DataFrame, gb: float = 24) -> str | None:
    """One sentence per cell, from the data: what the baseline (else the first method)
    trains with `gb` GiB per GPU (else the memory size nearest it), on one GPU and under
    each scheme at each GPU count ("With 24 GiB per GPU (llama at batch 8 per GPU, seq
    512, bfloat16), adamw trains up to 1.2 B on one GPU (simulated); under FSDP2
    (simulated), up to 13 B on 8 GPUs and at least 65.3 B (the ladder's top) on 64").
    None without rows of more than one GPU."""
    table = largest_model_gpus_table(summary)
    if table.empty:
        return None
    out = []
    for cell, g in table.groupby(GPUS_CELL, sort=True, dropna=False):
        sizes = sorted(g["capacity_gb"].dropna().unique())
        size = min(sizes, key=lambda s: (abs(s - gb), s))
        g = g[g["capacity_gb"] == size]
        method = BASELINE if BASELINE in set(g["method"]) else method_order(g["method"])[0]
        g = g[g["method"] == method]
        family, batch, seq, dtype, precision = cell
        dtype = dtype_text(dtype, precision)
        one = g[(g["world_size"] == 1) & (g["sharding"] == "none")]
        parts = [f"{method} trains {_up_to(one.iloc[0])} on one GPU ({one['memory_tier'].iloc[0]})"
                 if len(one) else f"{method} on one GPU: not searched"]
        for sharding, h in g[g["sharding"] != "none"].groupby("sharding", sort=False):
            h = h.sort_values("world_size").to_dict("records")
            tier = ", ".join(sorted({r["memory_tier"] for r in h if isinstance(r["memory_tier"], str)}))
            said = {}  # an answer -> the GPU counts that gave it (in order): "none ... on 2 and 4 GPUs"
            for r in h:
                said.setdefault(_up_to(r), []).append(str(int(r["world_size"])))
            steps = [f"{answer} on {_and(ws)}" + (" GPUs" if i == 0 else "")
                     for i, (answer, ws) in enumerate(said.items())]
            parts.append(f"under {scheme_name(sharding)} ({tier}), {_and(steps)}")
        if ((g["sharding"] == "none") & (g["world_size"] > 1)).any():
            parts.append("as DDP replicas, what one GPU trains")
        out.append(f"With {size:g} GiB per GPU ({family} at batch {int(batch)} per GPU, seq {int(seq)}, "
                   f"{dtype}), " + "; ".join(parts) + ".")
    return " ".join(out)


def simulation_accuracy_table(summary: pd.DataFrame) -> pd.DataFrame:
    """Simulated predictions beside GPU measurements of the same cell (method, model,
    batch, sequence, dtype): measured / simulated peak allocated bytes, and measured /
    predicted reserved bytes. Empty until a GPU has run cells the simulation also ran."""
    keys = ["method", "model", "batch_size", "seq_len", "dtype", "world_size", "sharding"]
    mem = one_rank_defaults(summary[(summary["kind"] == "memory") & (summary["status"] == "ok")])
    sim = mem[mem["memory_tier"] == "simulated"].groupby(keys)[["peak_bytes", "reserved_peak_bytes"]].mean()
    gpu = mem[mem["memory_tier"] == "measured"]
    gpu = gpu.groupby(keys).agg(peak_bytes=("peak_bytes", "mean"),
                                reserved_peak_bytes=("reserved_peak_bytes", "mean"),
                                device_name=("device_name", "first"))
    both = sim.join(gpu, lsuffix="_simulated", rsuffix="_measured", how="inner").reset_index()
    both["allocated_ratio"] = both["peak_bytes_measured"] / both["peak_bytes_simulated"]
    both["reserved_ratio"] = both["reserved_peak_bytes_measured"] / both["reserved_peak_bytes_simulated"]
    return both


def _paired(frame: pd.DataFrame, method: str, versus: str, keys: list[str], value: str) -> pd.DataFrame:
    """Rows of `method` and `versus` with status ok, side by side on `keys` (value_m, value_v)."""
    ok = frame[frame["status"] == "ok"]
    # a cell measured by more than one suite (adamw's convergence in quick and optimizers)
    # counts once: the mean of its runs
    mine = ok[ok["method"] == method].groupby(keys, dropna=False)[value].mean()
    theirs = ok[ok["method"] == versus].groupby(keys, dropna=False)[value].mean()
    return pd.concat({"m": mine, "v": theirs}, axis=1, join="inner").dropna().reset_index()


def _setup_text(rows: pd.DataFrame, summary: pd.DataFrame, kind: str) -> str:
    part = summary[(summary["kind"] == kind) & summary["model"].isin(rows["model"])]
    models = ", ".join(model_order(part, rows["model"].unique()))
    shape = ""
    if "batch_size" in rows:
        shape = f"; batch {', '.join(str(int(b)) for b in sorted(rows['batch_size'].unique()))}"
    if "task" in rows:
        shape = f"; tasks {', '.join(sorted(rows['task'].unique()))}"
    tiers = ", ".join(sorted(part["memory_tier"].dropna().unique())) if kind == "memory" else ""
    devices = ", ".join(sorted(part["device"].dropna().unique()))
    return f"{models}{shape}; {devices}{' ' + tiers if tiers else ''}"


def _change_range(pairs: pd.DataFrame) -> tuple[str, int]:
    change = 100 * (pairs["m"] / pairs["v"] - 1)
    return f"{change.min():+.1f}% to {change.max():+.1f}%", len(pairs)


def _ratio_range(pairs: pd.DataFrame) -> tuple[str, int]:
    ratio = pairs["m"] / pairs["v"]
    return f"{ratio.min():.2f} to {ratio.max():.2f}", len(pairs)


def _gap_by_task(pairs: pd.DataFrame) -> tuple[str, int]:
    gaps = (pairs.assign(gap=pairs["m"] - pairs["v"])
            .groupby(CONVERGENCE_CELL, dropna=False)["gap"].agg(["mean", "std", "count"]))
    text = "; ".join(f"{task_label(task, phase, tuning)} {g['mean']:+.3f} ± {g['std']:.3f} (n={int(g['count'])})"
                     for (task, _model, phase, tuning), g in gaps.iterrows())
    return text, len(gaps)


def _capacity_ratio(nothing: str, example):
    """A summary of capacity pairs: the range of ratios, then each pair (`example(row)`);
    pairs where the baseline fits nothing are left out (`nothing` if that is all)."""
    def summarise(pairs: pd.DataFrame) -> tuple[str, int]:
        pairs = pairs[pairs["v"] > 0]
        if pairs.empty:
            return nothing, 0
        ratio = pairs["m"] / pairs["v"]
        examples = "; ".join(example(r) for r in pairs.sort_values(["model", "capacity_gb"]).itertuples())
        return f"{ratio.min():.2f}x to {ratio.max():.2f}x ({examples})", len(pairs)
    return summarise


# metric -> (kind of job, value compared, cell the two methods share, summary of the pairs)
CLAIM_METRICS = {
    # one GPU and each data-parallel setting apart (a sharded search's answer is per GPU of N)
    "largest_model_ratio": ("model_capacity", "n_params_inside_ladder", ["model", "seq_len", "dtype", "precision",
                                                           "memory_tier", "batch_size", "capacity_gb",
                                                           "world_size", "sharding"],
                            _capacity_ratio("the baseline trains no size of the ladder", lambda r: (
                                f"{r.capacity_gb:g} GiB from {r.model} at batch {int(r.batch_size)}"
                                + ("" if r.world_size == 1 and r.sharding == "none" else
                                   f" [{'ddp' if r.sharding == 'none' else r.sharding} x{int(r.world_size)}]")
                                + f": {parameters_text(r.v)} -> {parameters_text(r.m)}"))),
    "largest_batch_ratio": ("capacity", "largest_batch", ["model", "seq_len", "dtype", "precision",
                                                           "memory_tier", "capacity_gb"],
                            _capacity_ratio("the baseline fits no batch", lambda r: (
                                f"{r.capacity_gb:g} GiB {r.model}: {int(r.v)} -> {int(r.m)}"))),
    "peak_memory_change": ("memory", "peak_bytes", MEMORY_CELL, _change_range),
    "state_memory_change": ("memory", "state_bytes", MEMORY_CELL, _change_range),
    "optimizer_memory_change": ("memory", "optimizer_bytes", MEMORY_CELL, _change_range),
    "throughput_ratio": ("throughput", "tokens_per_s", THROUGHPUT_CELL + ["seed"], _ratio_range),
    "final_loss_gap": ("convergence", "final_loss", CONVERGENCE_CELL + ["seed"], _gap_by_task),
}


def claim_table(summary: pd.DataFrame, claims: list[dict]) -> pd.DataFrame:
    """Each published claim beside what our results say for the same comparison.

    Metrics: `largest_batch_ratio` and `largest_model_ratio` (largest batch, or parameters
    of the largest model, divided by the other method's, per memory size; model pairs
    where either answer is the ladder's top are left out), `peak_memory_change` and
    `state_memory_change` (% change of peak bytes, or of param + grad + optimizer bytes
    at the peak, per memory cell), `throughput_ratio`
    (per throughput cell), `final_loss_gap` (final loss minus the other method's, paired by
    seed, per task and model). `ours` gives the range over cells; `n` counts them. A claim
    is compared on one GPU's cells, or, where it names a `sharding` (a claim made on
    several GPUs), on the cells of several GPUs under that scheme only.
    """
    frame = _claim_frame(summary)
    rows = []
    for c in claims:
        if c["metric"] not in CLAIM_METRICS:
            raise ValueError(f"unknown claim metric {c['metric']!r}; known: {', '.join(CLAIM_METRICS)}")
        kind, _, _, summarise = CLAIM_METRICS[c["metric"]]
        pairs = _claim_pairs_in(frame, c)
        ours, n = summarise(pairs) if len(pairs) else ("no results", 0)
        setup = _setup_text(pairs, summary, kind) if len(pairs) else ""
        rows.append({**c, "ours": ours, "our_setup": setup, "n": n})
    return pd.DataFrame(rows, columns=["method", "versus", "sharding", "metric", "claim", "ours", "setup",
                                       "our_setup", "source", "n"])


def claim_pairs(summary: pd.DataFrame, claim: dict) -> pd.DataFrame:
    """The cells behind one claim's `ours` in `claim_table`: the claim's method (`m`) and
    the method it is compared with (`v`) side by side on the metric's cell keys."""
    return _claim_pairs_in(_claim_frame(summary), claim)


def _claim_pairs_in(frame: pd.DataFrame, claim: dict) -> pd.DataFrame:
    """`claim_pairs` on a frame `_claim_frame` made."""
    kind, value, keys, _ = CLAIM_METRICS[claim["metric"]]
    frame = _claim_scope(frame, claim)
    return _paired(reported(frame[frame["kind"] == kind]), claim["method"], claim["versus"], keys, value)


def _claim_frame(summary: pd.DataFrame) -> pd.DataFrame:
    """`summary` with the values claims compare that are not its own columns."""
    frame = one_rank_defaults(summary.copy())
    frame["state_bytes"] = frame[["param_bytes", "grad_bytes", "optimizer_bytes"]].sum(axis=1, min_count=3)
    # an answer at the ladder's top is only a lower bound: such pairs say nothing of the ratio
    frame["n_params_inside_ladder"] = frame["n_params"].where(frame["at_ladder_top"] != 1)
    return frame


def _claim_scope(frame: pd.DataFrame, claim: dict) -> pd.DataFrame:
    """The rows a claim is compared on: one GPU's, or, where the claim names a `sharding`,
    those of several GPUs under that scheme."""
    scheme = claim.get("sharding")
    if scheme is None:
        return frame[(frame["world_size"] == 1) & (frame["sharding"] == "none")]
    if scheme == "none" or scheme not in SCHEMES:
        raise ValueError(f"claim {claim['method']} vs {claim['versus']}: key sharding is {scheme!r}; "
                         f"one of {', '.join(s for s in SCHEMES if s != 'none')}, or none for one GPU")
    return frame[(frame["world_size"] > 1) & (frame["sharding"] == scheme)]

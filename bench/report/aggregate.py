"""Result files -> tidy tables: `summary.csv` (one row per job; a capacity or
model_capacity job gives one row per memory size) and `curves.csv` (one row per convergence step). The README
documents every column.

A file that cannot be read as a result (truncated, not JSON, another `schema_version`, a
field missing: `bench.recovery.read_result`) is left out with a line on stderr naming it
and why; the tables and figures are made from the rest."""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import pandas as pd

from bench import estimate, tuning
from bench.errors import first_line
from bench.measure import records as results
from bench.models import family
from bench.recovery import UnreadableResult, read_result

SUMMARY_COLUMNS = [
    "kind", "method", "model", "family", "n_params", "trainable_params", "batch_size", "micro_batches", "seq_len",
    "dtype", "precision", "world_size", "sharding", "device", "device_name", "cpu_id", "memory_tier", "capacity_gb",
    "peak_bytes", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "other_bytes",
    "sharding_bytes", "max_rank_peak_bytes", "collective_bytes",
    "host_peak_bytes", "transfer_bytes", "first_step_peak_bytes", "reserved_peak_bytes", "alloc_retries",
    "tokens_per_s", "baseline",
    "baseline_tokens_per_s", "throughput_ratio", "throughput_ratio_lo", "throughput_ratio_hi",
    "step_time_median_s", "step_time_q1_s", "step_time_q3_s", "largest_batch", "at_max_batch",
    "largest_model", "at_ladder_top", "flops", "bytes_moved", "ops", "flops_forward",
    "flops_backward", "flops_optimizer", "est_h100_step_time_s", "est_h100_tokens_per_s",
    "est_h100_calibrated", "est_h100_transfer_s", "est_h100_step_time_serial_s", "est_h100_step_time_overlap_s",
    "est_h100_collective_s", "phase", "init", "task", "steps", "lr", "tuning", "final_loss", "loss_floor",
    "target_loss", "steps_to_target", "tokens_to_target", "status",
    "message", "seed", "commit", "torch_version", "date", "wall_time_s", "hparams", "result_file",
]
CURVE_COLUMNS = ["method", "model", "phase", "tuning", "task", "seed", "batch_size", "seq_len", "step", "wall_s",
                 "loss", "loss_floor", "status"]


def summary_row(record: dict, path: str) -> dict:
    job, prov = record["job"], record.get("provenance", {})
    mem, thr = record.get("memory", {}), record.get("throughput", {})
    hp = record.get("hparams", {})
    shard = record.get("sharding") or {}  # one rank's data-parallel part (bench.measure.kinds)
    return {
        "kind": job["kind"], "method": job["method"], "model": job["model"],
        "family": family(job["model"]), "n_params": record.get("n_params"),
        "trainable_params": record.get("trainable_params"),
        "batch_size": job["batch_size"], "micro_batches": hp.get("micro_batches"),
        "seq_len": job["seq_len"], "dtype": job["dtype"],
        "precision": job.get("precision", "pure"),  # results written before the field: pure
        # results written before data parallelism: one rank, no sharding
        "world_size": job.get("world_size", 1), "sharding": job.get("sharding", "none"),
        "device": job["device"],
        "device_name": prov.get("device_name"), "cpu_id": prov.get("cpu_id"),
        "memory_tier": mem.get("tier"),
        "capacity_gb": job.get("capacity_gb"),
        **{k: mem.get(k) for k in ("peak_bytes", "param_bytes", "grad_bytes", "optimizer_bytes",
                                   "activation_bytes", "other_bytes", "host_peak_bytes",
                                   "transfer_bytes", "reserved_peak_bytes", "alloc_retries")},
        "sharding_bytes": shard.get("bytes"), "max_rank_peak_bytes": shard.get("max_rank_peak_bytes"),
        **collective_columns(shard.get("collectives"), job.get("world_size", 1)),
        "first_step_peak_bytes": record.get("first_step_peak_bytes"),
        **{k: thr.get(k) for k in ("tokens_per_s", "baseline", "baseline_tokens_per_s",
                                   "throughput_ratio", "throughput_ratio_lo",
                                   "throughput_ratio_hi", "step_time_median_s",
                                   "step_time_q1_s", "step_time_q3_s")},
        **cost_columns(record.get("cost"), job["batch_size"] * job["seq_len"], mem.get("transfer_bytes")),
        "phase": phase(job), "init": job.get("init"),
        "task": job["task"], "steps": job["steps"] if job["kind"] in ("throughput", "convergence") else None,
        "lr": hp.get("lr") if job["kind"] == "convergence" else None, "tuning": tuning_role(job),
        "final_loss": record.get("final_loss"), "loss_floor": record.get("loss_floor"),
        **to_target(record), "status": record["status"], "message": record.get("message"), "seed": job["seed"],
        "commit": prov.get("commit"), "torch_version": prov.get("torch_version"),
        "date": prov.get("date"), "wall_time_s": record.get("wall_time_s"),
        "hparams": json.dumps(hp, sort_keys=True), "result_file": path,
    }


def cost_columns(cost: dict | None, tokens: int, transfer_bytes: int | None = None) -> dict:
    """The step's compute cost (bench.measure.cost) and its estimated step time and tokens/s
    on an H100 SXM 80GB (`bench.estimate`; uncalibrated unless results/reference/
    gpu_efficiency.json has that GPU: `est_h100_calibrated`); with the step's host transfers
    (a memory result's `transfer_bytes`), their time over the H100's PCIe link and the
    step's time without and with full overlap."""
    cost = cost or {}
    phases = cost.get("phases", {})
    return {"flops": cost.get("flops"), "bytes_moved": cost.get("bytes_moved"), "ops": cost.get("ops"),
            **{f"flops_{p}": phases.get(p, {}).get("flops") if cost else None
               for p in ("forward", "backward", "optimizer")},
            **estimate.estimate_row(cost, tokens, "h100-sxm-80gb", _calibration(), prefix="est_h100",
                                    transfer_bytes=transfer_bytes)}


def collective_columns(collectives: dict | None, world_size: int) -> dict:
    """A data-parallel step's collectives (`bench.measure.collectives`: a sharded or replicated
    memory result's `sharding.collectives`): `collective_bytes`, what one rank sends per step
    (ring algorithm), and `est_h100_collective_s`, its time over the H100's NVLink (world_size
    <= 8) or the assumed inter-node link (`bench.estimate.collective_seconds`; estimated,
    uncalibrated). Empty without them (one rank, results written before them)."""
    sent = (collectives or {}).get("wire_bytes")
    return {"collective_bytes": sent,
            "est_h100_collective_s": None if sent is None else
            estimate.collective_seconds(sent, world_size, "h100-sxm-80gb")}


@functools.cache
def _calibration() -> dict:
    return estimate.load_calibration()


def summary_rows(record: dict, path: str) -> list[dict]:
    """A job's rows: one, or for a capacity job one per memory size, where `capacity_gb`
    is the size, `largest_batch` the answer and `peak_bytes` what that batch needs; for a
    model_capacity job `largest_model` is the answer (`model` where its ladder starts)
    and `n_params` its parameters (0: not even the first size fits)."""
    row = summary_row(record, path)
    found = record.get("capacity")
    if record["job"]["kind"] not in ("capacity", "model_capacity") or not found:
        return [row]
    row["memory_tier"] = found["tier"]
    answer = ("largest_batch", "at_max_batch") if record["job"]["kind"] == "capacity" else (
        "largest_model", "n_params", "at_ladder_top")
    return [{**row, "capacity_gb": size["memory_gb"], **{k: size[k] for k in answer},
             "peak_bytes": size["needed_bytes_at_largest"],
             **cost_columns(size.get("cost_at_largest"),
                            size.get("largest_batch", 0) * record["job"]["seq_len"])}
            for size in found["sizes"]] or [row]


def phase(job: dict) -> str:
    """How a job's model started: `scratch` (drawn from the seed), `pretrain` (from scratch,
    its weights saved for fine-tuning) or `finetune` (from a pre-training run's weights)."""
    return "pretrain" if job.get("save_weights") else "finetune" if job.get("init") else "scratch"


def tuning_role(job: dict) -> str | None:
    """A convergence job's part in the tuning protocol (bench/tuning.py): `grid` (a run at a
    learning rate the job sets: the tuning grid's), `tuned` (a reported run at the rate its
    grid chose) or `fixed` (at the rate its method and config give: no tuning)."""
    if job["kind"] != "convergence":
        return None
    return "tuned" if job.get("tuned_from") else "grid" if job.get("lr") is not None else "fixed"


def to_target(record: dict) -> dict:
    """How long a convergence run took to reach the target loss (the task's floor +
    tuning.TARGET_GAP; none without a floor): steps and tokens, None if it never did."""
    floor, curve = record.get("loss_floor"), record.get("curve")
    if floor is None or not curve:
        return {"target_loss": None, "steps_to_target": None, "tokens_to_target": None}
    target = floor + tuning.TARGET_GAP
    steps = tuning.steps_to_target([c["loss"] for c in curve], target)
    tokens = steps * record["job"]["batch_size"] * record["job"]["seq_len"] if steps else None
    return {"target_loss": target, "steps_to_target": steps, "tokens_to_target": tokens}


def curve_rows(record: dict) -> list[dict]:
    job = record["job"]
    return [{"method": job["method"], "model": job["model"], "phase": phase(job), "tuning": tuning_role(job),
             "task": job["task"],
             "seed": job["seed"], "batch_size": job["batch_size"], "seq_len": job["seq_len"],
             **point, "loss_floor": record.get("loss_floor"), "status": record["status"]}
            for point in record.get("curve", [])]


def aggregate(paths: list[str], left_out: list | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The two tables from the result files `paths`. A file that cannot be read is left
    out, named on stderr with why, and appended to `left_out` as (path, why)."""
    summary, curves = [], []
    for path in sorted(map(str, paths)):
        try:
            record = read_result(path)
            rows, points = summary_rows(record, path), curve_rows(record)
        except UnreadableResult as e:
            why = e.why
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            why = f"not a whole result ({type(e).__name__}: {first_line(e)})"
        else:
            summary.extend(rows)
            curves.extend(points)
            continue
        print(f"aggregate: left out {path}: {why}", file=sys.stderr)
        if left_out is not None:
            left_out.append((path, why))
    return (pd.DataFrame(summary, columns=SUMMARY_COLUMNS),
            pd.DataFrame(curves, columns=CURVE_COLUMNS))


def write_csv_atomic(frame: pd.DataFrame, path: str | Path) -> None:
    results.write_text_atomic(path, frame.to_csv(index=False))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="membench aggregate",
                                description="Collect result JSON files into summary.csv and curves.csv.")
    p.add_argument("results", nargs="*", help="result JSON files")
    p.add_argument("--summary", required=True)
    p.add_argument("--curves", required=True)
    args = p.parse_args(argv)
    left_out = []
    summary, curves = aggregate(args.results, left_out)
    write_csv_atomic(summary, args.summary)
    write_csv_atomic(curves, args.curves)
    print(f"aggregate: {len(summary)} jobs ({(summary.status != 'ok').sum()} not ok), "
          f"{len(curves)} curve points"
          + (f"; {len(left_out)} unreadable files left out (named above)" if left_out else ""),
          file=sys.stderr)
    return 0


"""The tuning protocol: every method, the baseline included, gets the same learning-rate budget.

A convergence section with `tuning: {points, factor, seeds}` plans, for each method, a grid
of `points` learning rates log-spaced by `factor` around the method's own default (`grid`),
each run on the tuning seeds; then the section's own seeds run at the rate those runs chose
(`choose`, read from their result files by the job itself: `chosen`), and only these are
reported. A method that keeps AdamW's update (checkpointing, Tempo, the LoRA family, ...)
keeps AdamW's default learning rate, so it is tuned over the baseline's very grid.

The rule: the rate whose tuning runs reach the lowest mean final loss (the mean loss of a
run's last tenth of steps), among the rates none of whose runs failed (diverged, error,
timeout); when every rate failed there is no choice, and the reported run says so.

`steps_to_target` is AlgoPerf's time-to-result on a loss curve: the first step at which
the running mean of the loss reaches the target (the task's loss floor + `TARGET_GAP`).

Pure functions, no torch: the planner, the runner and the tables share them.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

RULE = "lowest mean final loss over the tuning seeds; a rate with a failed run is out"
TARGET_GAP = 0.1  # nats above the task's loss floor: the target loss of steps_to_target
WINDOW = 10  # steps in the running mean that steps_to_target compares with the target


def grid(center: float, points: int, factor: float) -> list[float]:
    """`points` learning rates spaced by `factor` on a log scale, centred on `center`
    (an even count puts the centre between the middle two), rounded to 3 significant
    digits: grid(1e-3, 3, 3) = [0.000333, 0.001, 0.003]."""
    if points < 1 or factor <= 1 or not center > 0:
        raise ValueError(f"a grid needs points >= 1, factor > 1 and a positive centre, "
                         f"not {points}, {factor}, {center}")
    half = (points - 1) / 2
    return [float(f"{center * factor ** (i - half):.3g}") for i in range(points)]


def choose(runs: list[dict]) -> dict:
    """The choice among tuning runs (dicts with `lr`, `seed`, `status`, `final_loss`):
    {"lr": the chosen rate or None when every rate failed, "rule": RULE, "grid": one entry
    per rate, ascending, with its seeds, statuses and mean final loss (None if a run
    failed)}."""
    by_lr: dict[float, list[dict]] = {}
    for run in runs:
        by_lr.setdefault(float(run["lr"]), []).append(run)
    entries = []
    for lr in sorted(by_lr):
        group = sorted(by_lr[lr], key=lambda r: r["seed"])
        losses = [r.get("final_loss") for r in group]
        ok = all(r["status"] == "ok" and _finite(x) for r, x in zip(group, losses))
        entries.append({"lr": lr, "seeds": [r["seed"] for r in group],
                        "statuses": [r["status"] for r in group],
                        "final_loss_mean": sum(losses) / len(losses) if ok else None})
    scored = [e for e in entries if e["final_loss_mean"] is not None]
    best = min(scored, key=lambda e: (e["final_loss_mean"], e["lr"]), default=None)
    return {"lr": best["lr"] if best else None, "rule": RULE, "grid": entries}


def chosen(paths: list[str]) -> dict:
    """`choose` over the tuning runs' result files (`tuned_from`), read as the job starts;
    a file that is missing or not a convergence result with a learning rate is an error
    naming it."""
    runs = []
    for path in paths:
        try:
            record = json.loads(Path(path).read_text())
            runs.append({"lr": record["job"]["lr"], "seed": record["job"]["seed"],
                         "status": record["status"], "final_loss": record.get("final_loss"),
                         "file": path})
        except FileNotFoundError:
            raise FileNotFoundError(f"tuned_from {path}: no such file (its tuning run has not run)") from None
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"tuned_from {path}: not a tuning run's result ({type(e).__name__}: {e})") from None
        if runs[-1]["lr"] is None:
            raise ValueError(f"tuned_from {path}: the run has no learning rate of a grid (job field lr)")
    out = choose(runs)
    out["files"] = list(paths)
    return out


def steps_to_target(losses: list[float], target: float, window: int = WINDOW) -> int | None:
    """The first step (1-based) at which the mean of the last `window` losses (fewer at the
    start) is at most `target`; None if the curve never gets there."""
    total = 0.0
    for i, loss in enumerate(losses):
        if not _finite(loss):
            return None
        total += loss
        if i >= window:
            total -= losses[i - window]
        if total / min(i + 1, window) <= target:
            return i + 1
    return None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)

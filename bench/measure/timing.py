"""Paired timing: a method's speed as a ratio to its baseline, both timed in one process.

Two runs of the same throughput job differ by 10% or more on a shared machine (clock
boost, other processes, thermal state), far more than the spread of the steps inside one
run. A ratio measured side by side cancels what drifts slowly: the method (A) and its
baseline (B) are built from the same seed, warmed up, and then timed in interleaved
rounds, each round running a few steps of each side on the same batch in an order drawn
at random per round (seeded), so drift hits both. Per round,

    r_i = (B's mean step time) / (A's mean step time)      (A's tokens/s over B's)

and the result is the median of the r_i with a 95% bootstrap confidence interval
(percentiles of the median over rounds resampled with replacement). On CUDA every timed
block is bracketed by `torch.cuda.synchronize()`. Where both sides cannot be resident at
once (paper-sized models on one GPU), the idle side is parked in host memory between its
blocks (`Side.park`): the move is not timed, and the pairing is kept. Both stay resident
when they fit (`must_park`), since a move per block costs more than the steps it brackets.

A panel is the same design with several methods beside one baseline: each round shuffles
the methods and runs them in pairs around one baseline block (method, baseline, method),
so every method block touches a baseline block, and each method's ratio is taken to that
block. The baseline runs once per two methods instead of once per method (3/4 of the
steps of separate pairs). A method that fails leaves the rounds; the others go on.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import torch

BOOTSTRAP_SAMPLES = 2000


def bootstrap_median(ratios: list[float], seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """Median of `ratios` and its `level` percentile-bootstrap interval (seeded)."""
    rng = random.Random(seed)
    n = len(ratios)
    medians = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(BOOTSTRAP_SAMPLES))
    tail = (1 - level) / 2
    lo = medians[int(tail * (BOOTSTRAP_SAMPLES - 1))]
    hi = medians[int((1 - tail) * (BOOTSTRAP_SAMPLES - 1))]
    return statistics.median(ratios), lo, hi


@dataclass
class Side:
    """One side of a pair: a method, its model and optimizer, and its step times."""
    name: str
    step: callable  # runs one training step, returns the loss
    tensors: callable = None  # every tensor the side keeps (to park it), or None
    times: list = field(default_factory=list)  # mean step time of each block, seconds
    base_times: list = field(default_factory=list)  # a method's adjacent baseline blocks
    error: Exception | None = None  # why the side left the rounds, if it did

    def park(self, device: str) -> None:
        """Move the side's tensors to `device` in place (same tensor objects)."""
        if self.tensors is None:
            return
        with torch.no_grad():
            for t in self.tensors():
                if t.device != torch.device(device):
                    t.data = t.data.to(device)


def must_park(device: str, headroom: float = 0.8) -> bool:
    """After the first side's warm-up on a CUDA `device`: would the second side, whose step
    needs about the same peak, overflow `headroom` of the GPU with the first one resident?"""
    resident = torch.cuda.memory_allocated(device)
    peak = torch.cuda.max_memory_allocated(device)
    return resident + peak > headroom * torch.cuda.get_device_properties(device).total_memory


def interleave(methods: list[Side], baseline: Side, rounds: int, steps_per_round: int,
               seed: int = 0, sync=lambda: None, park_to: str | None = None,
               home: str | None = None, check=lambda loss, i: None, progress=None) -> None:
    """Time `rounds` rounds of `steps_per_round` steps of each method beside `baseline`.
    Each round shuffles the methods (seeded) and runs them in pairs around one baseline
    block, method-baseline-method, so that every method block touches a baseline block;
    a lone method runs before or after its baseline block at random. Each side's mean step
    time per block goes to its `times`, and a method's adjacent baseline block's to its
    `base_times`. A method whose step raises (or whose loss `check` rejects) keeps the
    exception in `error` and leaves the rounds; if the baseline fails, the rounds stop.
    With `park_to`, the sides not being timed wait there (the timed one is moved back to
    `home` first, untimed). `progress(r)` is called after each round."""
    rng = random.Random(seed)

    def block(side: Side, r: int) -> float | None:
        if park_to:
            for other in [*methods, baseline]:
                if other is not side:
                    other.park(park_to)
            side.park(home)
        try:
            sync()
            t0 = time.perf_counter()
            for i in range(steps_per_round):
                loss = side.step()
            sync()
            t = (time.perf_counter() - t0) / steps_per_round
            check(loss, r)
        except Exception as e:  # this side's failure is its result; the others go on
            side.error = e
            return None
        side.times.append(t)
        return t

    for r in range(rounds):
        order = [m for m in methods if m.error is None]
        rng.shuffle(order)
        for i in range(0, len(order), 2):
            pair = order[i:i + 2]
            before, after = (pair[:1], pair[1:]) if len(pair) == 2 or rng.random() < 0.5 else ([], pair)
            timed = [(m, block(m, r)) for m in before]
            tb = block(baseline, r)
            if tb is None:
                return
            timed += [(m, block(m, r)) for m in after]
            for m, t in timed:
                if t is not None:
                    m.base_times.append(tb)
        if progress:
            progress(r)


def summary(a: Side, b: Side, tokens_per_step: int, seed: int = 0) -> dict:
    """The paired result of method `a` beside baseline `b`: ratio median and interval over
    rounds (a's block against its adjacent baseline block), each side's median tokens/s."""
    ratios = [tb / ta for ta, tb in zip(a.times, a.base_times)]
    ratio, lo, hi = bootstrap_median(ratios, seed)
    qa = statistics.quantiles(a.times, n=4) if len(a.times) > 1 else [a.times[0]] * 3
    return {"tokens_per_s": tokens_per_step / statistics.median(a.times),
            "baseline": b.name,
            "baseline_tokens_per_s": tokens_per_step / statistics.median(a.base_times),
            "throughput_ratio": ratio, "throughput_ratio_lo": lo, "throughput_ratio_hi": hi,
            "step_time_median_s": statistics.median(a.times), "step_time_q1_s": qa[0],
            "step_time_q3_s": qa[2], "round_step_times_s": a.times,
            "baseline_round_step_times_s": a.base_times, "round_ratios": ratios,
            "tokens_per_step": tokens_per_step}

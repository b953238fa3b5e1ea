"""Paired timing: a method's speed as a ratio to its baseline, both timed in one process.

Two runs of the same throughput job differ by 10% or more on a shared machine (clock
boost, other processes, thermal state), far more than the spread of the steps inside one
run. A ratio measured side by side cancels what drifts slowly: the method (A) and its
baseline (B) are built from the same seed, warmed up, and then timed in interleaved
rounds, each round running a few steps of each side on the same batch in an order drawn
at random per round (seeded), so drift hits both. Per round,

    r_i = (B's mean step time) / (A's mean step time)      (A's tokens/s over B's)

and the result is the ratio with a 95% interval meant to hold the ratio of running the
job again (`segment_interval`). The rounds are split into up to SEGMENTS consecutive
segments; at the start of each, every side's persistent tensors (parameters, buffers,
gradients, optimizer state) move to fresh memory (`Side.relayout`, untimed: another
memory layout, as another process would have); the ratio is the mean of the segments'
median log ratios, and the interval Student's t over them, so what changes from one
segment to the next (the layout, the load of the moment) is in it. What every round of a
run shares, and the next run does not, no run can see from inside: on a shared CPU the
load other processes put on the machine over the minute a job runs shifts the ratio
itself. Its spread, BETWEEN_RUNS_SD (measured by scripts/throughput_repeats.py), is added
to the interval. The bootstrap over rounds (`bootstrap_median`), the interval before
segments, saw only the noise between neighbouring rounds of one process. On CUDA every timed
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

import math
import random
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from bench.job import JOB_DEFAULTS

BOOTSTRAP_SAMPLES = 2000
# Segments a job's rounds are split into (each on a fresh memory layout; the interval is t
# over them): more segments give t more degrees of freedom, hence a narrower interval for
# the same noise, as long as each keeps a round (at most `rounds` segments).
SEGMENTS = 8
# The largest random spacer allocated before a relayout (shifts every later address, so
# the tensors' offsets within pages and cache sets change as between processes)
SPACER_BYTES = 2 * 2**20
# The spread between runs of a job that no run sees from inside (sd of the log ratio), added
# to the interval: on a shared 2-core CPU the load other processes put on the machine changes
# the ratio itself, and stays for longer than a job runs. Its default is the job field's
# (config/schema.yaml `between_runs_sd`, measured there with scripts/throughput_repeats.py:
# 6 repeats of 3 paired jobs, each in its own process; docs/speed.md).
BETWEEN_RUNS_SD = JOB_DEFAULTS["between_runs_sd"]


def bootstrap_median(ratios: list[float], seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """Median of `ratios` and its `level` percentile-bootstrap interval (seeded).

    The resamples are `random.Random(seed).choices(ratios, k=n)`, drawn all at once: numpy's
    legacy generator seeded with the same key (the seed's 32-bit words) is the same Mersenne
    Twister and makes its doubles the same way, so the picks, and the interval, are Python's."""
    n = len(ratios)
    key, rest = [], abs(seed)
    while not key or rest:
        key.append(rest & 0xFFFFFFFF)
        rest >>= 32
    draws = np.random.RandomState(key).random_sample((BOOTSTRAP_SAMPLES, n))
    picks = np.asarray(ratios, dtype=float)[np.floor(draws * float(n)).astype(np.intp)]
    medians = np.sort(np.median(picks, axis=1))
    tail = (1 - level) / 2
    lo = float(medians[int(tail * (BOOTSTRAP_SAMPLES - 1))])
    hi = float(medians[int((1 - tail) * (BOOTSTRAP_SAMPLES - 1))])
    return statistics.median(ratios), lo, hi


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile `p` (0.5 < p < 1) for `df` degrees of freedom: the closed-form
    distribution function for integer df (Abramowitz & Stegun 26.7.3-4), inverted by
    bisection; above 1000 degrees of freedom, the normal quantile (within 0.002 of t's)."""
    if df > 1000:
        return statistics.NormalDist().inv_cdf(p)

    def central(t: float) -> float:  # P(|T| < t)
        theta = math.atan(t / math.sqrt(df))
        c2, s = math.cos(theta) ** 2, math.sin(theta)
        if df % 2:
            term, total = math.cos(theta), 0.0
            for k in range(1, (df - 1) // 2 + 1):
                total += term
                term *= c2 * 2 * k / (2 * k + 1)
            return 2 / math.pi * (theta + s * total) if df > 1 else 2 * theta / math.pi
        term, total = 1.0, 0.0
        for k in range(1, df // 2 + 1):
            total += term
            term *= c2 * (2 * k - 1) / (2 * k)
        return s * total

    lo, hi = 0.0, 1.0
    while central(hi) < 2 * p - 1:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if central(mid) < 2 * p - 1 else (lo, mid)
    return (lo + hi) / 2


def segment_bounds(rounds: int, segments: int = SEGMENTS) -> list[int]:
    """The segment of each of `rounds` rounds: min(segments, rounds) consecutive runs of
    rounds whose lengths differ by at most one."""
    k = max(1, min(segments, rounds))
    return [i * k // rounds for i in range(rounds)]


def segment_interval(ratios: list[float], segment_of: list[int], level: float = 0.95, seed: int = 0,
                     between_runs: float = BETWEEN_RUNS_SD) -> tuple[float, float, float]:
    """The ratio over rounds grouped in segments and its `level` interval for running the
    job again: per segment the median of its rounds' log ratios (robust to a round another
    process slowed), the ratio exp(their mean m), and the interval

        exp(m +- t * sqrt(sd^2 / K + between_runs^2))

    over the K segment medians (sd their spread), t Student's quantile for the
    Welch-Satterthwaite degrees of freedom of that sum (K - 1 when `between_runs` is 0).
    What changes between segments of one run (the layout, the load of the moment) is in
    sd; `between_runs` (sd, log) is what every round of a run shares and the next run does
    not (the machine's load over the minute the job ran), which no single run can see.
    With one segment: the bootstrap over rounds (`bootstrap_median`), widened by
    `between_runs` alike."""
    z = statistics.NormalDist().inv_cdf((1 + level) / 2)
    groups: dict[int, list[float]] = {}
    for r, s in zip(ratios, segment_of):
        groups.setdefault(s, []).append(math.log(r))
    if len(groups) < 2:
        ratio, lo, hi = bootstrap_median(ratios, seed, level)
        return ratio, ratio * math.exp(-math.hypot(math.log(ratio / lo), z * between_runs)), \
            ratio * math.exp(math.hypot(math.log(hi / ratio), z * between_runs))
    medians = [statistics.median(g) for g in groups.values()]
    k, mean = len(medians), statistics.fmean(medians)
    inside = statistics.variance(medians) / k
    total = inside + between_runs ** 2
    # Welch-Satterthwaite: only `inside` is estimated (k - 1 degrees of freedom)
    df = min(10**4, math.floor(total ** 2 * (k - 1) / inside ** 2)) if inside > 0 else 10**4
    half = t_quantile((1 + level) / 2, max(k - 1, df)) * math.sqrt(total)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


@dataclass
class Side:
    """One side of a pair: a method, its model and optimizer, and its step times."""
    name: str
    step: callable  # runs one training step, returns the loss
    tensors: callable = None  # every tensor the side keeps (to park it, to relay it out), or None
    times: list = field(default_factory=list)  # mean step time of each block, seconds
    base_times: list = field(default_factory=list)  # a method's adjacent baseline blocks
    segments: list = field(default_factory=list)  # the segment of each of its rounds
    error: Exception | None = None  # why the side left the rounds, if it did

    def park(self, device: str) -> None:
        """Move the side's tensors to `device` in place (same tensor objects)."""
        if self.tensors is None:
            return
        with torch.no_grad():
            for t in self.tensors():
                if t.device != torch.device(device):
                    t.data = t.data.to(device)

    def relayout(self, rng: random.Random) -> int:
        """Copy the side's tensors to fresh memory in place (same tensor objects, same
        values, new storage), in a random order: the layout a new process could have had.
        Views and tensors sharing storage stay (moving one would break the sharing), as do
        tensor subclasses (quantized states). Returns the number of tensors moved."""
        if self.tensors is None:
            return 0
        listed = {id(t): t for t in self.tensors()}.values()  # tied weights once
        owners: dict[int, int] = {}
        for t in listed:
            if t.layout == torch.strided and t.numel():
                ptr = t.untyped_storage().data_ptr()
                owners[ptr] = owners.get(ptr, 0) + 1
        movable = [t for t in listed if type(t) in (torch.Tensor, torch.nn.Parameter)
                   and t.layout == torch.strided and t._base is None and t.numel()
                   and t.is_contiguous() and owners[t.untyped_storage().data_ptr()] == 1
                   and t.untyped_storage().nbytes() == t.nbytes]
        rng.shuffle(movable)
        with torch.no_grad():
            for t in movable:
                t.data = t.data.clone()
        return len(movable)


def must_park(device: str, headroom: float = 0.8) -> bool:
    """After the first side's warm-up on a CUDA `device`: would the second side, whose step
    needs about the same peak, overflow `headroom` of the GPU with the first one resident?"""
    resident = torch.cuda.memory_allocated(device)
    peak = torch.cuda.max_memory_allocated(device)
    return resident + peak > headroom * torch.cuda.get_device_properties(device).total_memory


def interleave(methods: list[Side], baseline: Side, rounds: int, steps_per_round: int,
               seed: int = 0, sync=lambda: None, park_to: str | None = None,
               home: str | None = None, check=lambda loss, i: None, progress=None,
               segments: int = 1) -> None:
    """Time `rounds` rounds of `steps_per_round` steps of each method beside `baseline`.
    Each round shuffles the methods (seeded) and runs them in pairs around one baseline
    block, method-baseline-method, so that every method block touches a baseline block;
    a lone method runs before or after its baseline block at random. Each side's mean step
    time per block goes to its `times`, and a method's adjacent baseline block's to its
    `base_times`. A method whose step raises (or whose loss `check` rejects) keeps the
    exception in `error` and leaves the rounds; if the baseline fails, the rounds stop.
    With `park_to`, the sides not being timed wait there (the timed one is moved back to
    `home` first, untimed). The rounds form `segments` segments (`segment_bounds`); each
    one after the first starts with every side's tensors relaid out (`Side.relayout`)
    behind a spacer allocation of random size, untimed, and a method's `segments` records
    the segment of each of its rounds. `progress(r)` is called after each round."""
    rng = random.Random(seed)
    layout = random.Random(seed + 1)  # its own stream: the rounds' orders do not depend on it
    segment_of = segment_bounds(rounds, segments)
    spacer = None

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
        if r and segment_of[r] != segment_of[r - 1]:
            device = home or "cpu"
            spacer, _ = torch.empty(64 * layout.randrange(SPACER_BYTES // 64), dtype=torch.uint8,
                                    device=device), spacer
            for side in [*methods, baseline]:
                if side.error is None:
                    side.relayout(layout)
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
                    m.segments.append(segment_of[r])
        if progress:
            progress(r)


def summary(a: Side, b: Side, tokens_per_step: int, seed: int = 0,
            between_runs: float = BETWEEN_RUNS_SD) -> dict:
    """The paired result of method `a` beside baseline `b`: the ratio and its interval over
    segments of rounds (a's block against its adjacent baseline block: `segment_interval`,
    with `between_runs` added), each side's median tokens/s."""
    ratios = [tb / ta for ta, tb in zip(a.times, a.base_times)]
    segment_of = a.segments or [0] * len(ratios)
    ratio, lo, hi = segment_interval(ratios, segment_of, seed=seed, between_runs=between_runs)
    qa = statistics.quantiles(a.times, n=4) if len(a.times) > 1 else [a.times[0]] * 3
    return {"tokens_per_s": tokens_per_step / statistics.median(a.times),
            "baseline": b.name,
            "baseline_tokens_per_s": tokens_per_step / statistics.median(a.base_times),
            "throughput_ratio": ratio, "throughput_ratio_lo": lo, "throughput_ratio_hi": hi,
            "step_time_median_s": statistics.median(a.times), "step_time_q1_s": qa[0],
            "step_time_q3_s": qa[2], "round_step_times_s": a.times,
            "baseline_round_step_times_s": a.base_times, "round_ratios": ratios,
            "round_segments": segment_of, "segments": len(set(segment_of)),
            "between_runs_sd": between_runs,
            "tokens_per_step": tokens_per_step}

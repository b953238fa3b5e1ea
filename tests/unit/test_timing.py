"""Paired timing: the bootstrap interval's coverage under drift, a method timed beside
itself, and a panel of methods timed beside one baseline."""
import json
import math
import random
import statistics
import subprocess
import sys

import pytest

from bench.measure import kinds, runner, timing
from bench.method import Method, load
from conftest import REPO


def drifting_pair(rng: random.Random, ratio: float, rounds: int):
    """Step times of a method `ratio` times as fast as its baseline, both under the same
    slow drift (a machine getting busier, then quieter) and independent noise."""
    a, b = [], []
    for i in range(rounds):
        drift = 1.0 + 0.5 * i / rounds + 0.3 * math.sin(i)
        b.append(drift * rng.lognormvariate(0, 0.05))
        a.append(drift / ratio * rng.lognormvariate(0, 0.05))
    return a, b


def test_bootstrap_interval_covers_the_true_ratio_at_about_its_nominal_rate():
    rng, true, covered, trials = random.Random(0), 1.3, 0, 200
    for t in range(trials):
        a, b = drifting_pair(rng, true, rounds=16)
        _, lo, hi = timing.bootstrap_median([tb / ta for ta, tb in zip(a, b)], seed=t)
        covered += lo <= true <= hi
    assert 0.85 <= covered / trials <= 0.995  # nominal 0.95


def test_bootstrap_resamples_are_pythons_own_choices():
    """The resamples drawn at once (numpy) are `random.Random(seed).choices`, pick for pick:
    the interval equals the one from Python's generator, for odd and even counts and seeds
    of one and of two 32-bit words."""
    rng = random.Random(7)
    for t in range(60):
        ratios = [rng.lognormvariate(0, 0.2) for _ in range(rng.randint(1, 30))]
        seed = rng.choice([0, t, -t, 2**32 + t, 2**40 - 1])
        by_python = random.Random(seed)
        medians = sorted(statistics.median(by_python.choices(ratios, k=len(ratios)))
                         for _ in range(timing.BOOTSTRAP_SAMPLES))
        want = (statistics.median(ratios), medians[int(0.025 * (timing.BOOTSTRAP_SAMPLES - 1))],
                medians[int(0.975 * (timing.BOOTSTRAP_SAMPLES - 1))])
        assert timing.bootstrap_median(ratios, seed=seed) == want, (len(ratios), seed)


def test_pairing_cancels_drift_that_biases_unpaired_medians():
    rng = random.Random(1)
    a, b = drifting_pair(rng, 1.3, rounds=16)
    # the baseline timed first, then the method, as two separate runs: drift moves the ratio
    unpaired = sorted(b[:8])[4] / sorted(a[8:])[4]
    paired, lo, hi = timing.bootstrap_median([tb / ta for ta, tb in zip(a, b)])
    assert abs(paired - 1.3) < 0.05 < abs(unpaired - 1.3)
    assert lo <= 1.3 <= hi


def test_interleave_times_every_round_of_both_sides_in_a_seeded_order():
    calls = []
    a = timing.Side("a", lambda: calls.append("a"))
    b = timing.Side("b", lambda: calls.append("b"))
    timing.interleave([a], b, rounds=6, steps_per_round=2, seed=3)
    assert len(a.times) == len(b.times) == 6 and calls.count("a") == calls.count("b") == 12
    blocks = [calls[i] for i in range(0, len(calls), 2)]
    assert {tuple(blocks[i:i + 2]) for i in range(0, 12, 2)} == {("a", "b"), ("b", "a")}


@pytest.mark.parametrize("method", ["adamw", "grad_accum"])
def test_a_method_paired_with_itself_is_about_as_fast(tiny_job, method):
    record = runner.run(tiny_job(kind="throughput", method=method, baseline=method, steps=12,
                                 rounds=6, warmup_steps=1))
    assert record["status"] == "ok", record["message"]
    t = record["throughput"]
    assert t["baseline"] == method and len(t["round_ratios"]) == 6
    assert t["throughput_ratio_lo"] <= t["throughput_ratio"] <= t["throughput_ratio_hi"]
    # identical work on both sides: the ratio is 1 up to timing noise, never a real factor
    # (such as grad_accum's 4 micro-batches against one batch)
    assert 0.67 < t["throughput_ratio"] < 1.5


def test_every_method_block_touches_the_baseline_block_its_ratio_uses():
    calls, clock = [], [0.0]

    def stepper(name, cost):
        def step():
            calls.append(name)
            clock[0] += cost
        return step

    methods = [timing.Side(n, stepper(n, 1.0)) for n in "abcde"]
    base = timing.Side("B", stepper("B", 2.0))
    timing.interleave(methods, base, rounds=8, steps_per_round=1, seed=0)
    # per round: 5 method blocks, 3 baseline blocks (one per pair, one for the lone method)
    assert len(calls) == 8 * 8 and calls.count("B") == 24
    for r in range(8):
        block = calls[8 * r: 8 * r + 8]
        assert sorted(c for c in block if c != "B") == list("abcde")
        for i, c in enumerate(block):
            if c != "B":  # a neighbour is a baseline block
                assert "B" in block[max(0, i - 1): i] + block[i + 1: i + 2]
    for m in methods:
        assert len(m.times) == len(m.base_times) == 8


def test_a_failing_method_leaves_the_rounds_and_a_failing_baseline_stops_them():
    count = [0]

    def failing():
        count[0] += 1
        if count[0] == 3:
            raise RuntimeError("third step fails")

    ok = [timing.Side(n, lambda: None) for n in "ab"]
    x = timing.Side("x", failing)
    timing.interleave([*ok, x], timing.Side("B", lambda: None), rounds=5, steps_per_round=1)
    assert all(len(s.times) == len(s.base_times) == 5 for s in ok)
    assert len(x.times) == len(x.base_times) == 2 and "third step" in str(x.error)

    base = timing.Side("B", lambda: (_ for _ in ()).throw(RuntimeError("baseline fails")))
    other = timing.Side("other", lambda: None)
    timing.interleave([other], base, rounds=5, steps_per_round=1, seed=0)
    assert base.error is not None and other.base_times == [] and len(other.times) <= 1


class FailsLater(Method):
    """AdamW whose fourth step raises: it fails in the timed rounds, not the warm-up."""
    paper = "test"

    def __init__(self):
        super().__init__()
        self.steps = 0

    def train_step(self, model, optimizer, batch):
        self.steps += 1
        if self.steps == 4:
            raise RuntimeError("fails in round two")
        return super().train_step(model, optimizer, batch)


def test_a_panel_shares_one_baseline_and_isolates_a_failure(tiny_job):
    jobs = [tiny_job(kind="throughput", method=m, steps=6, rounds=6, warmup_steps=2)
            for m in ("adamw", "grad_accum", "galore")]
    out = kinds.throughput_panel([(jobs[0], load("adamw")), (jobs[1], load("grad_accum")),
                                  (jobs[2], FailsLater())])
    ok = out[:2]
    assert all(isinstance(r, dict) for r in ok) and isinstance(out[2], RuntimeError)
    for r in ok:
        t = r["throughput"]
        base = t["baseline_round_step_times_s"]
        assert t["panel_size"] == 3 and t["baseline"] == "adamw" and len(base) == 6
        assert t["round_ratios"] == [b / a for a, b in zip(t["round_step_times_s"], base)]
        assert t["throughput_ratio_lo"] <= t["throughput_ratio"] <= t["throughput_ratio_hi"]
    # grad_accum's 4 micro-batches of 1 sequence against one batch of 4: slower, never faster
    assert ok[1]["throughput"]["throughput_ratio"] < 1.0


def test_many_times_a_group_of_throughput_jobs_as_one_panel(tmp_path):
    entries = [{"job": {"kind": "throughput", "method": m, "model": "gpt2-tiny", "batch_size": 4,
                        "seq_len": 32, "steps": 3, "rounds": 3, "warmup_steps": 1},
                "out": str(tmp_path / f"{m}.json")} for m in ("adamw", "galore")]
    entries.append({"job": {"kind": "memory", "method": "adamw", "model": "gpt2-tiny",
                            "batch_size": 4, "seq_len": 32}, "out": str(tmp_path / "m.json")})
    done = subprocess.run([sys.executable, "-m", "bench", "many", "--jobs-json", json.dumps(entries),
                           "--threads", "1"], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    records = [json.loads((tmp_path / f).read_text()) for f in ("adamw.json", "galore.json", "m.json")]
    assert [r["status"] for r in records] == ["ok"] * 3
    a, g = (r["throughput"] for r in records[:2])
    assert a["panel_size"] == g["panel_size"] == 2
    # two methods, one baseline block per round between them: both ratios use it
    assert a["baseline_round_step_times_s"] == g["baseline_round_step_times_s"]
    assert "memory" in records[2] and "one panel" in done.stderr


def test_a_relayout_moves_every_tensor_to_fresh_memory_and_keeps_the_rest():
    import torch

    weight = torch.nn.Parameter(torch.randn(64, 32))
    state = torch.randn(64, 32)
    flat = torch.zeros(100)
    view = flat[10:20]  # a view: moving it would cut it off its base
    alias = torch.empty(0).set_(state.untyped_storage(), 0, (64 * 32,))  # shares state's storage
    tensors = [weight, weight, state, view, alias, torch.zeros(0)]
    side = timing.Side("s", lambda: None, lambda: tensors)
    before = {id(t): (t.data_ptr(), t.clone()) for t in tensors}
    assert side.relayout(random.Random(0)) == 1  # weight (listed twice: once); state shares its storage
    assert weight.data_ptr() != before[id(weight)][0] and torch.equal(weight, before[id(weight)][1])
    assert isinstance(weight, torch.nn.Parameter) and weight.requires_grad
    for t in (state, view, alias):
        assert t.data_ptr() == before[id(t)][0]
    assert view._base is flat


def test_segments_relay_out_every_side_between_them_and_leave_the_order_alone():
    import torch

    def run(segments):
        calls = []
        sides = []
        for name in "abB":
            w = torch.zeros(1000)
            side = timing.Side(name, lambda name=name, w=w: calls.append((name, w.data_ptr())), lambda w=w: [w])
            sides.append(side)
        timing.interleave(sides[:2], sides[2], rounds=12, steps_per_round=1, seed=5, segments=segments)
        return calls, sides

    plain, _ = run(1)
    calls, (a, b, base) = run(4)
    assert [c[0] for c in calls] == [c[0] for c in plain]  # the rounds' orders do not depend on segments
    assert a.segments == b.segments == timing.segment_bounds(12, 4) == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    for name in "abB":  # one address per segment (3 rounds each): every side moved 3 times
        ptrs = [p for n, p in calls if n == name]
        first = [ptrs[i] for i in range(0, len(ptrs), len(ptrs) // 4)]
        assert all(p == first[k] for k in range(4) for p in ptrs[k * len(ptrs) // 4:(k + 1) * len(ptrs) // 4])
        assert len(set(first)) > 1


def test_the_summary_takes_its_interval_over_the_segments():
    a, b = timing.Side("a", lambda: None), timing.Side("b", lambda: None)
    a.times, a.base_times = [1.0, 1.1, 0.9, 1.0, 1.2, 0.8], [2.0, 2.1, 1.9, 2.2, 2.0, 1.8]
    a.segments = [0, 0, 1, 1, 2, 2]
    t = timing.summary(a, b, tokens_per_step=64)
    ratios = [tb / ta for ta, tb in zip(a.times, a.base_times)]
    assert (t["throughput_ratio"], t["throughput_ratio_lo"], t["throughput_ratio_hi"]) == \
        timing.segment_interval(ratios, a.segments)
    assert t["segments"] == 3 and t["round_segments"] == a.segments
    assert t["throughput_ratio_lo"] < t["throughput_ratio"] < t["throughput_ratio_hi"]

"""A simulated step's trace as a line in the batch (`bench.measure.trace_line`): exact where
it is used, refused where it cannot be, and `membench fit`'s answers the same with it as
with every batch run."""
import contextlib
import io

import pytest

from bench import fit
from bench.job import Job
from bench.measure import allocator, capacity
from bench.measure.trace_line import Line, shape_and_sizes


def trace(batch: int, keys=(10, 11, 12)) -> list:
    """A step: weights (fixed), an activation and its temporary (grow with the batch), the
    temporary freed, then the activation; the keys are storage addresses (any numbers)."""
    w, a, t = keys
    return [("alloc", w, 4096), ("alloc", a, 512 + 1000 * batch), ("alloc", t, 300 * batch),
            ("free", t), ("free", a), ("free", 99)]


def test_the_line_gives_each_batch_its_trace_whatever_the_keys():
    line = Line((2, trace(2)), (5, trace(5, keys=(7, 8, 9))))
    assert line.same_shape
    assert shape_and_sizes(line.at(9)) == shape_and_sizes(trace(9)[:-1])  # less the free of no allocation
    assert line.at(1) == [("alloc", 0, 4096), ("alloc", 1, 1512), ("alloc", 2, 300), ("free", 2), ("free", 1)]
    assert line.holds(7, trace(7, keys=(1, 2, 3))) and line.batches == [2, 5, 7]
    # the replay of the line's trace is the run's
    assert allocator.replay(line.at(40)) == allocator.replay(trace(40))


def test_a_step_off_the_line_is_not_on_it():
    line = Line((2, trace(2)), (4, trace(4)))
    bent = trace(6)
    bent[2] = ("alloc", 12, 300 * 6 + 8)  # one allocation not affine in the batch
    assert not line.holds(6, bent)
    reordered = trace(6)
    reordered[3], reordered[4] = reordered[4], reordered[3]  # another free order: another shape
    assert not line.holds(6, reordered)
    assert line.batches == [2, 4]


def test_no_line_between_two_shapes_and_none_where_sizes_are_not_whole_bytes():
    longer = trace(4) + [("alloc", 13, 64)]  # one more chunk at the larger batch
    assert not Line((2, trace(2)), (4, longer)).same_shape
    half = Line((2, [("alloc", 1, 10)]), (4, [("alloc", 1, 11)]))  # half a byte per sequence
    assert half.at(6) == [("alloc", 0, 12)] and half.at(3) is None
    assert Line((2, [("alloc", 1, 10)]), (4, [("alloc", 1, 40)])).at(1) is None  # below zero bytes


def test_a_step_off_the_line_beyond_its_steps_leaves_it(monkeypatch):
    """A search's line (`capacity.Oracle`): a smaller batch whose step has other events (fewer
    chunks) says nothing of the batches between the steps on the line, which it still computes."""
    def step(batch):
        events = trace(batch) if batch >= 3 else trace(batch) + [("alloc", 13, 64)]
        return {"status": "ok", "message": None, "n_params": 1,
                "memory": {"predicted_gpu_bytes": allocator.replay(events).reserved_peak_bytes}}, events

    job = Job(kind="memory", method="adamw", model="gpt2-tiny", batch_size=8, seq_len=32, simulate=True)
    oracle = capacity.Oracle(job, 1, cost=False)
    monkeypatch.setattr(oracle, "_simulate", step)
    for batch in (8, 32, 3, 2):  # 3 confirms the line through 8 and 32; 2 is off it
        oracle.need(batch)
    assert not any(oracle.records[b].get("line") for b in (8, 32, 3, 2))
    oracle.need(20)
    assert oracle.records[20]["line"] == [3, 8, 32] and oracle.traces[20] == oracle.line.at(20)


# A method whose steps lie on one line (checkpointing), one that accumulates micro-batches and
# one that releases gradients inside backward; sizes whose answers are batches far from the
# step's own. (test_fit's held answers hold these and three more methods with the line on.)
# LOMO in the default run; checkpointing (a need not affine in the batch) and grad_accum
# (micro-batches of 4) opt-in (`heavy`): test_fit holds both methods' answers, computed
# before the line, with the line in use
HEAVY = pytest.mark.heavy
METHODS = ["lomo", pytest.param("checkpointing", marks=HEAVY), pytest.param("grad_accum", marks=HEAVY)]
ASKED = dict(model="gpt2-tiny", batch_size=4, seq_len=32, memory_gb=[0.51, 0.55], max_batch=200,
             dtype="bfloat16")


@pytest.mark.parametrize("method", METHODS)
def test_fit_answers_the_same_with_the_line_as_with_every_batch_run(method, monkeypatch):
    runs = []
    real_note = capacity.Oracle._note

    def note(self, record, batch, capacity_gb):
        runs.append((batch, bool(record.get("line"))))
        real_note(self, record, batch, capacity_gb)

    monkeypatch.setattr(capacity.Oracle, "_note", note)
    with contextlib.redirect_stderr(io.StringIO()):
        with_line = fit.answer(method=method, **ASKED)
        computed = [b for b, from_line in runs if from_line]
        monkeypatch.setattr(capacity.Oracle, "_from_line", lambda self, batch: None)
        runs.clear()
        every_batch_run = fit.answer(method=method, **ASKED)
    assert with_line == every_batch_run
    assert not any(from_line for _, from_line in runs)
    assert computed, "no batch came from the line"
    assert [r["largest_batch"] for r in with_line] == sorted(r["largest_batch"] for r in with_line)

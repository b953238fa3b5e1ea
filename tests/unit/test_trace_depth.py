"""A simulated step's trace as periodic in the model's depth (`bench.measure.trace_depth`):
the trace of a deep model from shallow copies, byte for byte; refused where the step is not
periodic; and `membench fit`'s answers the same as with every batch run at full depth."""
import itertools
import random
import re
from dataclasses import replace

import pytest

from bench import fit, models
from bench.job import Job
from bench.measure import allocator, capacity, sharded, zero
from bench.measure.trace_depth import Depth, _across, numbered
from bench.measure.tracker import labelled_peak
from bench.method import load


def toy_step(layers: int, batch: int = 1, bucket: int | None = None, every: int | None = None) -> list:
    """A toy training step's allocation trace with what makes real ones hard to read: a
    first block that frees its input a step late, a backward freeing each block's saved
    activations in reverse, an optimizer that makes a temporary per parameter then frees
    them all (a foreach op), and keys that are reused addresses. With `bucket`, gradients
    are reduced in buckets of that many blocks (a count not per block); with `every`, the forward
    of every `every`-th block makes one temporary more (two kinds of block)."""
    events, free_keys = [], []
    counter = itertools.count()

    def alloc(n: int) -> int:
        key = free_keys.pop() if free_keys else next(counter)
        events.append(("alloc", key, n))
        return key

    def free(key: int) -> None:
        events.append(("free", key))
        free_keys.append(key)

    weights = [alloc(8192)] + [alloc(4096 + i % 2 * 64) for i in range(2 * layers)] + [alloc(8192)]
    h = alloc(64 * batch)
    saved = []
    for i in range(layers):
        t = alloc(100 * batch)
        saved.append(alloc(200 * batch))
        if i:
            free(h)
        free(t)
        if every and i % every == every - 1:
            free(alloc(32 * batch))
        new = alloc(64 * batch)
        if not i:
            free(h)
        h = new
    logits = alloc(1000 * batch)
    free(h)
    grad_h = alloc(64 * batch)
    free(logits)
    grads, pending = [], []
    for i in reversed(range(layers)):
        g = alloc(64 * batch)
        free(saved[i])
        free(grad_h)
        grad_h = g
        pending += [alloc(4096), alloc(4096 + 64)]
        if bucket is None or len(pending) >= 2 * bucket or i == 0:
            reduce = alloc(sum(8 for _ in pending))
            free(reduce)
            grads += pending
            pending = []
    free(grad_h)
    temps = [alloc(4096) for _ in weights]
    for t in temps:
        free(t)
    for g in grads:
        free(g)
    return events


def test_a_deep_trace_follows_from_three_shallow_ones_byte_for_byte():
    depth = Depth({n: toy_step(n) for n in (3, 4, 6)})
    assert depth.ok
    for layers in (5, 6, 9, 32):
        assert depth.at(layers) == numbered(toy_step(layers))
        assert allocator.replay(depth.at(layers)) == allocator.replay(toy_step(layers))
    # another batch: the same rule with the sizes of a step at depth 4
    other = depth.read(toy_step(4, batch=3))
    assert other is not None and other.at(32) == numbered(toy_step(32, batch=3))
    # a step with other events at depth 4 is not this rule's
    assert depth.read(toy_step(4)[:-1]) is None


def test_a_step_not_periodic_in_depth_is_refused():
    # two kinds of block (alternating, or a fifth block of another kind: first in the deepest
    # copy, which checks the units found between the two shallow ones), or gradients reduced
    # in buckets of two or three blocks, give no rule
    assert Depth({n: toy_step(n) for n in (3, 4, 6)}).ok
    for bucket, every in ((None, 2), (None, 5), (2, None), (3, None)):
        assert not Depth({n: toy_step(n, bucket=bucket, every=every) for n in (3, 4, 6)}).ok


def peak_split(events: list):
    return labelled_peak(events)[0]


def labelled(events: list) -> list:
    """A toy trace labelled as a tracker labels one: the first weights `param`, the rest
    `other` when made, and what a block saves (sizes of 200 bytes a sequence) relabelled
    `activation` at once; the step's peak counted from after the first weights."""
    out = []
    for e, event in enumerate(events):
        out.append((*event, "param" if e < 4 else "other") if event[0] == "alloc" else event)
        if e == 3:
            out.append(("mark", "peak"))
        if event[0] == "alloc" and event[2] % 200 == 0:
            out.append(("label", event[1], "activation"))
    return out


def test_labels_and_marks_follow_the_depth_like_frees():
    depth = Depth({n: labelled(toy_step(n)) for n in (3, 4, 6)})
    assert depth.ok
    for layers in (6, 32):
        deep = depth.at(layers)
        assert deep == numbered(labelled(toy_step(layers)))
        assert peak_split(deep) == peak_split(labelled(toy_step(layers)))
    other = depth.read(labelled(toy_step(4, batch=3)))
    assert other is not None and other.at(32) == numbered(labelled(toy_step(32, batch=3)))


def test_the_peak_split_of_labelled_events_by_hand():
    events = [("alloc", 1, 100, "param"), ("mark", "peak"), ("alloc", 2, 40, "other"),
              ("label", 2, "activation"), ("alloc", 3, 30, "other"), ("free", 3), ("free", 2),
              ("alloc", 4, 60, "other"), ("label", 4, "grad"), ("alloc", 5, 10, "other")]
    # 100 + 40 + 30 at the third allocation; 100 + 60 + 10 at the last ties it: the first stays
    split = peak_split(events)
    assert (split.param, split.activation, split.grad, split.other, split.peak_bytes) == (100, 40, 0, 30, 170)
    split = peak_split(events + [("alloc", 6, 5, "other")])
    assert (split.param, split.activation, split.grad, split.other, split.peak_bytes) == (100, 0, 60, 15, 175)
    # counted from the mark: before it, nothing is a peak
    assert peak_split([("alloc", 1, 500, "other"), ("free", 1), ("mark", "peak")]).peak_bytes == 0


@pytest.mark.parametrize("method", ["adamw", "checkpointing", "offload_activations", "lora"])
def test_the_peak_split_of_a_labelled_trace_is_the_trackers(method):
    """The split at the peak replayed from a step's labelled events is the tracker's own."""
    job = Job(kind="memory", method=method, model="llama-d64-l2-v256", batch_size=4, seq_len=32,
              dtype="bfloat16", simulate=True)
    for batch in (4, 8):
        record, trace = capacity._Simulation(replace(job, batch_size=batch), cost=False, labelled=True).measure()
        assert peak_split(trace).as_row() == {k: record["memory"][k] for k in peak_split(trace).as_row()}


@pytest.mark.parametrize("method", ["adamw", "checkpointing"])
def test_what_sharding_adds_at_the_peak_from_labelled_events_is_the_trackers(method):
    """Under FSDP2 (rank 0 of 8): the split and what sharding adds at the peak (gathered
    parameters and gradients, communication buffers), replayed from the sharded tracker's
    labelled events (with its parts and storage resizes), are the tracker's own."""
    job = Job(kind="memory", method=method, model="llama-d64-l2-v256", batch_size=4, seq_len=32,
              dtype="bfloat16", simulate=True, world_size=8, sharding="fsdp")
    for batch in (4, 8):
        record, trace, _ = capacity._run_batch(replace(job, batch_size=batch), cost=False, labelled=True)
        assert peak_split(trace).as_row() == {k: record["memory"][k] for k in peak_split(trace).as_row()}
        parts = {p: labelled_peak(trace)[1].get(p, 0) for p in sharded.SHARDING_PARTS}
        assert parts == {k: record["sharding"][k] for k in sharded.SHARDING_PARTS}
        assert parts["unsharded_param"]  # not a check of nothing


def test_depths_a_a_plus_1_and_a_plus_3_or_deeper_are_needed():
    for depths in ((3, 5, 6), (3, 4, 5), (3, 4)):
        with pytest.raises(ValueError, match="three depths a, a [+] 1 and a [+] 3 or deeper"):
            Depth({n: toy_step(n) for n in depths})


def test_links_across_each_point_by_running_count_as_by_counting_each():
    rng = random.Random(3)
    for _ in range(200):
        links = [tuple(sorted(rng.sample(range(60), 2))) for _ in range(rng.randint(0, 30))]
        lo = rng.randint(0, 40)
        hi = rng.randint(lo + 1, 61)
        assert _across(links, lo, hi) == [sum(i < q <= e for i, e in links) for q in range(lo, hi)]


def test_a_model_at_another_depth():
    assert models.shape(models.at_depth("llama-7b", 3)) == (4096, 3)
    assert models.shape(models.at_depth("llama-d512-l8-v256", 2)) == (512, 2)
    assert models.vocab_size(models.at_depth("llama-d512-l8-v256", 2)) == 256
    mistral = models.at_depth("examples/mistral-7b/config.json", 4)
    assert models.is_config_file(mistral) and models.shape(mistral) == (4096, 4)
    assert models.family(mistral) == "mistral"


DEEP = "llama-d64-l8-v256"  # deeper than the shallow copies (3, 4 and 6 blocks)


def test_a_deep_models_trace_from_shallow_copies_is_the_full_ones():
    """On real steps (fake tensors): the shallow copies' rule gives the 8-block model's trace at
    the learning batch and, read from the 4-block copy, at another."""
    job = Job(kind="memory", method="adamw", model=DEEP, batch_size=8, seq_len=32, dtype="bfloat16",
              simulate=True)
    def trace(depth: int, batch: int) -> list:  # the memory job's, of a copy of `depth` blocks
        model = DEEP if depth == 8 else models.at_depth(DEEP, depth)
        return capacity._Simulation(replace(job, model=model, batch_size=batch), cost=False).measure()[1]

    depth = Depth({n: trace(n, 8) for n in (3, 4, 6)})
    assert depth.ok and depth.at(8) == numbered(trace(8, 8))
    at_24 = trace(4, 24)
    other = depth.read(at_24)
    assert other is not None and other.at(8) == numbered(trace(8, 24))
    # a batch is read with the first of the rules learned so far whose events its copy has
    toy = Depth({n: toy_step(n) for n in (3, 4, 6)})
    assert toy.ok and toy.read(at_24) is None
    assert capacity._read_from_copy([toy, depth], (at_24, {}), 8) == other.at(8)
    assert capacity._read_from_copy([toy], (at_24, {}), 8) is None


# one GPU (with host memory), FSDP2 and ZeRO-3 (plain AdamW on one GPU: every one of them);
# ZeRO-3's opt-in (`heavy`): the default run holds its timeline read from the copies to the
# full depth's (test_a_deep_models_zero_timeline_from_shallow_copies_is_the_full_ones)
@pytest.mark.parametrize("method, world_size, sharding", [
    ("offload_activations", 1, "none"), ("checkpointing", 8, "fsdp"),
    pytest.param("lomo", 4, "zero3", marks=pytest.mark.heavy)])
def test_fit_rows_read_from_shallow_copies_are_the_full_depths_in_every_field(method, world_size, sharding,
                                                                             monkeypatch, capsys):
    """The first batch's split by category, parameter count, host memory and (FSDP2) what
    sharding adds, read from the copies, and the search's answers: the same as with every
    batch run at full depth."""
    def rows(from_depth: int) -> list[dict]:
        monkeypatch.setattr(capacity._Deep, "FROM_DEPTH", from_depth)
        capacity._TIMELINES.clear()  # ZeRO's timelines: read anew, or run anew
        capacity._READERS.clear()
        # ZeRO's reduce bucket alone is 1 GB in bfloat16 (500M elements): a larger GPU
        return fit.answer(model=DEEP, method=method, memory_gb=[1.48 if sharding.startswith("zero") else 0.55],
                          batch_size=8, seq_len=32,
                          dtype="bfloat16", max_batch=64, world_size=world_size, sharding=sharding)

    read = rows(8)
    said = re.search(r"read from shallow copies: batch ([\d, ]+)", capsys.readouterr().err)
    assert said and "8" in said.group(1).split(", ")  # the first batch too
    assert read == rows(9) and read[0]["largest_batch"] > 8  # a search beyond the first batch


def renumbered(timeline: zero.Timeline) -> zero.Timeline:
    """A timeline with its storages' keys replaced by allocation numbers (as a trace read
    from shallow copies has them): what two runs of one step share."""
    number, events, count = {}, [], 0  # a key -> its storage's number (an address is used again)
    for event in timeline.events:
        if event[0] == "alloc":
            number[event[1]], count = count, count + 1
        events.append((event[0], number[event[1]], *event[2:]))
    return replace(timeline, events=events)


@pytest.mark.parametrize("method", ["adamw", "lomo", "checkpointing", "lora"])
def test_a_timeline_read_back_from_its_labelled_trace_is_the_one_kept(method):
    """Each gradient's parameter, the modules' uses of their parameters, the optimizer steps
    and the categories, as events (`TimelineTracker(labelled=True)`), read back
    (`timeline_from_labelled`): the run's own timeline, and another run's unlabelled one."""
    job = Job(kind="memory", method=method, model="gpt2-tiny", batch_size=4, seq_len=32, simulate=True)
    timeline, trace, totals = zero.labelled_run(job, load(method))
    assert timeline.owner and timeline.uses and timeline.backwards
    assert bool(timeline.updates) == (method != "lomo")  # LOMO updates inside backward, no optimizer step
    assert zero.timeline_from_labelled(trace, timeline.params, totals) == timeline
    assert renumbered(zero.record_timeline(job, load(method))) == renumbered(timeline)


def test_a_deep_models_zero_timeline_from_shallow_copies_is_the_full_ones():
    """The ZeRO timeline of the 8-block model, read from the copies' labelled traces at the
    learning batch and (from the 4-block copy) at another: the full-depth run's in every field."""
    method = "checkpointing"  # its recomputation uses each block's parameters twice; LOMO's: the fit rows above
    job = Job(kind="memory", method=method, model=DEEP, batch_size=8, seq_len=32, dtype="bfloat16",
              simulate=True)
    reader = capacity._DeepTimelines(job)
    for batch in (8, 24):
        read, depth, _ = reader.at(batch)
        assert depth == ("3, 4 and 6" if batch == 8 else 4)
        assert read == renumbered(zero.record_timeline(replace(job, batch_size=batch), load(method)))


def test_a_copys_step_on_the_line_through_its_runs_is_its_run(monkeypatch):
    """The one-GPU search and ZeRO's timelines share a copy's runs (`capacity._copy_run`: each
    batch run once), and a batch between them on one line is computed from them
    (`capacity._copy_on_line`): the labelled trace and totals the copy's run at that batch
    gives, byte for byte; nothing beyond them."""
    capacity._COPIES.clear()
    job = Job(kind="memory", method="adamw", model=models.at_depth(DEEP, 4), batch_size=8, seq_len=32,
              dtype="bfloat16", simulate=True)
    run, runs = zero.labelled_run, []
    monkeypatch.setattr(zero, "labelled_run", lambda job, method: runs.append(job.batch_size) or run(job, method))
    for batch in (4, 8, 20, 8):
        capacity._copy_run(replace(job, batch_size=batch), DEEP)
    assert runs == [4, 8, 20]
    (trace, totals), line = capacity._copy_on_line(replace(job, batch_size=12), DEEP)
    assert line == [4, 8, 20]
    _, labelled, kept = run(replace(job, batch_size=12), load("adamw"))
    assert trace == numbered(labelled) and totals == kept
    assert capacity._copy_on_line(replace(job, batch_size=24), DEEP) is None
    capacity._COPIES.clear()


def test_zero_rows_from_the_one_gpu_searchs_copies_are_the_full_depths(monkeypatch, capsys):
    """ZeRO-3 after the one-GPU search (as `membench fit --gpus 1 4` answers them): its
    timelines read from the copies that search ran, some computed on their line, give the
    rows that every batch run at full depth gives."""
    def rows(from_depth: int) -> list[dict]:
        monkeypatch.setattr(capacity._Deep, "FROM_DEPTH", from_depth)
        for kept in (capacity._TIMELINES, capacity._READERS, capacity._COPIES):
            kept.clear()
        task = dict(model=DEEP, method="adamw", batch_size=8, seq_len=32, dtype="bfloat16", max_batch=64)
        fit.answer(**task, memory_gb=[0.55], world_size=1, sharding="none")
        return fit.answer(**task, memory_gb=[1.2, 1.48], world_size=4, sharding="zero3")

    read = rows(8)
    assert "its step not run: on the line through its batches" in capsys.readouterr().err
    assert read == rows(9)


def test_fsdp_rows_with_rules_learned_at_another_count_are_those_learned_at_it(monkeypatch, capsys):
    """FSDP2 at 4 ranks after 2 (as `membench fit --gpus 2 4 --sharding fsdp` answers them):
    its first batch read from the 4-block copy alone with the rules learned at 2 ranks gives
    the rows that learning at 4 ranks gives, in every field."""
    monkeypatch.setattr(capacity._Deep, "FROM_DEPTH", 8)
    task = dict(model=DEEP, method="checkpointing", batch_size=8, seq_len=32, dtype="bfloat16", max_batch=64,
                memory_gb=[0.3, 0.55], sharding="fsdp")
    capacity._RULES.clear()
    alone = fit.answer(**task, world_size=4)
    capacity._RULES.clear()
    fit.answer(**task, world_size=2)
    capsys.readouterr()
    after = fit.answer(**task, world_size=4)
    assert "read with the rules learned at another GPU count" in capsys.readouterr().err
    assert after == alone and alone[1]["largest_batch"] > 8
    capacity._RULES.clear()

"""Per-rank memory under DeepSpeed ZeRO stages 1, 2 and 3: a model, not a run.

DeepSpeed cannot run on fake tensors (flat buffers, `data_ptr` checks, C++ optimizers), so
its per-rank memory is modelled from one unsharded step tracked the way a memory job
tracks it (`record_timeline`: the allocation order and each storage's category), under
DeepSpeed's partitioning rules (`model_rank`). The model replays that timeline with the
parameter, gradient and optimizer allocations replaced by the sizes DeepSpeed allocates
on one rank, inserts DeepSpeed's transient buffers (reduce buckets; stage 3's gathered
parameters), and replays the result through the allocator model (`bench.measure.allocator`).

Rules, read in DeepSpeed 0.19.8 (`deepspeed/runtime/zero/`; line numbers of that release):

- Defaults (`config.py` 95-251): `reduce_bucket_size` 5e8 elements, `allgather_bucket_size`
  5e8, `contiguous_gradients` True, `overlap_comm` True for stage 3 and False otherwise
  (`overlap_comm_valid`, 384), `stage3_max_live_parameters` 1e9, `stage3_prefetch_bucket_size`
  5e7, `stage3_param_persistence_threshold` 1e5, `stage3_max_reuse_distance` 1e9.
- Precision (`engine.py` `get_data_types`, 1799): the model's dtype is float16/bfloat16 when
  enabled, else float32; gradients are kept in the model's dtype unless `grad_accum_dtype` is
  set. The optimizer always works on a float32 master partition, a copy even when the model
  is float32 (`stage_1_and_2.py` 565, `stage3.py` `_create_fp32_partitions`): the master
  partition and the optimizer's state on it are the ``optimizer`` category.
- Stage 1/2 padding (`stage_1_and_2.py` 441-446, `utils.py` `align_dense_tensors` 994): the
  trainable parameters of a group are flattened into one buffer padded to a multiple of
  2 x world_size elements (NCCL's 4-byte alignment for 16-bit elements); every rank keeps the
  whole flat buffer (``param``) and owns an equal partition of it, padded numel / world_size
  (`get_data_parallel_partitions`, 2559).
- Stage 1/2 gradients: with `contiguous_gradients` each gradient is copied into the reduce
  bucket, a preallocated buffer of `reduce_bucket_size` elements in the gradient dtype (two
  with `overlap_comm`), made at the first gradient of a backward (`setup_buckets`, 3256) and
  dropped at the end of it (`_release_ipg_buffers`, 924); the full gradient is freed once
  copied. Stage 2 reduces a bucket when the next gradient would overflow it, stage 1 after
  the whole backward (`reduce_gradients`, 958: its gradients stay full-size until then).
  What a rank keeps is `grads_in_partition` (2192): the whole gradient of every parameter
  that overlaps its partition (`get_partition_info`, 2579), so it differs by rank.
- Stage 3 (`partition_parameters.py` `_aligned_size` 1690, `_partition_param` 1816): each
  parameter is padded to a multiple of world_size and every rank keeps ceil(numel /
  world_size) elements (``param``); parameters of at most `param_persistence_threshold`
  elements stay whole on every rank (`parameter_offload.py` `mark_persistent_parameters`,
  317). Gradients go to a flat partition buffer made at start-up
  (`stage3.py` `grad_partitions_flat_buffer`, 791) and the reduce bucket (782) is made at
  start-up too and kept. A module's parameters are gathered before its forward or backward
  and released after it, unless their next use comes within `max_reuse_distance`
  gathered elements; at most `max_live_parameters` gathered elements stay live.
- ZeRO-Offload (`offload_optimizer`, `stage_1_and_2.py` 558-585, 936-950): the float32
  master partition, its gradient and the optimizer state live in host memory
  (``host_bytes``); the GPU keeps a gradient buffer of the largest parameter (746).

What the model leaves out (stated, not hidden): stage 3's prefetching (`prefetch_bucket_size`:
parameters gathered ahead of use) and the all-gather's own flat buffers; DeepSpeed's
temporaries inside its optimizer step (the flattened gradient, norms); the CUDA streams
(`overlap_comm` reduces on its own stream, a pool of its own); NCCL's buffers. All ranks keep
the same bytes except stage 1/2's `grads_in_partition`, which is modelled per rank.
"""
from __future__ import annotations

import bisect
import contextlib
import math
import os
import pickle
import tempfile
from dataclasses import astuple, dataclass, field
from functools import cached_property

import torch

from bench import models
from bench.job import CATEGORIES, Job
from bench.measure import allocator, step
from bench.measure.tracker import MemorySplit, MemoryTracker, cuda_kernels, labelled_peak
from bench.method import Method

DEEPSPEED_VERSION = "0.19.8"
F32 = 4
SHARDING_PARTS = ("bucket", "unsharded_grad", "gathered_param")


@dataclass(frozen=True)
class ZeroConfig:
    """The DeepSpeed settings that change a rank's memory; defaults are DeepSpeed 0.19.8's
    (`deepspeed/runtime/zero/config.py`)."""

    stage: int
    world_size: int
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000  # not modelled: stage 1/2's update all-gather is in place
    contiguous_gradients: bool = True
    overlap_comm: bool | None = None  # None: True for stage 3, else False (as DeepSpeed)
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    prefetch_bucket_size: int = 50_000_000  # not modelled (see the module docstring)
    param_persistence_threshold: int = 100_000
    offload_optimizer: bool = False

    @property
    def overlap(self) -> bool:
        return self.stage == 3 if self.overlap_comm is None else self.overlap_comm

    def deepspeed(self) -> dict:
        """The `zero_optimization` section of a DeepSpeed config with these settings."""
        out = {"stage": self.stage, "reduce_bucket_size": self.reduce_bucket_size,
               "allgather_bucket_size": self.allgather_bucket_size,
               "contiguous_gradients": self.contiguous_gradients, "overlap_comm": self.overlap}
        if self.stage == 3:
            out.update(stage3_max_live_parameters=self.max_live_parameters,
                       stage3_max_reuse_distance=self.max_reuse_distance,
                       stage3_prefetch_bucket_size=self.prefetch_bucket_size,
                       stage3_param_persistence_threshold=self.param_persistence_threshold)
        if self.offload_optimizer:
            out["offload_optimizer"] = {"device": "cpu"}
        return out


# -- the partitioning arithmetic ---------------------------------------------------------
def flat_padded_numel(numels, world_size: int) -> int:
    """Stage 1/2: elements of the flat parameter buffer, padded to a multiple of
    2 x world_size (`stage_1_and_2.py` 441-446)."""
    align = 2 * world_size
    return -(-sum(numels) // align) * align


def flat_partition_numel(numels, world_size: int) -> int:
    """Stage 1/2: elements each rank owns of the flat buffer."""
    return flat_padded_numel(numels, world_size) // world_size


def grads_in_partition_numel(numels, world_size: int, rank: int) -> int:
    """Stage 1/2: elements of the gradients rank `rank` keeps after reduction: every
    parameter that overlaps its partition, whole (`get_partition_info`, `copy_grads_in_partition`)."""
    size = flat_partition_numel(numels, world_size)
    start, end = size * rank, size * (rank + 1)
    total = offset = 0
    for n in numels:
        if start <= offset < end or offset < start < offset + n:
            total += n
        offset += n
    return total


def stage3_partition_numel(numel: int, world_size: int) -> int:
    """Stage 3: elements every rank keeps of one parameter, ceil(numel / world_size)
    (`partition_parameters.py` `_aligned_size`)."""
    return -(-numel // world_size)


def persistent(numel: int, cfg: ZeroConfig) -> bool:
    """Stage 3: a parameter small enough to stay whole on every rank."""
    return cfg.stage == 3 and numel <= cfg.param_persistence_threshold


# -- the unsharded timeline --------------------------------------------------------------
@dataclass
class Timeline:
    """One unsharded step's allocations, as a memory job tracks them (warm-up + measured).

    `events`: ("alloc", key, nbytes) / ("free", key) in order; `labels[i]`: the last
    category of the storage allocated at event i; `owner[i]`: the parameter (its index in
    `params`) whose gradient that storage became; `params`: (numel, element size, trainable)
    per parameter; `uses`: ("use"/"done", event index, parameter indices) at each module's
    forward and backward; `measured_from`: the event where the measured step starts;
    `updates`: (start, end) event indices of each optimizer step; `backwards`: (start, end)
    of each backward."""

    events: list
    labels: dict
    owner: dict
    params: list
    uses: list = field(default_factory=list)
    measured_from: int = 0
    updates: list = field(default_factory=list)
    backwards: list = field(default_factory=list)
    optimizer_scalars: int = 0  # bytes of 0-d optimizer state (step counters)
    state_per_element: int = 0  # per-element optimizer tensors (AdamW: 2)
    unsharded: dict = field(default_factory=dict)  # the job's own memory row

    @cached_property
    def use_index(self) -> tuple[list, list, dict]:
        """The module uses ("use", not "done"), in order: their event indices, the running
        total of the elements they use (total[j]: the uses before the j-th), and per
        parameter the positions of the uses that hold it (`_next_use_distance` reads it)."""
        events, total, where = [], [0], {}
        for kind, i, own in self.uses:
            if kind != "use":
                continue
            if events and i < events[-1]:
                raise ValueError("a timeline's uses are in event order")
            for p in own:
                where.setdefault(p, []).append(len(events))
            events.append(i)
            total.append(total[-1] + sum(self.params[q][0] for q in own))
        return events, total, where


class TimelineTracker(MemoryTracker):
    """`MemoryTracker` that also keeps, per allocation event, the storage's last category
    and which parameter's gradient it became (`Timeline.labels`, `Timeline.owner`), with
    events numbered as `Timeline.events` numbers them (allocations and frees: `count`).

    `labelled`: its events say each storage's category (`MemoryTracker`) and also what the
    timeline keeps beside them, as events a deep model's trace can be read with from shallow
    copies of it (`bench.measure.trace_depth`; `timeline_from_labelled` reads them back):
    ("grad_of", gradient's storage, "grad") then ("grad_of", parameter's storage, "param")
    where a gradient is accumulated; ("use" or "done", a parameter's storage, (i, n)) for
    the i-th of the n parameters of a module at its forward or backward; ("mark", "update")
    and ("mark", "updated") around each optimizer step."""

    def __init__(self, labelled: bool = False, **kwargs):
        super().__init__(events=[], labelled=labelled, **kwargs)
        self.labels: dict[int, str] = {}
        self.owner: dict[int, int] = {}
        self._index: dict[int, int] = {}  # storage key -> its alloc event
        self._param_index: dict[int, int] = {}
        self._count = self._read = 0  # allocations and frees so far; events read so far

    @property
    def count(self) -> int:
        """Allocations and frees so far: the index `Timeline.events` gives the next one."""
        self._sync()
        return self._count

    def _sync(self) -> None:
        """Number the allocations and frees made since the last call."""
        for event in self.events[self._read:]:
            if event[0] == "alloc":
                self._index[event[1]] = self._count
                # its category now (read right after `_add`: still alive, unless an error cut in)
                self.labels[self._count] = event[3] if self.labelled else self._live.get(event[1], (0, "other"))[1]
            if event[0] in ("alloc", "free"):
                self._count += 1
        self._read = len(self.events)

    def _add(self, tensor, category, pinned, relabel):
        super()._add(tensor, category, pinned, relabel)
        self._sync()

    def _relabel(self, key, entry, category):
        super()._relabel(key, entry, category)
        self._sync()
        if key in self._index:
            self.labels[self._index[key]] = category

    def register_model(self, model):
        super().register_model(model)
        self._param_index = {id(p): i for i, p in enumerate(model.parameters())}

    def _on_grad(self, param):
        super()._on_grad(param)
        if param.grad is not None:
            self._sync()
            key = param.grad.untyped_storage()._cdata
            index = self._index.get(key)
            if index is not None:
                self.owner[index] = self._param_index[id(param)]
                if self.labelled:
                    self.events += [("grad_of", key, "grad"), ("grad_of", param.untyped_storage()._cdata, "param")]

    def mark(self, name: str) -> None:
        if self.labelled:
            self.events.append(("mark", name))


def _watch_modules(model, tracker: TimelineTracker, uses: list):
    """Mark each module's forward and backward (the modules that hold parameters directly),
    with the indices of its parameters: stage 3 gathers them there.

    The backward marks hang on the graph the forward made and add no node to it: "use" as
    the node that made the module's output starts (a pre-hook), "done" once the module's
    nodes that give its inputs their gradients have run (post-hooks on them), or right after
    "use" where no input needs a gradient (the embedding's token ids), as a full backward
    hook fires. A full backward hook (`register_full_backward_hook`) would wrap the inputs and
    outputs in nodes of its own that hold gradients longer: frees move, and the timeline would
    not be the memory job's trace (`capacity._Deep` reads that from the same runs)."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    handles = []
    for module in model.modules():
        params = [p for p in module.parameters(recurse=False) if id(p) in index]
        if not params:
            continue
        own = [index[id(p)] for p in params]

        def mark(kind, own=own, params=params):
            uses.append((kind, tracker.count, own))
            if tracker.labelled:
                tracker.events.extend((kind, p.untyped_storage()._cdata, (i, len(params)))
                                      for i, p in enumerate(params))

        def after(_, args, kwargs, output, mark=mark):
            mark("done")
            out = next((t for t in (output if isinstance(output, (tuple, list)) else (output,))
                        if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
            if out is not None and torch.is_grad_enabled():
                inputs = [t.grad_fn for t in (*args, *kwargs.values())
                          if isinstance(t, torch.Tensor) and t.grad_fn is not None]
                _mark_backward(out.grad_fn, inputs, mark)

        handles += [module.register_forward_pre_hook(lambda *_, mark=mark: mark("use")),
                    module.register_forward_hook(after, with_kwargs=True)]
    return handles


def _mark_backward(node, inputs: list, mark) -> None:
    """Hooks on the graph from `node` (a module's output) back to the module's `inputs`
    (their nodes): "use" before `node` runs, "done" after the last of the nodes that give
    an input its gradient (`_watch_modules`)."""
    edges, seen, todo = [], {node}, [node]
    while todo:
        n = todo.pop()
        if any(nxt in inputs for nxt, _ in n.next_functions):
            edges.append(n)
        for nxt, _ in n.next_functions:
            if nxt is not None and nxt not in seen and nxt not in inputs and nxt.next_functions:
                seen.add(nxt)
                todo.append(nxt)
    left, at_once = [len(edges)], not edges  # the hooks hold no node: a node holding itself is never freed

    def use(*_):
        mark("use")
        if at_once:
            mark("done")

    def ran(*_):
        left[0] -= 1
        if left[0] == 0:
            mark("done")

    node.register_prehook(use)
    for n in edges:
        n.register_hook(ran)


def record_timeline(job: Job, method: Method) -> Timeline:
    """Run the memory job's two steps (`kinds._memory`: warm-up, then the measured step; on
    fake tensors if `job.simulate`) under `TimelineTracker`, and return the timeline."""
    return labelled_run(job, method, labelled=False)[0]


def labelled_run(job: Job, method: Method, labelled: bool = True) -> tuple[Timeline, list, dict]:
    """`record_timeline`'s run, and its tracker's events (labelled: see `TimelineTracker`)
    and what the timeline counts beside them (`totals`: parameters, the optimizer's scalar
    bytes and per-element state elements, trainable elements), as `timeline_from_labelled`
    takes them."""
    fake = step.fake_mode() if job.simulate else None
    model, stream = step.setup(job, method, fake)
    tracker = TimelineTracker(labelled=labelled)
    take_batch = step.batch_feeder(stream, job.device, fake, tracker)
    tracker.register_model(model)
    uses: list = []
    handles = _watch_modules(model, tracker, uses)
    updates = []

    def update_starts(*_):
        updates.append([tracker.count, None])
        tracker.mark("update")

    def update_ends(*_):
        updates[-1][1] = tracker.count
        tracker.mark("updated")

    def hooked(optimizer):
        optimizer.register_step_pre_hook(update_starts)
        optimizer.register_step_post_hook(update_ends)

    measured_from = []

    @contextlib.contextmanager
    def measured():
        measured_from.append(tracker.count)
        yield

    with fake or contextlib.nullcontext(), tracker, cuda_kernels():
        # "warm-up": where a search's batch starts its replays (`capacity._Simulation`)
        optimizer, loss = step.memory_steps(method, model, tracker, take_batch, on_optimizer=hooked,
                                            after_warm_up=lambda: tracker.mark("warm-up"), measured=measured())
        del loss
        state = method.state_tensors(optimizer)
    for h in handles:
        h.remove()
    totals = {"n_params": models.n_params(model),
              "optimizer_scalars": sum(t.untyped_storage().nbytes() for t in state if t.numel() == 1),
              "state_elements": sum(t.numel() for t in state if t.numel() > 1),
              "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
              **tracker.host_row()}
    params = [(p.numel(), p.element_size(), p.requires_grad) for p in model.parameters()]
    trace = list(tracker.events)  # as the step left them (the model's frees when it goes are not the step's)
    events = [e[:3] for e in trace if e[0] in ("alloc", "free")] if labelled else trace
    timeline = _assemble(events, dict(tracker.labels), dict(tracker.owner), params, uses, measured_from[0],
                         [tuple(u) for u in updates], totals, tracker.peak_split)
    return timeline, trace, totals


def memory_trace(trace: list) -> list:
    """A labelled run's trace (`labelled_run`) as the memory job's tracker keeps it: without
    the events only the timeline reads (`TimelineTracker`: each gradient's parameter, the
    modules' uses, the optimizer steps)."""
    return [e for e in trace if e[0] not in ("grad_of", "use", "done") and e not in _UPDATE_MARKS]


_UPDATE_MARKS = (("mark", "update"), ("mark", "updated"))


def _assemble(events, labels, owner, params, uses, measured_from, updates, totals, split) -> Timeline:
    backwards = []  # a backward's gradients: from its first to its last (DeepSpeed's hooks run at each)
    for lo, hi in ((0, measured_from), (measured_from, len(events))):
        made = [i for i in owner if lo <= i < hi]
        if made:
            backwards.append((min(made), max(made) + 1))
    return Timeline(events, labels, owner, params, uses, measured_from, updates, backwards,
                    totals["optimizer_scalars"], totals["state_elements"] // max(1, totals["trainable"]),
                    {**split.as_row(), "n_params": totals["n_params"], "host_peak_bytes": totals["host_peak_bytes"],
                     "transfer_bytes": totals["transfer_bytes"]})


def timeline_from_labelled(trace: list, params: list, totals: dict) -> Timeline:
    """The timeline a `TimelineTracker(labelled=True)` run's events say (or a trace read from
    them, keys renumbered: `trace_depth.Depth.at`), with the model's `params` ((numel,
    element size, trainable) each) and `totals` (`labelled_run`): the one `record_timeline`
    gives for that run, keys aside. A parameter's index is the order its storage was
    registered in (`register_model`: the first allocations of category param)."""
    events, labels, owner, uses, updates = [], {}, {}, [], []
    index: dict = {}  # key -> its alloc event
    param_of: dict = {}  # a parameter's storage key -> its index
    measured_from, grad = None, None
    for event in trace:
        kind = event[0]
        if kind == "alloc":
            index[event[1]] = len(events)
            labels[len(events)] = event[3]
            if event[3] == "param" and len(events) == len(param_of) < len(params):  # the first allocations
                param_of[event[1]] = len(param_of)
            events.append(event[:3])
        elif kind == "free":
            events.append(event[:2])
        elif kind == "label":
            if event[1] in index:
                labels[index[event[1]]] = event[2]
        elif kind == "grad_of":
            if event[2] == "grad":
                grad = index[event[1]]
            else:
                owner[grad] = param_of[event[1]]
        elif kind in ("use", "done"):
            i, n = event[2]
            if i == 0:
                uses.append((kind, len(events), []))
            uses[-1][2].append(param_of[event[1]])
        elif event == ("mark", "peak"):
            measured_from = len(events)
        elif event == ("mark", "update"):
            updates.append((len(events), None))
        elif event == ("mark", "updated"):
            updates[-1] = (updates[-1][0], len(events))
    split, _ = labelled_peak(trace)
    return _assemble(events, labels, owner, params, uses, measured_from, updates, totals, split)


# -- the model ---------------------------------------------------------------------------
@dataclass
class _Sizes:
    """What one rank of DeepSpeed allocates for the model's state (elements and bytes)."""

    param: int  # bytes of the parameters every rank keeps (full or partition)
    master: int  # bytes of the float32 master partition
    state: int  # bytes of the optimizer's state on the master partition
    grad: int  # bytes of the gradients a rank keeps for its update
    bucket: int  # bytes of one reduce bucket
    flat_grad: int  # bytes of the flattened gradient partition its optimizer step reads


def state_sizes(tl: Timeline, cfg: ZeroConfig, rank: int = 0) -> _Sizes:
    """Per-rank bytes of DeepSpeed's state for stage `cfg.stage` (see the module docstring
    for each rule's source)."""
    trainable = [(n, e) for n, e, t in tl.params if t]
    frozen = sum(n * e for n, e, t in tl.params if not t)
    numels = [n for n, _ in trainable]
    e = trainable[0][1]  # the model's dtype (DeepSpeed's gradients are in it too)
    N = cfg.world_size
    if cfg.stage in (1, 2):
        part = flat_partition_numel(numels, N)
        param = flat_padded_numel(numels, N) * e + frozen
        grad = grads_in_partition_numel(numels, N, rank) * e
        steps = F32  # one flat parameter per group: one step counter
    else:
        part = sum(stage3_partition_numel(n, N) for n in numels)
        param = sum(n * e if persistent(n, cfg) else stage3_partition_numel(n, N) * e for n in numels) + frozen
        # persistent parameters keep their partition too (`_partition_param` makes it for every parameter)
        param += sum(stage3_partition_numel(n, N) * e for n in numels if persistent(n, cfg))
        grad = part * e
        steps = F32
    return _Sizes(param=param, master=part * F32, state=tl.state_per_element * part * F32 + steps,
                  grad=grad, bucket=cfg.reduce_bucket_size * e, flat_grad=part * e)


def model_rank(tl: Timeline, cfg: ZeroConfig, rank: int = 0) -> dict:
    """Rank `rank`'s memory under ZeRO stage `cfg.stage` on `cfg.world_size` ranks, modelled:
    `memory` (tier "modelled", the five categories at the peak, `peak_bytes`, the allocator
    replay), `sharding` (the part of `other` at the peak that ZeRO adds: reduce buckets,
    full gradients not yet reduced, gathered parameters), `before_update` (param, grad,
    optimizer as the optimizer step begins), `host_bytes` (ZeRO-Offload), the events and
    their unlimited replay (`replay`)."""
    events, labels, parts, marks = _zero_events(tl, cfg, rank)
    split, sharding, before = _peak(events, labels, parts, marks)
    replayed = allocator.replay(events[:])
    sizes = state_sizes(tl, cfg, rank)
    host = sizes.master + sizes.state + sizes.master if cfg.offload_optimizer else 0
    return {"stage": cfg.stage, "world_size": cfg.world_size, "rank": rank, "tier": "modelled",
            "memory": {"tier": "modelled", **split.as_row(),
                       "predicted_allocated_peak_bytes": replayed.allocated_peak_bytes,
                       "reserved_peak_bytes": replayed.reserved_peak_bytes},
            "sharding": {**sharding, "bytes": sum(sharding.values())},
            "before_update": before, "host_bytes": host, "events": events, "replay": replayed,
            "config": cfg.deepspeed(), "deepspeed_version": DEEPSPEED_VERSION}


def model_ranks(tl: Timeline, cfg: ZeroConfig) -> dict:
    """Rank 0 and the rank with the largest peak (stage 1/2's kept gradients differ by rank;
    the lowest of equal peaks). A rank's events follow from its state's sizes alone, so of
    the ranks with the same sizes (every rank at stage 3) the lowest is modelled."""
    same: dict[tuple, int] = {}  # a rank's sizes -> the lowest rank with them
    for r in range(cfg.world_size) if cfg.world_size <= 64 else (0, cfg.world_size - 1):
        same.setdefault(astuple(state_sizes(tl, cfg, r)), r)
    ranks = [model_rank(tl, cfg, r) for r in same.values()]
    return {"rank0": ranks[0], "max": max(ranks, key=lambda r: r["memory"]["peak_bytes"])}


def _zero_events(tl: Timeline, cfg: ZeroConfig, rank: int):
    """The unsharded timeline rewritten for one ZeRO rank: (events, label per new key,
    sharding part per new key, marks: the event index where the measured step starts and
    where each optimizer step starts)."""
    sizes = state_sizes(tl, cfg, rank)
    e = tl.params[0][1]
    out, labels, parts = [], {}, {}
    marks = {"measured": 0, "updates": []}
    counter = [0]

    def alloc(nbytes, label, part=None):
        counter[0] += 1
        key = ("zero", counter[0])
        if nbytes:
            out.append(("alloc", key, nbytes))
            labels[key] = label
            if part:
                parts[key] = part
        return key

    def free(key):
        if key in labels:
            out.append(("free", key))

    starts = {b[0] for b in tl.backwards}
    ends = {b[1] for b in tl.backwards}
    update_starts = {u[0] for u in tl.updates}
    update_ends = {u[1] for u in tl.updates}
    uses_at: dict[int, list] = {}
    for kind, at, own in tl.uses:
        uses_at.setdefault(at, []).append((kind, own))
    renamed: dict = {}  # unsharded key -> new key (None: dropped, the model's state replaces it)
    st = {"state_made": False, "params_made": False, "keep": None, "pending": [], "pending_numel": 0,
          "buckets": []}
    gathered: dict[int, object] = {}
    gathered_numel = [0]
    partitioned = cfg.stage in (1, 2)
    update_scale = sizes.master / F32 / max(1, sum(n for n, _, t in tl.params if t))

    def reduce_pending():
        if st["keep"] is None and not cfg.offload_optimizer:
            st["keep"] = alloc(sizes.grad, "grad")
        for key in st["pending"]:
            free(key)
        st["pending"], st["pending_numel"] = [], 0

    if cfg.stage == 3 and cfg.contiguous_gradients:  # made at start-up and kept (stage3.py 782)
        alloc(sizes.bucket, "other", "bucket")
    for i, event in enumerate(tl.events):
        if i == tl.measured_from:
            marks["measured"] = len(out)
        if i in update_starts:
            marks["updates"].append(len(out))
        if i in starts and partitioned and cfg.contiguous_gradients and not cfg.offload_optimizer:
            st["buckets"] = [alloc(sizes.bucket, "other", "bucket") for _ in range(2 if cfg.overlap else 1)]
        if cfg.stage == 3:
            for kind, own in uses_at.get(i, []):
                _stage3_use(kind, own, tl, cfg, gathered, gathered_numel, alloc, free, i)
        if event[0] == "alloc":
            key, label = event[1], tl.labels.get(i, "other")
            if label == "param":
                renamed[key] = None
                if not st["params_made"]:
                    st["params_made"] = True
                    alloc(sizes.param, "param")
                    if not cfg.offload_optimizer:
                        alloc(sizes.master, "optimizer")
                    if cfg.stage == 3:
                        alloc(sizes.grad, "grad")  # grad_partitions_flat_buffer, made at start-up
            elif label == "optimizer":
                renamed[key] = None
                if not st["state_made"]:
                    st["state_made"] = True
                    if not cfg.offload_optimizer:
                        alloc(sizes.state, "optimizer")
            elif label == "grad" and i in tl.owner:
                renamed[key] = None
                n = tl.params[tl.owner[i]][0]
                if cfg.offload_optimizer and partitioned:
                    continue  # to the host, through a buffer of the largest parameter
                full = alloc(n * e, "other", "unsharded_grad")
                if cfg.stage == 3:
                    free(full)  # reduce-scattered into the partition by its hook
                elif cfg.stage == 2:
                    if st["pending_numel"] + n > cfg.reduce_bucket_size and st["pending_numel"]:
                        reduce_pending()
                    st["pending_numel"] += n
                    if cfg.contiguous_gradients:
                        free(full)  # copied into the bucket by its hook
                    else:
                        st["pending"].append(full)
                else:  # stage 1: full until the backward ends (reduce_gradients)
                    st["pending"].append(full)
            elif label == "other" and _in_update(i, tl):
                # the optimizer's temporaries, for the rank's partition instead of the model
                renamed[key] = alloc(event[2] if event[2] <= F32 else max(1, round(event[2] * update_scale)),
                                     "other")
            else:
                renamed[key] = alloc(event[2], label)
        else:
            new = renamed.pop(event[1], None)
            if new is not None:
                free(new)
        if i + 1 in ends and partitioned:
            if not cfg.offload_optimizer:
                reduce_pending()
            for key in st["buckets"]:
                free(key)
            st["buckets"] = []
        if i + 1 in update_ends and st["keep"] is not None:
            free(st["keep"])  # zero_grad after the update drops the partition's gradients
            st["keep"] = None
    return out, labels, parts, marks


def _in_update(i: int, tl: Timeline) -> bool:
    return any(start <= i < end for start, end in tl.updates if end is not None)


def _stage3_use(kind, own, tl, cfg, gathered, gathered_numel, alloc, free, at) -> None:
    """Stage 3: gather a module's partitioned parameters before its forward/backward (the
    full parameter, padded, in the model's dtype) and release them after, unless their next
    use is within `max_reuse_distance` gathered elements; never more than
    `max_live_parameters` elements live (the oldest released first)."""
    e = tl.params[0][1]
    N = cfg.world_size
    if kind == "use":
        for p in own:
            n = tl.params[p][0]
            if p in gathered or persistent(n, cfg) or N == 1:
                continue
            while gathered and gathered_numel[0] + n > cfg.max_live_parameters:
                old = next(iter(gathered))
                free(gathered.pop(old))
                gathered_numel[0] -= tl.params[old][0]
            gathered[p] = alloc(stage3_partition_numel(n, N) * N * e, "other", "gathered_param")
            gathered_numel[0] += n
    else:
        for p in own:
            if p not in gathered:
                continue
            if _next_use_distance(tl, p, at) <= cfg.max_reuse_distance:
                continue
            free(gathered.pop(p))
            gathered_numel[0] -= tl.params[p][0]


def _next_use_distance(tl: Timeline, p: int, at: int) -> float:
    """Elements gathered between now and parameter `p`'s next use (inf if none in the
    step), DeepSpeed's reuse distance: the elements of the modules' uses after event `at`
    and before the first that uses `p` (read from `Timeline.use_index`, not by a scan per call)."""
    events, total, where = tl.use_index
    start = bisect.bisect_right(events, at)  # the first use after `at`
    positions = where.get(p, [])
    k = bisect.bisect_left(positions, start)
    return math.inf if k == len(positions) else total[positions[k]] - total[start]


def _peak(events, labels, parts, marks):
    """The peak over the measured step (from its first event on), its split, the sharding
    part at it, and the state as the measured step's optimizer step begins."""
    sizes_by_key = {}
    totals = dict.fromkeys(CATEGORIES, 0)
    part_totals = dict.fromkeys(SHARDING_PARTS, 0)
    peak = now = 0
    split, sharding, before = MemorySplit(), dict(part_totals), {}
    update = max(marks["updates"]) if marks["updates"] else None
    for j, event in enumerate(events + [None]):
        if j == marks["measured"]:
            peak = now
            split, sharding = MemorySplit(**totals), dict(part_totals)
        if j == update:
            before = {c: totals[c] for c in ("param", "grad", "optimizer")}
        if event is None:
            break
        key = event[1]
        if event[0] == "alloc":
            sizes_by_key[key] = n = event[2]
        else:
            n = -sizes_by_key.pop(key)
        totals[labels[key]] += n
        if key in parts:
            part_totals[parts[key]] += n
        now += n
        if j >= marks["measured"] and now > peak:
            peak = now
            split, sharding = MemorySplit(**totals), dict(part_totals)
    return split, sharding, before


# -- DeepSpeed itself, on the CPU (the check) ---------------------------------------------
def deepspeed_ranks(job: Job, cfg: ZeroConfig) -> list[dict]:
    """Run DeepSpeed (`deepspeed.initialize`, ZeRO stage `cfg.stage`, the job's model and
    batch, `torch.optim.AdamW` as the client optimizer, float32) on `cfg.world_size` CPU
    processes over gloo (`DS_ACCELERATOR=cpu`), a warm-up step then a measured step under
    `MemoryTracker`; per rank: `before_update` (param, grad, optimizer as the optimizer step
    begins, from DeepSpeed's own buffers) and `memory` (the measured step's peak split)."""
    import torch.multiprocessing as mp

    from bench.measure.sharded import free_port

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_deepspeed_rank, args=(cfg, free_port(), job.to_dict(), folder), nprocs=cfg.world_size, join=True)
        out = []
        for rank in range(cfg.world_size):
            with open(os.path.join(folder, f"rank{rank}.pkl"), "rb") as f:
                out.append(pickle.load(f))
    return out


def _deepspeed_state(optimizer, stage: int) -> dict[str, list]:
    """DeepSpeed's persistent tensors of one rank by category."""
    inner = [t for s in optimizer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    if stage in (1, 2):
        return {"param": list(optimizer.bit16_groups_flat),
                "optimizer": list(optimizer.single_partition_of_fp32_groups) + inner, "grad": []}
    params = [p.ds_tensor for group in optimizer.fp16_groups for p in group]
    return {"param": params, "optimizer": list(optimizer.fp32_partitioned_groups_flat) + inner,
            "grad": [optimizer.grad_partitions_flat_buffer]}


def _deepspeed_rank(rank: int, cfg: ZeroConfig, port: int, job_dict: dict, folder: str) -> None:
    import gc
    import logging

    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(cfg.world_size), LOCAL_RANK=str(rank), LOCAL_SIZE=str(cfg.world_size))
    torch.set_num_threads(1)
    import deepspeed

    from bench.method import load

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    job = Job.from_dict(job_dict)
    method = load(job.method, job.hparams)
    model, stream = step.setup(job, method)
    config = {"train_micro_batch_size_per_gpu": job.batch_size, "zero_optimization": cfg.deepspeed(),
              "zero_allow_untested_optimizer": True}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                                                   config=config)
    batches = [step.next_batch(stream, job.device) for _ in range(2)]

    def one_step(batch, tracker=None):
        loss = method.loss(engine.module, batch)
        engine.backward(loss)
        before = None
        if tracker is not None:
            state = _deepspeed_state(optimizer, cfg.stage)
            if cfg.stage in (1, 2):  # what the update reads: the kept gradients
                state["grad"] = [t for ts in optimizer.averaged_gradients.values() for t in ts]
            tracker.label(state["grad"], "grad")
            before = {c: _storage_bytes(state[c]) for c in ("param", "grad", "optimizer")}
        engine.step()
        return before

    with cuda_kernels():
        one_step(batches[0])
        tracker = MemoryTracker(events=[])
        state = _deepspeed_state(optimizer, cfg.stage)
        for category in ("param", "optimizer", "grad"):
            tracker.register(state[category], category)
        gc.collect()
        tracker.register([t for t in gc.get_objects() if isinstance(t, torch.Tensor)
                          and t.untyped_storage()._cdata not in tracker.live_bytes()], "other")
        tracker.register(batches[1].values(), "other")
        with tracker:
            before = one_step(batches[1], tracker)
    result = {"rank": rank, "before_update": before, "memory": tracker.peak_split.as_row(),
              "optimizer_class": type(optimizer).__name__, "deepspeed_version": deepspeed.__version__}
    with open(os.path.join(folder, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    torch.distributed.destroy_process_group()


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (views of one buffer counted once)."""
    seen = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())

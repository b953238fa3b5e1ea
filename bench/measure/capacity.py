"""The largest batch, and the largest model, that fits per memory size: searches, not grids.

`fits(B, C)` asks whether a training step at batch B (a memory job: a warm-up step, then
a measured step) fits in C GiB. How it is answered depends on the tier:

- simulated (fake tensors, CPU): the step's allocation trace is replayed through the
  CUDA caching-allocator model (`bench.measure.allocator`) with C minus the CUDA context;
  each batch is its memory job on a fresh fake model (`_Simulation`), whose one trace
  answers every C;
- tracked (real tensors, CPU): a real run at B, uncapped; the tracker counts live tensor
  bytes exactly, and a run capped at C raises exactly when they exceed C (the same run up
  to that moment), so the uncapped run's peak (over both steps) answers every C at once;
- measured (CUDA): a real run with the allocator capped at C
  (`set_per_process_memory_fraction`); an out-of-memory error is "does not fit".

Peak memory is close to linear in the batch (activations grow with it, the rest does
not), so two probes give a line, the line gives a guess per C, and the search gallops and
bisects from the guess to the boundary: the answer B fits and B + one unit (the method's micro-batch
count, since a batch must split into equal micro-batches) does not, both answered by their
step, never extrapolated: simulated, run or derived byte for byte from steps run (a deep
model's shallow copies, `_Deep`; the batch line, `trace_line`); on CUDA, both run under the
capped allocator. Every run is kept in the result as evidence.

The largest model (`search_model`) is the same search over the family's ladder of sizes
(`bench.models.ladder`) at a fixed batch: peak memory grows about geometrically along
it, so the secant steps work on log bytes.

Public: `search`, `search_model`, and the parts `membench fit` (`bench.fit`) builds its
own search from: `Oracle` (runs memory jobs, answers fits(B, C)), `guess_largest` (the
interpolated guess) and `largest_fitting` (gallop and bisect to the boundary).
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import replace

from bench import models
from bench.measure import allocator, kinds, step, trace_depth, trace_line
from bench.measure.cost import StepCost
from bench.measure.tracker import MemoryTracker, cuda_kernels, labelled_peak
from bench.method import load
from bench.job import Job


def search(job: Job, memory_gb: list[float], max_batch: int, unit: int) -> dict:
    """Largest batch (a multiple of `unit`, at most `max_batch`) that fits in each memory
    size; `job` gives the model, method and settings (its batch size is not used).
    Simulated, the search's steps count no FLOPs (so a deep model's batches are read from
    its shallow copies and the batch line, `_Deep`, `trace_line`); each answer's cost is
    its memory job's at full depth, run once per answer (`_cost`)."""
    oracle = Oracle(job, unit, cost=False)  # (a run on real tensors keeps its memory job's cost)
    costs: dict[int, dict] = {}  # answer -> its cost
    sizes = []
    for gb in sorted(memory_gb):
        capacity = int(gb * 2**30)
        most = max(1, max_batch // unit)
        known = lambda: {b // unit: n for b, n in oracle.needs().items() if b % unit == 0}  # noqa: E731
        guess = guess_largest(lambda k: oracle.need(k * unit), known, capacity, most, probes=(1, 8))
        k = largest_fitting(lambda k: oracle.fits(k * unit, capacity), guess, max_batch // unit)
        best = k * unit
        print(f"[capacity {job.method} {job.model}] {gb:g} GiB: largest batch {best}"
              f"{' (the cap)' if best and k == max_batch // unit else ''}; {len(oracle.runs)} runs "
              f"so far", file=sys.stderr, flush=True)
        record = oracle.records.get(best) or oracle.capped.get((best, capacity))
        if oracle.simulated and record and not oracle.error and best not in costs:
            costs[best] = _cost(job, best)
        sizes.append({"memory_gb": gb, "largest_batch": best, "at_max_batch": k == max_batch // unit,
                      "needed_bytes_at_largest": oracle.need_of(record) if record else None,
                      "cost_at_largest": costs.get(best) if oracle.simulated else (record or {}).get("cost")})
    oracle.close()
    return {"tier": oracle.tier, "unit": unit, "max_batch": max_batch,
            "context_bytes": allocator.CUDA_CONTEXT_BYTES if oracle.simulated else 0,
            "sizes": sizes, "runs": oracle.runs, "error": oracle.error}


def _cost(job: Job, batch: int) -> dict:
    """The FLOPs and bytes moved of `job`'s step at `batch` (`StepCost`), from its simulated
    memory job at full depth."""
    return _run_batch(replace(job, kind="memory", batch_size=batch, capacity_gb=None))[0]["cost"]


def search_model(job: Job, memory_gb: list[float], unit: int) -> dict:
    """Largest size of the model's family (from `job.model` up `models.ladder`) whose
    training step at `job.batch_size` fits each memory size. Rung by rung as the batch
    search goes batch by batch (probes, secant steps on log bytes, then a boundary where
    one size fits and the next does not, both answered as that search answers them), with
    one shortcut: a size whose weights alone exceed the memory cannot fit, and is not built
    (under FSDP2 or ZeRO-3, a rank's share of them). Under a sharding scheme each rung's
    step is the memory of one of `job.world_size` GPUs: FSDP2's rank 0 simulated
    (`_Simulation`), ZeRO's largest rank modelled (`_ZeroRuns`)."""
    rungs = models.ladder(job.model)
    runs: list[dict] = []
    oracles: dict[int, Oracle] = {}
    weights = {}  # rung -> (parameters, bytes of the weights), from a build on the meta device
    noted: set = set()  # (rung, capacity) whose weights were found to exceed it
    biggest = int(max(memory_gb) * 2**30)

    def weight_bytes(i: int) -> int:
        if i not in weights:
            import torch

            with torch.device("meta"):
                n = models.n_params(models.build(rungs[i], job.attn_implementation))
            # a rank's share where the scheme shards the parameters (FSDP2, ZeRO-3)
            share = job.world_size if job.sharding in ("fsdp", "zero3") else 1
            weights[i] = (n, n * step.DTYPES[job.dtype].itemsize // share)
        return weights[i][1]

    def oracle(i: int) -> Oracle:  # a rung's step: its cost is not reported (its FLOPs not counted)
        if i not in oracles:
            oracles[i] = Oracle(replace(job, model=rungs[i]), unit, runs, cost=False)
        return oracles[i]

    def too_large(i: int, capacity: int) -> bool:
        if weight_bytes(i) <= capacity:
            return False
        if (i, capacity) not in noted:
            noted.add((i, capacity))
            runs.append({"model": rungs[i], "batch_size": job.batch_size, "status": "weights exceed",
                         "weight_bytes": weight_bytes(i), "capacity_gb": capacity / 2**30,
                         "n_params": weights[i][0]})
        return True

    def need(k: int) -> int | None:  # k = rung + 1; k = 0 is "no size fits"
        return weight_bytes(k - 1) if too_large(k - 1, biggest) else oracle(k - 1).need(job.batch_size)

    def known() -> dict:
        return {i + 1: o.need_of(o.records[job.batch_size]) for i, o in oracles.items()
                if job.batch_size in o.records} | {i + 1: b for i, (_, b) in weights.items()
                                                   if b > biggest}

    def error() -> str | None:
        return next((o.error for o in oracles.values() if o.error), None)

    def fits(k: int, capacity: int) -> bool:
        return (not error() and not too_large(k - 1, capacity)
                and oracle(k - 1).fits(job.batch_size, capacity))

    sizes = []
    for gb in sorted(memory_gb):
        capacity = int(gb * 2**30)
        guess = guess_largest(need, known, capacity, len(rungs), probes=(1, 1 + len(rungs) // 4), log=True)
        k = largest_fitting(lambda k: fits(k, capacity), guess, len(rungs))
        best = rungs[k - 1] if k else None
        record = oracles[k - 1].records.get(job.batch_size) if k else None
        print(f"[model capacity {job.method} from {job.model}] {gb:g} GiB: largest model "
              f"{best or 'none'}{' (the ladder top)' if k == len(rungs) else ''}; "
              f"{len(runs)} runs so far", file=sys.stderr, flush=True)
        sizes.append({"memory_gb": gb, "largest_model": best,
                      "n_params": weights[k - 1][0] if k else 0, "at_ladder_top": k == len(rungs),
                      "needed_bytes_at_largest": oracles[k - 1].need_of(record) if record else None})
    for o in oracles.values():
        o.close()
    first = next(iter(oracles.values()), None)
    return {"tier": first.tier if first else ("simulated" if job.simulate else "tracked"),
            "batch_size": job.batch_size, "ladder": rungs,
            "context_bytes": allocator.CUDA_CONTEXT_BYTES if job.simulate else 0,
            "sizes": sizes, "runs": runs, "error": error()}


def guess_largest(need, known, capacity: int, most: int, probes: tuple[int, ...], log: bool = False) -> int:
    """Largest k in [0, most] whose need is at most `capacity`, by interpolation on the
    needs measured so far (`known()`: k -> bytes, None for a failed run; `need(k)` runs
    k): the probes first, then a secant step per run, on log bytes with `log` (the model
    ladder's sizes grow geometrically). Secant steps converge in a few runs even where the
    need bends (the peak moves from the optimizer step to the backward pass as the batch
    grows). A secant step from a batch search's anchor at 0 probes one below its guess."""
    f = math.log if log else float
    for k in probes:
        need(min(k, most))
    lo = (0, None)
    for _ in range(12):
        points = sorted(known().items())
        below = [(k, n) for k, n in points if n is not None and n <= capacity]
        above = [(k, n) for k, n in points if n is None or n > capacity]
        lo = below[-1] if below else (0, None)
        hi = above[0] if above else None
        if hi is not None and hi[0] - lo[0] <= 1 or hi is None and lo[0] >= most:
            return lo[0]
        line = [p for p in (below[-2:] if hi is None else [lo, hi]) if p[1] is not None]
        if len(line) == 2 and line[1][1] > line[0][1]:
            (k0, n0), (k1, n1) = line
            k = k0 + math.floor((f(capacity) - f(n0)) * (k1 - k0) / (f(n1) - f(n0)))
            if k0 == 0 and hi is not None:
                # from a batch search's anchor at 0 (what a GPU keeps between steps) to its
                # first step: the step's own peak comes at once, so the need lies above this
                # line and k is an upper guess; one below it, if it fits, puts k between
                # steps run (computed from the batch line, not run)
                k -= 1
        else:
            k = 2 * lo[0] if hi is None else (lo[0] + hi[0]) // 2
        upper = most if hi is None else hi[0] - 1
        need(min(max(k, lo[0] + 1), upper))
    return lo[0]


def largest_fitting(fits, guess: int, most: int) -> int:
    """Largest k in [0, most] with fits(k), fits being monotone (k = 0 always fits):
    gallop from the guess to a bracket fits(lo) / not fits(hi), then bisect. With a good
    guess this runs fits twice: at the answer and one above it."""
    k = min(max(guess, 1), most)
    if fits(k):
        lo, step = k, 1
        while True:
            if lo == most:
                return most
            hi = min(lo + step, most)
            if not fits(hi):
                break
            lo, step = hi, 2 * step
    else:
        hi, step = k, 1
        while True:
            lo = max(hi - step, 0)
            if lo == 0 or fits(lo):
                break
            hi, step = lo, 2 * step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


class _Simulation:
    """One batch of a simulated search, run as a memory job at that batch runs it
    (`kinds._memory`): a fresh fake model, the warm-up step at the batch (it creates the
    optimizer state, as a training run's first step does), then the measured step at it. The
    trace is both steps' allocations in order, what the allocator model replays: the GPU need
    of the run a user would make, whose first step is at the batch too (a warm-up at a
    smaller batch leaves the allocator other cached blocks: on Mistral-7B the need differed by
    -4% to +7%, docs/fit.md). `cost`: count the step's FLOPs and bytes moved (`StepCost`, a
    dispatch mode of its own on every operator); off, a record's `cost` is None and the step
    runs faster (`membench fit` reports no cost).

    Under FSDP2 (`job.sharding` fsdp) the model is rank 0 of `job.world_size` as a
    simulated sharded memory job has it (`bench.measure.sharded`), in a fake process group
    of its own (`close` ends it) or the caller's `mesh`. `labelled`: the trace says each
    storage's category (`MemoryTracker(labelled=True)`), and where the warm-up's trace ends,
    as ("mark", "warm-up"); such a run's record has no GPU prediction (its trace is read as
    a shallow copy's, `_Deep`, not replayed). `resume`: the warm-up's trace replayed
    (`allocator.Prefix`), where the batch's replays start (None for a labelled run)."""

    def __init__(self, job: Job, cost: bool = True, mesh=None, labelled: bool = False):
        self.job = job
        self.cost = cost
        self.method = load(job.method, job.hparams)
        self.fake = step.fake_mode()
        self.group = None
        if job.sharding == "fsdp":
            from bench.measure import sharded

            self.group = contextlib.ExitStack()
            if mesh is None:  # its own fake process group, else the caller's (`_Deep`)
                mesh = self.group.enter_context(sharded.fake_mesh(job.world_size))
        self.model, self.stream = step.setup(job, self.method, self.fake)
        self.events: list = []
        if self.group is not None:
            with self.fake:
                sharded.shard(self.model, mesh)
                self.model._get_fsdp_state()._lazy_init()  # before tracking, as in a sharded memory job
            self.tracker = sharded.ShardedTracker(events=self.events, labelled=labelled)
            self.tracker.watch(self.model)
        else:
            self.tracker = MemoryTracker(events=self.events, labelled=labelled)
        self.n_params = models.n_params(self.model)
        self.tracker.register_model(self.model)
        self.prefix: list | None = None  # the warm-up's events, once `measure` has run
        self.prefix_live: dict | None = None  # what it left alive: what a GPU keeps between steps
        self.resume: allocator.Prefix | None = None

    def measure(self) -> tuple[dict, list]:
        """The memory job's two steps (`kinds._memory`): a memory-job-like record of the
        measured step, and the trace of both."""
        take_batch = step.batch_feeder(self.stream, self.job.device, self.fake, self.tracker)
        labelled = self.tracker.labelled
        cost = StepCost() if self.cost else None

        def warmed_up():
            self.prefix, self.prefix_live = list(self.events), self.tracker.live_storages()

        with self.fake, self.tracker, cuda_kernels():
            optimizer, loss = step.memory_steps(self.method, self.model, self.tracker, take_batch,
                                                after_warm_up=warmed_up, measured=cost)
            del loss
        if cost is not None:
            cost.add_periodic(optimizer)
        mark = len(self.prefix)
        trace = self.events[:mark] + [("mark", "warm-up")] * labelled + self.events[mark:]
        self.resume = None if labelled else allocator.Prefix(self.prefix)
        split = self.tracker.peak_split.as_row()
        # host memory (offloading): the ledger's high-water mark so far in this process
        memory = {"tier": "simulated", **split, **({} if labelled else step.predict_gpu(trace, None, self.resume)),
                  **self.tracker.host_row()}
        record = {"status": "ok", "message": None, "memory": memory, "n_params": self.n_params,
                  "cost": cost.result() if cost is not None else None}
        if self.group is not None:  # what sharding adds at the peak (inside `other`)
            record["sharding"] = {**self.tracker.sharding_at_peak, "bytes": sum(self.tracker.sharding_at_peak.values())}
        return record, trace

    def close(self) -> None:
        """End the fake process group of a sharded simulation (if it is still the default)."""
        if self.group is not None:
            self.group.close()
            self.group = None


def _run_batch(job: Job, cost: bool = True, mesh=None, labelled: bool = False) -> tuple[dict, list, _Simulation]:
    """`_Simulation(job, ...)`'s record and trace, and the simulation (its fake process group
    ended)."""
    sim = _Simulation(job, cost, mesh, labelled)
    try:
        record, trace = sim.measure()
    finally:
        sim.close()
    return record, trace, sim


class _Batches:
    """A simulated search of a model run at full depth (one GPU, or rank 0 under FSDP2): each
    batch its own memory job (`_Simulation`; under FSDP2 in the caller's `mesh`, if any).
    `resumes`: each batch's warm-up replayed; `prefix_live`: what the first batch's warm-up
    left alive (the state a GPU keeps between steps)."""

    def __init__(self, job: Job, cost: bool, mesh=None):
        self.job, self.cost, self.mesh = job, cost, mesh
        self.resumes: dict[int, allocator.Prefix] = {}
        self.prefix_live: dict | None = None

    def measure(self, batch_size: int) -> tuple[dict, list]:
        record, trace, sim = _run_batch(replace(self.job, batch_size=batch_size), self.cost, self.mesh)
        self.resumes[batch_size] = sim.resume
        if self.prefix_live is None:
            self.prefix_live = sim.prefix_live
        return record, trace

    def close(self) -> None:
        pass


class _Deep(_Batches):
    """A simulated search (one GPU, or rank 0 under FSDP2; no cost kept) of a deep model
    that reads its steps from shallow copies of it (`bench.measure.trace_depth`). At the first
    batch, copies with `SHALLOW` blocks (3, 4 and 6) are run and give a rule for the trace at
    any depth, which must give each copy's trace byte for byte (the copy of 6 blocks checks
    the blocks found between 3 and 4, three times over; `trace_depth.Depth`). Then the first
    batch's record is the full depth's trace read from the rule: its replay, and its split by
    category at the peak (the copies' traces are labelled, `tracker.labelled_peak`; under
    FSDP2 what sharding adds there too), with the parameter count and the host memory
    (offloading) on the line through the copies' (which must hold at all three). The full
    model is not run.

    Each copy's run at a batch is that copy's memory job at it (`_Simulation`: a fresh model,
    the warm-up and the step at the batch). Each later batch runs only the copy at
    `SHALLOW[1]` blocks and takes the full depth's trace from it where that copy's trace has
    the same events in the same places. A record so read has the trace's replay, no split
    by category (as a record from the batch line, `Oracle._from_line`), and `depth`: the
    shallow depth it was read from. A batch whose step
    is none of the rules' learned so far (chunks per batch, state that changes after the first
    step) learns a rule anew from the copies at that batch, as the first did, and keeps the
    earlier ones for later batches; where none is learned, that batch and every later one
    runs at full depth (`_Batches.measure`).

    Under FSDP2 the rules are kept for the method's searches at every GPU count
    (`_shared_rules`): rank 0's step at another count has the same events in the same places,
    other sizes, so a later count's first batch is read from its 4-block copy alone with a
    rule learned at an earlier count (its split by category from that read, as a learned
    rule's), where the parameter count is the one learned and no copy keeps host memory
    (offloading's per-rank bytes change with the count: those learn at each count)."""

    SHALLOW = (3, 4, 6)
    # a model of fewer blocks runs every batch at full depth: on it, the shallow copies
    # (a warm-up and a step each) cost about what reading its batches saves
    FROM_DEPTH = 16

    def __init__(self, job: Job):
        # under FSDP2 all the models are rank 0 of one fake process group (a new group would
        # end the one before)
        self.group = contextlib.ExitStack()
        mesh = None
        if job.sharding == "fsdp":
            from bench.measure import sharded

            mesh = self.group.enter_context(sharded.fake_mesh(job.world_size))
        super().__init__(job, cost=False, mesh=mesh)
        self.depth = models.shape(job.model)[1]
        self.n_params: int | None = None
        # None: not tried yet; False: refused, or never tried for a method that plans each
        # batch shape anew (ROAM): its step at one batch says nothing of another's
        self.rule: trace_depth.Depth | bool | None = (False if load(job.method, job.hparams).plans_per_shape
                                                      else None)
        # every rule learned, the latest first (under FSDP2, at any GPU count: `_shared_rules`)
        self.shared = _shared_rules(job)
        self.rules: list[trace_depth.Depth] = self.shared["rules"]
        # one GPU: a method ZeRO's model takes has its copies run once for both (`_copy_run`)
        self.shares_copies = mesh is None and _takes_zero(job)

    def _shallow(self, depth: int, batch: int) -> tuple[dict, list]:
        job = _copy_job(self.job, depth, batch)
        if self.shares_copies:  # the run ZeRO's timelines read too
            from bench.measure import zero

            timeline, trace, _ = _copy_run(job, self.job.model)
            memory = {"tier": "simulated", **timeline.unsharded}
            record = {"status": "ok", "message": None, "n_params": memory.pop("n_params"), "memory": memory,
                      "cost": None}
            return record, zero.memory_trace(trace)
        return _run_batch(job, cost=False, mesh=self.mesh, labelled=True)[:2]

    def _full(self, batch: int) -> tuple[dict, list]:
        record, trace = super().measure(batch)
        self.n_params = record["n_params"]
        return record, trace

    def _read(self, batch: int, labelled: list) -> tuple[list, dict]:
        """The trace at full depth read from copies (`labelled`), as the allocator model reads
        it, and its GPU prediction; its warm-up's replay kept for the batch's later replays."""
        trace = _unlabelled(labelled)
        warm_up = _unlabelled(labelled[:labelled.index(("mark", "warm-up"))])
        self.resumes[batch] = resume = allocator.Prefix(warm_up)
        if self.prefix_live is None:
            self.prefix_live = {n: (n, size) for n, size in _alive_at_end(warm_up).items()}
        return trace, step.predict_gpu(trace, None, resume)

    def _copy(self, depth: int, batch: int) -> tuple[list, dict] | None:
        """The copy of `depth` blocks at `batch`: its trace and what grows per block in its
        record (`_rule_from_copies`), or None if its step failed."""
        record, trace = self._shallow(depth, batch)
        if record["status"] != "ok":
            return None
        return trace, {"n_params": record["n_params"],
                       "host_peak_bytes": record["memory"].get("host_peak_bytes", 0),
                       "transfer_bytes": record["memory"].get("transfer_bytes", 0)}

    def measure(self, batch_size: int) -> tuple[dict, list]:
        known, first = {}, self.rule is None
        # the first batch of a later GPU count under FSDP2 tries the rules learned at another
        shared = first and self.rules and self.shared["no_host"]
        if self.rule or shared:  # read from the copy of SHALLOW[1] blocks
            known[self.SHALLOW[1]] = copy = self._copy(self.SHALLOW[1], batch_size)
            deep = _read_from_copy(self.rules, copy, self.depth)
            if deep is not None and first and not _keeps_host(copy[1]):
                self.rule, self.n_params = self.rules[0], self.shared["n_params"]
                print(f"[{self.job.method} {self.job.model}] its step at batch {batch_size} is read with the rules "
                      f"learned at another GPU count, from a copy of {self.SHALLOW[1]} blocks", file=sys.stderr,
                      flush=True)
                return self._first_record(batch_size, deep, {"host_peak_bytes": 0, "transfer_bytes": 0},
                                          self.SHALLOW[1])
            if deep is not None and not first:
                trace, predicted = self._read(batch_size, deep)
                memory = {"tier": "simulated", **predicted}
                return {"status": "ok", "message": None, "n_params": self.n_params, "cost": None,
                        "depth": self.SHALLOW[1], "memory": memory}, trace
        if self.rule is not False:
            # the first batch, or a step whose events are not the rule's (chunks per batch,
            # state that changes after the first step): a rule learned at this batch
            read = self._learn(batch_size, known)
            _say_rule("step", self.job, batch_size, self.depth, first, learned=bool(self.rule))
            if read is not None:
                return read
        return self._full(batch_size)

    def _learn(self, batch: int, known: dict) -> tuple[dict, list] | None:
        """A rule from the copies at `batch` (`rule`: it, or False), and the record and trace
        at `batch` read from it (None where there is no rule)."""
        self.rule = False
        try:
            learned = _rule_from_copies(lambda d: self._copy(d, batch), known)
        except Exception:  # noqa: BLE001 - a model that has no shallow copy runs at full depth
            return None
        on_line = _on_line(learned[1], self.depth) if learned else None
        labelled = learned[0].at(self.depth) if on_line else None
        if labelled is None:  # no rule, or a free that lands on no allocation of its size
            return None
        self.rule, self.n_params = learned[0], on_line.pop("n_params")
        self.rules.insert(0, self.rule)
        self.shared["n_params"] = self.n_params
        self.shared["no_host"] = self.shared["no_host"] and not any(
            _keeps_host(values) for _, values in learned[1].values())
        return self._first_record(batch, labelled, on_line, _SHALLOW_TEXT)

    def _first_record(self, batch: int, labelled: list, host: dict, depth) -> tuple[dict, list]:
        """The record and trace of a batch whose full-depth trace `labelled` was read with a
        rule (learned at it, or under FSDP2 at another GPU count): its replay, and its split by
        category at the peak; `host`: its host memory; `depth`: the copies it was read from."""
        trace, predicted = self._read(batch, labelled)
        split, by_part = labelled_peak(labelled)
        memory = {"tier": "simulated", **split.as_row(), **predicted, **host}
        record = {"status": "ok", "message": None, "n_params": self.n_params, "cost": None,
                  "depth": depth, "memory": memory}
        if self.mesh is not None:  # what sharding adds at the peak (inside `other`)
            from bench.measure import sharded

            parts = {p: by_part.get(p, 0) for p in sharded.SHARDING_PARTS}
            record["sharding"] = {**parts, "bytes": sum(parts.values())}
        return record, trace

    def close(self) -> None:
        """End the fake process group (under FSDP2)."""
        self.group.close()


_SHALLOW_TEXT = f"{', '.join(map(str, _Deep.SHALLOW[:-1]))} and {_Deep.SHALLOW[-1]}"
_RULES: dict = {}  # a search's job (its batch and GPU count aside) -> what `_shared_rules` keeps (`_last_method`)


def _shared_rules(job: Job) -> dict:
    """What `_Deep`'s searches of one method, model and scheme keep across GPU counts: the
    rules learned (latest first), the parameter count they were learned with, and whether no
    copy kept host memory (`no_host`). Each search at one GPU, or of a simulated capacity
    suite, has a list of its own (only FSDP2's counts share)."""
    if job.sharding != "fsdp":
        return {"rules": [], "no_host": False}
    return _last_method(_RULES, replace(job, batch_size=0, world_size=0), job.model,
                        lambda: {"rules": [], "no_host": True})


def _keeps_host(values: dict) -> bool:
    """Whether a copy's run (what grows per block in it, `_Deep._copy`) kept host memory."""
    return bool(values["host_peak_bytes"] or values["transfer_bytes"])


def _last_method(cache: dict, job: Job, model: str, empty):
    """`cache`'s entry for `job` (made by `empty()` if new), where the cache keeps the entries
    of one method and model (`model`: the full-depth one) only: a new one clears it."""
    key = json.dumps(job.to_dict(), sort_keys=True)
    owner = (job.method, model, json.dumps(job.hparams, sort_keys=True))
    if key not in cache and any(was != owner for was, _ in cache.values()):
        cache.clear()
    return cache.setdefault(key, (owner, empty()))[1]


def _rule_from_copies(run, known: dict) -> tuple[trace_depth.Depth, dict] | None:
    """The depth rule learned from the copies of `_Deep.SHALLOW` blocks (it gives each copy's
    trace byte for byte), and every copy's run by its depth; None where there is none.
    `run(depth)`: a copy's (trace, what grows per block) at one batch, or None if it failed;
    `known`: the runs already made."""
    runs = {d: known[d] if d in known else run(d) for d in _Deep.SHALLOW}
    if any(r is None for r in runs.values()):
        return None
    rule = trace_depth.Depth({d: trace for d, (trace, _) in runs.items()})
    return (rule, runs) if rule.ok else None


def _read_from_copy(rules: list, copy: tuple | None, depth: int) -> list | None:
    """The labelled trace at `depth` read from a copy's run at a later batch (its (trace, what
    grows per block), or None if it failed) with the first of `rules` whose events it has;
    None where the copy failed, its events are no rule's, or a free lands on no allocation
    of its size."""
    for rule in rules if copy is not None else ():
        read = rule.read(copy[0])
        if read is not None:
            return read.at(depth)
    return None


def _on_line(runs: dict, depth: int) -> dict | None:
    """What grows by the same amount with each block (each run's values, by the copy's depth)
    at `depth`, on the line through the copies; None where the line does not hold at every one."""
    lo, hi = _Deep.SHALLOW[:2]
    out = {}
    for name in runs[lo][1]:
        y = {d: values[name] for d, (_, values) in runs.items()}
        rise = y[hi] - y[lo]
        if any(y[d] != y[lo] + rise * (d - lo) for d in y):
            return None
        out[name] = y[lo] + rise * (depth - lo)
    return out


def _say_rule(what: str, job: Job, batch: int, depth: int, first: bool, learned: bool) -> None:
    """The progress line of a rule learned (or not) from the copies at `batch`: `what` is read."""
    said = (f"periodic in its {depth} blocks: read from copies of {_SHALLOW_TEXT} blocks; later batches "
            f"from a copy of {_Deep.SHALLOW[1]} blocks"
            if learned else "not read from shallow copies: this and later batches run at full depth")
    print(f"[{job.method} {job.model}] its {what} at batch {batch} is "
          + ("" if first else "not the rules' learned before; it is ") + said, file=sys.stderr, flush=True)


def _alive_at_end(trace: list) -> dict:
    """Allocation key -> bytes, for what is alive at the trace's end."""
    live = {}
    for event in trace:
        if event[0] == "alloc":
            live[event[1]] = event[2]
        else:
            live.pop(event[1], None)
    return live


def _unlabelled(trace: list) -> list:
    """A labelled trace as the allocator model and the batch line read it: allocations and frees."""
    return [e[:3] for e in trace if e[0] in ("alloc", "free")]


class _ZeroRuns:
    """A simulated search under ZeRO (`job.sharding` zero1-3, `job.world_size`): each batch
    as a ZeRO memory job has it (`bench.measure.kinds._zero`): modelled from one rank's
    unsharded timeline at that batch, its largest rank. A timeline serves every world size
    and stage: the last job's are kept (`_TIMELINES`). The record's `persistent_bytes`
    (what a rank keeps between steps, context included) anchors the search's line at batch 0."""

    def __init__(self, job: Job):
        self.job = job
        self.method = load(job.method, job.hparams)

    def measure(self, batch_size: int) -> tuple[dict, list]:
        from bench.measure import zero

        job = replace(self.job, batch_size=batch_size)
        timeline, depth, copy_line = _timeline(job)
        cfg = zero.ZeroConfig(stage=int(job.sharding[-1]), world_size=job.world_size)
        result = zero.model_ranks(timeline, cfg)["max"]
        events = result["events"]
        sizes = zero.state_sizes(timeline, cfg, result["rank"])
        record = {"status": "ok", "message": None, "n_params": timeline.unsharded["n_params"], "cost": None,
                  "memory": {**result["memory"], **step.gpu_need(result["replay"]), "tier": "modelled"},
                  "sharding": result["sharding"],
                  "persistent_bytes": sizes.param + sizes.master + sizes.state + allocator.CUDA_CONTEXT_BYTES}
        if depth is not None:  # the timeline read from shallow copies (`_DeepTimelines`)
            record["depth"] = depth
        if copy_line:  # the copy's step computed from the line through its runs at these batches
            record["copy_line"] = copy_line
        return record, events

    def close(self) -> None:
        pass


_TIMELINES: dict = {}  # (the unsharded job, batch) -> its ZeRO timeline: the last job's only
_READERS: dict = {}  # the unsharded job (its batch aside) -> its `_DeepTimelines`: the last job's only


def _timeline(job: Job):
    """The ZeRO timeline of `job`'s unsharded step (`zero.record_timeline`): of a model of
    `_Deep.FROM_DEPTH` blocks or more, read from shallow copies where they give it
    (`_DeepTimelines`), else run at full depth: (timeline, the copies it was read from or
    None, the batches of the copy's line it was computed from or None)."""
    from bench.measure import zero

    unsharded = replace(job, world_size=1, sharding="none")
    key = json.dumps(unsharded.to_dict(), sort_keys=True)
    if key not in _TIMELINES:
        if any(owner != (job.method, job.model) for owner, _ in _TIMELINES.values()):
            _TIMELINES.clear()
            _READERS.clear()
        read = None
        if models.shape(job.model)[1] >= _Deep.FROM_DEPTH:
            reader_key = json.dumps(replace(unsharded, batch_size=1).to_dict(), sort_keys=True)
            reader = _READERS.setdefault(reader_key, _DeepTimelines(unsharded))
            read = reader.at(job.batch_size)
        _TIMELINES[key] = (job.method, job.model), read or (
            zero.record_timeline(unsharded, load(job.method, job.hparams)), None, None)
    return _TIMELINES[key][1]


class _DeepTimelines:
    """ZeRO timelines (`zero.Timeline`) of a deep model's unsharded step, read from shallow
    copies of it as `_Deep` reads a step's trace: the copies' runs are `zero.labelled_run`s
    (their traces also say each gradient's parameter, each module's use of its parameters
    and each optimizer step: `zero.TimelineTracker`), a rule learned at the first batch
    from `_Deep.SHALLOW` copies gives the trace at full depth,
    and `zero.timeline_from_labelled` the timeline from it. Each copy's own timeline read
    back from its trace must be the one its run kept, or nothing is read. What does not
    grow per block in the trace (parameters, the optimizer's scalar and per-element state)
    is read on the line through the copies (which must hold at all three); the full model's
    parameter list from the model built on fake tensors (no step). As in a ZeRO memory job,
    each batch's run starts from a fresh model: its warm-up is at that batch."""

    def __init__(self, job: Job):
        self.job = job
        self.depth = models.shape(job.model)[1]
        self.rule: trace_depth.Depth | bool | None = None  # None: not learned yet; False: none
        self.rules: list[trace_depth.Depth] = []  # every rule learned, the latest first
        self.params: list | None = None  # the full model's (numel, element size, trainable)
        self.totals: dict | None = None  # at full depth, from the line through the copies

    def _run(self, depth: int, batch: int) -> tuple[list, dict] | None:
        """A copy's labelled trace and totals at `batch`, or None if its timeline is not the
        one its trace says."""
        run = _copy_run(_copy_job(self.job, depth, batch), self.job.model)
        return run[1:] if _reads_back(run) else None

    def at(self, batch: int) -> tuple | None:
        """(The timeline at full depth, the copies it was read from, the batches of the
        line the copy's step was computed from or None), or None where the copies do not
        give it. A later batch's copy of `_Deep.SHALLOW[1]` blocks is computed from that
        copy's runs (the one-GPU search's, `_copy_run`) where they lie on a line
        (`_copy_on_line`), else run."""
        try:
            return self._read(batch)
        except Exception:  # noqa: BLE001 - a model that has no shallow copy runs at full depth
            self.rule = False
            return None

    def _read(self, batch: int) -> tuple | None:
        from bench.measure import zero

        known, first = {}, self.rule is None
        if self.rule:  # read from the copy of SHALLOW[1] blocks
            copy, line = _copy_on_line(_copy_job(self.job, _Deep.SHALLOW[1], batch), self.job.model) or (None, None)
            if copy is None:
                copy = self._run(_Deep.SHALLOW[1], batch)
            known[_Deep.SHALLOW[1]] = copy
            deep = _read_from_copy(self.rules, copy, self.depth)
            if deep is not None:
                return zero.timeline_from_labelled(deep, self.params, self.totals), _Deep.SHALLOW[1], line
        if self.rule is False:
            return None
        self.rule = False  # until one is learned at this batch
        try:
            read = self._learn(batch, known, first)
        finally:
            _say_rule("timeline", self.job, batch, self.depth, first, learned=bool(self.rule))
        return read

    def _learn(self, batch: int, known: dict, first: bool) -> tuple | None:
        from bench.measure import zero

        learned = _rule_from_copies(lambda d: self._run(d, batch), known)
        totals = _on_line(learned[1], self.depth) if learned else None
        deep = learned[0].at(self.depth) if totals else None
        if deep is None:
            return None
        if first:
            method = load(self.job.method, self.job.hparams)
            model, _ = step.setup(replace(self.job, batch_size=batch), method, step.fake_mode())
            self.params = [(p.numel(), p.element_size(), p.requires_grad) for p in model.parameters()]
        self.rule, self.totals = learned[0], totals
        self.rules.insert(0, self.rule)
        return zero.timeline_from_labelled(deep, self.params, totals), _SHALLOW_TEXT, None


_COPIES: dict = {}  # a shallow copy's job (its batch aside) -> {batch: its `_copy_run`}: the last method's only


def _copy_job(job: Job, depth: int, batch: int) -> Job:
    """`job` on the shallow copy of its model with `depth` blocks, at `batch`."""
    return replace(job, model=models.at_depth(job.model, depth), batch_size=batch)


def _copy_run(job: Job, model: str) -> tuple:
    """A shallow copy (of `model`) at a batch run once for both searches that read it: the
    one-GPU search (`_Deep`) and ZeRO's timelines (`_DeepTimelines`) run the same step (a
    fresh model, the warm-up and the step at the batch, unsharded). It is run under ZeRO's
    tracker, whose events are the memory job's with the timeline's own among them
    (`zero.labelled_run`, `zero.memory_trace`): its timeline, labelled trace and totals."""
    from bench.measure import zero

    runs = _copy_runs(job, model)
    if job.batch_size not in runs:
        runs[job.batch_size] = zero.labelled_run(job, load(job.method, job.hparams))
    return runs[job.batch_size]


def _copy_runs(job: Job, model: str) -> dict:
    """The runs of `job`'s copy kept so far, by batch (`_copy_run`)."""
    return _last_method(_COPIES, replace(job, batch_size=0), model, dict)


def _copy_on_line(job: Job, model: str) -> tuple[tuple, list] | None:
    """A copy's labelled trace and totals at `job.batch_size` computed from its runs at other
    batches (`_copy_run`, kept by the one-GPU search or ZeRO's earlier batches) where they
    lie on a line in the batch (`trace_line.Line`, on labelled events): the nearest runs on
    either side, and a third run on their line byte for byte, every total on it too; each
    run's timeline the one its trace says. ((trace, totals), the batches of the line), or
    None where there is no such line."""

    batch, runs = job.batch_size, _copy_runs(job, model)
    below, above = [b for b in runs if b < batch], [b for b in runs if b > batch]
    if not below or not above or len(runs) < 3:
        return None
    lo, hi = max(below), min(above)
    line = trace_line.Line((lo, runs[lo][1]), (hi, runs[hi][1]))

    def total(name: str, at: int) -> int | None:  # on the line through lo and hi, if a whole number
        low, high = runs[lo][2][name], runs[hi][2][name]
        value, rest = divmod(low * (hi - lo) + (high - low) * (at - lo), hi - lo)
        return None if rest else value

    third = next((b for b in runs if b not in (lo, hi) and line.holds(b, runs[b][1])
                  and all(total(name, b) == value for name, value in runs[b][2].items())), None)
    trace = line.at(batch) if third is not None else None
    totals = {name: total(name, batch) for name in runs[lo][2]}
    if trace is None or None in totals.values() or not all(_reads_back(runs[b]) for b in (lo, hi, third)):
        return None
    return (trace, totals), sorted((lo, third, hi))


def _reads_back(run: tuple) -> bool:
    """Whether a copy's run (`_copy_run`) keeps the timeline its labelled trace says
    (`zero.timeline_from_labelled`): else nothing is read from it."""
    from bench.measure import zero

    timeline, trace, totals = run
    return zero.timeline_from_labelled(trace, timeline.params, totals) == timeline


def _takes_zero(job: Job) -> bool:
    """Whether ZeRO's model takes `job`'s method at some stage (its timelines are then read
    from the same copies as the one-GPU search's steps)."""
    method = load(job.method, job.hparams)
    return any(kinds.can_shard(method, f"zero{stage}") for stage in (1, 2, 3))


class Oracle:
    """Runs memory jobs at a batch size (each batch once) and answers fits(B, C): from
    that run's bytes when simulated or tracked, by a run capped at C on CUDA. `cost`: a
    simulated run's record keeps the step's cost (see `_Simulation`)."""

    def __init__(self, job: Job, unit: int, runs: list | None = None, log_prefix: str | None = None,
                 cost: bool = True):
        self.job = replace(job, kind="memory", capacity_gb=None)
        self.unit = unit
        self.cost = cost
        self.sim: _Batches | _Deep | _ZeroRuns | None = None
        self.simulated = job.simulate
        self.cuda = job.device.startswith("cuda")
        self.tier = (("modelled" if job.sharding.startswith("zero") else "simulated") if self.simulated
                     else ("measured" if self.cuda else "tracked"))
        self.traces: dict[int, list] = {}
        self.records: dict[int, dict] = {}
        self.capped: dict[tuple, dict] = {}  # (batch, capacity) -> record of a capped run
        self.runs: list[dict] = [] if runs is None else runs  # shared by a model search's sizes
        self.error: str | None = None
        # a search that keeps no cost computes a batch's trace from the line of the last two
        # steps run once a third lies on it (`trace_line`), between the batches run on it:
        # None while there is none, False if a later step was off a confirmed line, or for a
        # method that plans each batch shape anew (ROAM: its steps change shape with the
        # batch, so no step beyond the answer is run to span one)
        self.line: trace_line.Line | bool | None = (
            None if self.simulated and not cost and not load(job.method, job.hparams).plans_per_shape else False)
        # such a search of a deep model (one GPU, or FSDP2's rank 0) reads the steps at
        # other batches from a shallow copy (`_Deep`)
        self.deep = (self.simulated and not cost and job.sharding in ("none", "fsdp")
                     and models.shape(job.model)[1] >= _Deep.FROM_DEPTH)
        # the line printed per run starts with this
        self.log_prefix = log_prefix or f"[capacity {job.method} {job.model}]"
        self._started = time.perf_counter()

    def _run(self, job: Job) -> dict:
        """A real memory job at `job`'s batch and cap (a fresh model: a capped run may fail)."""
        method = load(job.method, job.hparams)
        return kinds.attempt(job, lambda: kinds.measure(job, method))

    def _simulate(self, batch: int) -> tuple[dict, list | None]:
        try:
            if self.sim is None:
                self.sim = (_ZeroRuns(self.job) if self.job.sharding.startswith("zero") else
                            _Deep(self.job) if self.deep else _Batches(self.job, self.cost))
            return self.sim.measure(batch)
        except Exception as e:  # recorded as the search's error, like a failed memory job
            return {"status": "error", "message": step.error_message(e, simulated=True)}, None

    def _note(self, record: dict, batch: int, capacity_gb: float | None) -> None:
        """Keep a run as evidence, and say so in a line on stderr (where a long search is);
        the first failure that is not out-of-memory ends the search."""
        if record["status"] not in ("ok", "oom") and self.error is None:
            self.error = record["message"]
        self.runs.append({"model": self.job.model, "batch_size": batch, "status": record["status"],
                          "peak_bytes": record.get("memory", {}).get("peak_bytes"),
                          "needed_bytes": self.need_of(record), "capacity_gb": capacity_gb,
                          "n_params": record.get("n_params"),
                          **({"line": record["line"]} if record.get("line") else {})})
        need = self.need_of(record)
        if record["status"] != "ok":
            said = f"{record['status']}: {record['message']}"
        elif capacity_gb is not None or need is None:
            said = f"fits in {capacity_gb:g} GiB" if capacity_gb is not None else "ok"
        else:
            size = f"{need / 2**30:.1f} GiB" if need >= 10 * 2**30 else f"{need / 2**20:.0f} MiB"
            said = f"{size} {'predicted' if self.simulated else 'needed'}"
            if record.get("line"):
                said += f" (not run: on the line through batches {', '.join(map(str, record['line']))})"
            elif record.get("depth"):
                depth = record["depth"]
                if not isinstance(depth, int):
                    said += f" (read from copies of {depth} blocks)"
                elif record.get("copy_line"):
                    said += (f" (read from the copy of {depth} blocks, its step not run: on the line through its "
                             f"batches {', '.join(map(str, record['copy_line']))})")
                else:
                    said += f" (read from the copy of {depth} blocks)"
        now = time.perf_counter()
        print(f"{self.log_prefix} batch {batch} -> {said} ({now - self._started:.1f} s)",
              file=sys.stderr, flush=True)
        self._started = now

    def _record(self, batch: int) -> dict:
        if batch not in self.records:
            if self.simulated:
                record, events = self._from_line(batch) or self._simulate(batch)
                if not record.get("line"):
                    self._follow_line(batch, record, events)
            else:
                record, events = self._run(replace(self.job, batch_size=batch)), None
            self.records[batch], self.traces[batch] = record, events
            self._note(record, batch, None)
        return self.records[batch]

    def _from_line(self, batch: int) -> tuple[dict, list] | None:
        """The record and trace at `batch` computed from the line of the steps run, once a
        third step lies on it (else None: the step is run). The record has no split by
        category and no cost: the trace's replay, which is all a search reads."""
        if not self.line or not self.line.confirmed or not self.line.within(batch):
            return None
        trace = self.line.at(batch)
        if trace is None:
            return None
        n_params = next(r["n_params"] for r in self.records.values() if not r.get("line"))
        return {"status": "ok", "message": None, "n_params": n_params, "cost": None,
                "line": sorted(self.line.batches),
                "memory": {"tier": self.tier, **step.predict_gpu(trace, None)}}, trace

    def _follow_line(self, batch: int, record: dict, trace: list | None) -> None:
        """After a step run: it confirms the line, or widens a confirmed one, if it lies on
        it; else the last two steps make the next line. A step off a confirmed line between
        the steps on it ends it for this search, and what was computed from it is run again
        as it is asked for; one beyond them leaves it as it is."""
        if self.line is False or record["status"] != "ok":
            return
        # the step run before this one that ran ok (records keep the order they were made in)
        last = next(((b, self.traces[b]) for b, r in reversed(self.records.items())
                     if not r.get("line") and r["status"] == "ok"), None)
        if self.line is not None and self.line.holds(batch, trace):
            return
        if self.line is not None and self.line.confirmed:
            if not self.line.within(batch):
                # beyond the steps on it, where it computes nothing: it still holds between
                # them (e.g. a smaller batch whose step is cut into fewer chunks)
                return
            for b in [b for b, r in self.records.items() if r.get("line")]:
                del self.records[b], self.traces[b]
            self.line = False
        elif last is not None:
            line = trace_line.Line(last, (batch, trace))
            self.line = line if line.same_shape else None

    def resume(self, batch: int) -> allocator.Prefix | None:
        """The warm-up's trace at `batch`, with which that batch's trace starts, replayed (a
        step run on one GPU or under FSDP2; None for one computed from the batch line, and
        under ZeRO)."""
        return getattr(self.sim, "resumes", {}).get(batch)

    def close(self) -> None:
        """Let go of the simulation (a sharded one's fake process group)."""
        if self.sim is not None:
            self.sim.close()

    def need_of(self, record: dict) -> int | None:
        mem = record.get("memory") or {}
        if record["status"] != "ok":
            return None
        if self.simulated:
            return mem["predicted_gpu_bytes"]
        if self.cuda:
            return mem.get("reserved_peak_bytes")
        # what a run capped by the tracker must hold: the peak of either step
        return max(mem["peak_bytes"], record.get("first_step_peak_bytes") or 0)

    def needs(self) -> dict[int, int | None]:
        """Batch -> bytes needed, for every uncapped run so far."""
        return {b: self.need_of(r) for b, r in self.records.items()}

    def need(self, batch: int) -> int | None:
        """Bytes the step needs at `batch` (None if it failed)."""
        return self.need_of(self._record(batch))

    def fits(self, batch: int, capacity: int) -> bool:
        if self.error:
            return False
        if self.simulated:
            self._record(batch)
            trace = self.traces[batch]
            record = self.records[batch]
            if record["status"] != "ok":
                return False
            if record["memory"]["reserved_peak_bytes"] + allocator.CUDA_CONTEXT_BYTES <= capacity:
                # under a limit the allocator does what it does without one until a reservation
                # is refused: none is, where the unlimited replay's reserve is within it
                return True
            return allocator.replay_on_gpu(trace, capacity, self.resume(batch)).fits
        if not self.cuda:  # tracked: exact bytes; a capped run would raise iff they exceed C
            record = self._record(batch)
            return record["status"] == "ok" and self.need_of(record) <= capacity
        key = (batch, capacity)
        if key not in self.capped:
            record = self._run(replace(self.job, batch_size=batch, capacity_gb=capacity / 2**30))
            self.capped[key] = record
            self._note(record, batch, capacity / 2**30)
        return self.capped[key]["status"] == "ok"

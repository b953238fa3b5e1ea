"""Per-rank memory of a training step under FSDP2 (`torch.distributed.fsdp.fully_shard`).

One rank's step is measured as a memory job measures a step (`bench.measure.kinds`): a
warm-up step, then the measured step, tracked by `MemoryTracker`, here in the subclass
`ShardedTracker`. The model is sharded as torchtitan shards it: `fully_shard` on every
transformer block (`blocks`), then on the root, on a one-dimensional device mesh.

Two tiers, one code path:

- tracked: real tensors, under a gloo process group of `world_size` processes on this
  machine (`run_ranks` starts them from a fork server, each measures its rank);
- simulated: fake tensors (`FakeTensorMode`) under the fake process group (backend
  "fake", `FakeStore`), one process standing for rank `rank` of any `world_size` (1 to
  1024): the real `fully_shard`, its real hooks and collectives, no data.

The simulated tier equals the tracked tier byte for byte, per rank (tests/unit/test_sharded.py).

What runs on a CPU (torch 2.13): `fully_shard` on CPU tensors with gloo, on a "cpu"
device mesh (`init_device_mesh("cpu", (world_size,))`); FSDP2 then uses `torch.cpu`'s
stub streams and events. The fake backend is registered for cpu, c10d's collectives have
fake-tensor kernels, so the same code runs on fake tensors. No workaround is needed
beyond these: the mesh is made before entering fake mode (it holds real rank numbers),
`fully_shard` and the steps run inside it (FSDP2 makes its buffers with factory calls).

Categories (one rank's bytes; the five of `bench.job.CATEGORIES`):

- ``param``: the rank's parameter shards: each parameter's padded local shard (FSDP2
  keeps a buffer of ceil(d0 / world_size) rows of dim 0 on every rank, the last ranks'
  padding included; `shard_numel`);
- ``grad``: the rank's gradient shards: per FSDP group, the reduce-scatter output whose
  views are the sharded gradients (padded as the parameters);
- ``optimizer``: the optimizer state of the local shards (AdamW: `zeros_like` of the
  unpadded local shard, `local_numel`, plus its step counters);
- ``activation``: as in one process;
- ``other``: as in one process, plus what sharding adds, also reported on its own as
  ``sharding`` (bytes at the peak, inside ``other``): ``unsharded_param`` (the
  all-gathered parameters, FSDP2's per-parameter all-gather outputs), ``unsharded_grad``
  (a group's full gradients before their reduce-scatter) and ``comm`` (the flat
  all-gather input and output and the reduce-scatter input, and anything else FSDP2's
  group hooks allocate that does not become a sharded gradient).

What the tracker needs beyond `MemoryTracker` (`ShardedTracker`):

1. DTensor: an op on DTensors is left to DTensor (`NotImplemented`), which runs it as ops
   on the local tensors, which the tracker then sees; the ops DTensor runs on fake
   tensors of the global shapes to propagate shapes (under the active fake mode: in the
   simulated tier, ours) are not counted. A DTensor is counted by its local tensor,
   each storage once (the sharded gradients are views of one reduce-scatter output).
2. `UntypedStorage.resize_`: FSDP2 frees the unsharded parameters by resizing their
   storage to 0 and allocates them again by resizing it back; dispatch does not see
   that, so `resize_` is patched while tracking (as PyTorch's MemTracker does) and each
   resize is a free and an allocation, in the events too.
3. Hooks after sharding: the tracker registers the model after `fully_shard` (which
   replaces the parameters); FSDP2 sets `.grad` on the sharded parameters itself and
   calls their post-accumulate-grad hooks, which label the gradient shards.
4. FSDP2's lazy initialisation runs before tracking: it may pad shards again into new
   storages (always on fake tensors where a rank's rows are fewer than the padded rows).
5. The unsharded parameters are pinned to ``other``: autograd saves them for backward.
6. A collective's own temporaries (gloo's flat copy of a reduce-scatter input) are left
   out: NCCL and the fake group make none.

Limits: one scheme (FSDP2, `reshard_after_forward` at its default; under mixed precision
its `MixedPrecisionPolicy`, `shard`); one data-parallel dimension; every rank trains on the
job's batch (the memory of a rank does not depend on the values). CUDA's separate all-gather and reduce-scatter streams
(one allocator pool each) are not modelled: the allocator replay (`step.predict_gpu`) sees
one stream, so its reserved bytes are a lower bound. NCCL's own buffers are not tensors.
"""
from __future__ import annotations

import contextlib
import math
import os
import pickle
import socket
import tempfile

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from bench import models
from bench.job import Job
from bench.measure import step
from bench.measure.tracker import MemorySplit, MemoryTracker, cuda_kernels
from bench.method import Method

SHARDING_PARTS = ("unsharded_param", "unsharded_grad", "comm")


# -- the sharding ------------------------------------------------------------------
def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks: the members of every `nn.ModuleList` whose members
    are all of one class (GPT-2's `transformer.h`, LLaMA's `model.layers`, BERT's
    `encoder.layer`), outermost lists only."""
    out: list[nn.Module] = []
    seen: set[int] = set()
    for module in model.modules():
        if id(module) in seen:
            continue
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            out.extend(module)
            seen.update(id(m) for member in module for m in member.modules())
    return out


def shard(model: nn.Module, mesh) -> nn.Module:
    """`fully_shard` every block, then the root (the embedding, final norm and head stay in
    the root's group), as torchtitan does. Under mixed precision (the model's `Precision`,
    `bench.method.use_precision`) with FSDP2's `MixedPrecisionPolicy` as torchtitan sets it:
    the float32 shards are gathered in the compute dtype (bfloat16 or float16), and the
    gradients reduced in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from bench.method import precision_of

    precision = precision_of(model)
    policy = (MixedPrecisionPolicy(param_dtype=precision.dtype, reduce_dtype=torch.float32)
              if precision.mixed else MixedPrecisionPolicy())
    for block in blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def shard_numel(shape, world_size: int) -> int:
    """Elements of a parameter's buffer on every rank (FSDP2, `FSDPParam._init_sharded_param`):
    dim 0 is split by `torch.chunk` into chunks of ceil(d0 / world_size) rows; every rank
    keeps a buffer of the first chunk's size, its own rows at the start, zeros after."""
    rows = math.ceil(shape[0] / world_size) if shape else 1
    return rows * math.prod(shape[1:])


def local_numel(shape, world_size: int, rank: int) -> int:
    """Elements of rank `rank`'s own rows of a parameter (the sharded parameter, without
    padding): rows [rank * c, (rank + 1) * c) of dim 0 clipped to d0, c = ceil(d0 / world_size)."""
    if not shape:
        return 1 if rank == 0 else 0
    chunk = math.ceil(shape[0] / world_size)
    rows = max(0, min(chunk, shape[0] - rank * chunk))
    return rows * math.prod(shape[1:])


@contextlib.contextmanager
def process_group(world_size: int, rank: int, fake: bool):
    """The default process group for one rank: the fake backend (simulated, any size), or
    the gloo group the caller initialised (`run_ranks`). A fake group made here is
    destroyed on exit, if it is still the default group."""
    import torch.distributed as dist

    made = None
    if fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
        made = dist.group.WORLD
    elif not dist.is_initialized() or dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(f"a real sharded run needs an initialised process group of rank {rank} "
                           f"of {world_size} (bench.measure.sharded.run_ranks makes one)")
    try:
        yield
    finally:  # unless a later fake group has replaced it
        if made is not None and dist.is_initialized() and dist.group.WORLD is made:
            dist.destroy_process_group()


@contextlib.contextmanager
def fake_mesh(world_size: int, rank: int = 0):
    """The one-dimensional cpu mesh of rank `rank` of `world_size` in a fake process group
    (`process_group`), for a simulated model that outlives one call (a capacity search's)."""
    from torch.distributed.device_mesh import init_device_mesh

    with process_group(world_size, rank, fake=True):
        yield init_device_mesh("cpu", (world_size,))


# -- the tracker -------------------------------------------------------------------
class ShardedTracker(MemoryTracker):
    """`MemoryTracker` for a step under FSDP2: DTensor ops left to DTensor, storage resizes
    counted, and the part of ``other`` that sharding adds (`SHARDING_PARTS`) followed; see
    the module docstring. `sharding_at_peak` is that part at the peak."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._part: dict[int, str] = {}  # storage key -> sharding part (while it is `other`)
        self._in_fsdp = 0  # inside one of FSDP2's group hooks
        self._ignore = 0  # inside a block whose new storages are left out (`ignoring`)
        self.sharding_at_peak = dict.fromkeys(SHARDING_PARTS, 0)
        self._groups: list = []

    # -- what sharding adds ---------------------------------------------------------
    def sharding_now(self) -> dict[str, int]:
        out = dict.fromkeys(SHARDING_PARTS, 0)
        # a copy: in a real gloo run, gloo's own thread can drop the last reference to a
        # buffer (its free, `_free`, runs there) while this one reads
        for key, part in list(self._part.items()):
            entry = self._live.get(key)
            if entry is not None and entry[1] == "other":
                out[part] += entry[0]
        return out

    def _new_peak(self) -> None:
        self.sharding_at_peak = self.sharding_now()

    def described(self, key: int) -> list:
        return [("part", key, self._part[key])] if key in self._part else []

    def _set_part(self, key: int, part: str) -> None:
        if self.labelled and self._part.get(key) != part:  # what `tracker.labelled_peak` replays
            self.events.append(("part", key, part))
        self._part[key] = part

    def _mark(self, tensors, part: str) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for inner in _local(t):
                    key = inner.untyped_storage()._cdata
                    if key in self._live:
                        self._set_part(key, part)

    def watch(self, model: nn.Module) -> None:
        """Follow the FSDP2 groups of a sharded model (their buffers and unsharded tensors)."""
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None:
                    self._groups.append(group)

    def _mark_unsharded(self) -> None:
        """The unsharded parameters are `other`, pinned: autograd saves them for backward
        (a matmul keeps its weight), which must not make them activations (FSDP2 frees them
        after forward all the same, by resizing their storage). Called after each group
        hook, on every group: a storage marked before (`other`, pinned, its part set) is
        passed over, as marking it again changes nothing."""
        for group in self._groups:
            for p in group.fsdp_params:
                for t in p.all_gather_outputs:  # plain tensors
                    key = t.untyped_storage()._cdata
                    entry = self._live.get(key)
                    if entry is None or entry[1] == "other" and entry[2] and self._part.get(key) == "unsharded_param":
                        continue
                    self._add(t, "other", pinned=True, relabel=True)
                    self._set_part(key, "unsharded_param")

    # -- the tracker's bookkeeping, extended ----------------------------------------
    def _add(self, tensor, category, pinned, relabel):
        if self._ignore and _storage_key(tensor) not in self._live:
            return
        peak_split = self.peak_split
        new = None
        if self._in_fsdp and not hasattr(type(tensor), "__tensor_flatten__"):
            key = tensor.untyped_storage()._cdata
            new = key if key not in self._live else None
        super()._add(tensor, category, pinned, relabel)
        if new is not None and new in self._live:
            self._set_part(new, "comm")
        if self.peak_split is not peak_split:
            self._new_peak()

    def _free(self, key):
        self._part.pop(key, None)
        super()._free(key)

    def reset_peak(self):
        super().reset_peak()
        self._new_peak()

    def _resized(self, storage) -> None:
        """Count a storage's new size after `UntypedStorage.resize_` (a free, then an
        allocation, for the allocator model)."""
        entry = self._live.get(storage._cdata)
        if entry is None:
            return
        key, old, new = storage._cdata, entry[0], self._size(storage)
        if new == old:
            return
        if self.events is not None:
            if old:
                self.events.append(("free", key))
            if new:
                self.events.append(("alloc", key, storage.nbytes(), entry[1]) if self.labelled
                                   else ("alloc", key, storage.nbytes()))
                if self.labelled and key in self._part:  # the same storage: its part stays
                    self.events.append(("part", key, self._part[key]))
        entry[0] = new
        self._totals[entry[1]] += new - old
        self.current += new - old
        if self.current > self.peak:
            self.peak = self.current
            self.peak_split = MemorySplit(**self._totals)
            self._new_peak()
        if self.capacity_bytes is not None and self.current > self.capacity_bytes:
            from bench.hooks import CapacityExceeded

            raise CapacityExceeded(f"live tensors need {self.current:,} bytes, over the capacity "
                                   f"of {self.capacity_bytes:,} bytes")

    # -- dispatch -------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs it as local ops, which come back here
        return MemoryTracker.__torch_dispatch__(self, func, types, args, kwargs)

    @contextlib.contextmanager
    def ignoring(self):
        """Leave out the storages made inside the block (they are not the step's)."""
        self._ignore += 1
        try:
            yield
        finally:
            self._ignore -= 1

    def __enter__(self):
        self._patches = contextlib.ExitStack()
        self._patches.enter_context(_patched_resize(self))
        self._patches.enter_context(_patched_groups(self))
        self._patches.enter_context(_patched_propagation(self))
        self._patches.enter_context(_patched_collectives(self))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()


def _storage_key(t: torch.Tensor) -> int | None:
    return None if hasattr(type(t), "__tensor_flatten__") else t.untyped_storage()._cdata


@contextlib.contextmanager
def _patched_propagation(tracker: ShardedTracker):
    """DTensor works out an op's output shape by running it on fake tensors of the global
    shapes, the first time it meets the op (then cached), under the active fake mode if
    there is one: in the simulated tier, ours. Those tensors are not the step's."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self, op_schema):
        with tracker.ignoring():
            return original(self, op_schema)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


# The collectives FSDP2 calls (through `torch.distributed`, looked up at each call).
COLLECTIVES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor",
               "reduce_scatter_tensor", "all_reduce")


@contextlib.contextmanager
def _patched_collectives(tracker: ShardedTracker):
    """A collective's own temporaries are the process group's, not the step's: gloo
    reduce-scatters through a flat copy of its input, which the tracker would see (in part:
    when `wait()` splits it); NCCL, on a GPU, and the fake group make none. Left out, so
    the tracked tier counts what the simulated tier counts."""
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(fn):
        def inner(*args, **kwargs):
            with tracker.ignoring():
                return fn(*args, **kwargs)
        return inner

    for name, fn in originals.items():
        setattr(dist, name, wrap(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _local(t: torch.Tensor) -> list[torch.Tensor]:
    from bench.hooks import inner_tensors

    return inner_tensors(t)


@contextlib.contextmanager
def _patched_resize(tracker: ShardedTracker):
    original = torch.UntypedStorage.resize_

    def resize_(storage, size):
        out = original(storage, size)
        tracker._resized(storage)
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original


@contextlib.contextmanager
def _patched_groups(tracker: ShardedTracker):
    """Wrap FSDP2's group hooks: what they allocate is sharding's (`comm`, unless it turns
    out to be an unsharded parameter or becomes a gradient shard); the unsharded
    gradients are marked when the post-backward hook takes them."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    names = ("pre_forward", "post_forward", "pre_backward", "post_backward", "finalize_backward",
             "unshard", "wait_for_unshard", "reshard")
    originals = {n: getattr(FSDPParamGroup, n) for n in names}

    def wrap(name, fn):
        def inner(group, *args, **kwargs):
            if name == "post_backward":
                tracker._mark([p._unsharded_param.grad for p in group.fsdp_params
                               if hasattr(p, "_unsharded_param")], "unsharded_grad")
            tracker._in_fsdp += 1
            try:
                return fn(group, *args, **kwargs)
            finally:
                tracker._in_fsdp -= 1
                tracker._mark_unsharded()
        inner.__name__ = fn.__name__
        return inner

    for n, fn in originals.items():
        setattr(FSDPParamGroup, n, wrap(n, fn))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(FSDPParamGroup, n, fn)


# -- one rank ----------------------------------------------------------------------
def measure_rank(job: Job, method: Method, world_size: int, rank: int = 0,
                 reference: bool = False) -> dict:
    """One rank's memory over a warm-up and a measured step of `job` (a memory job: its
    model, batch, dtype, seed) under FSDP2 on `world_size` ranks. Simulated (fake tensors,
    fake process group, made here) if `job.simulate`, else tracked (real tensors: the caller
    initialised the gloo group, `run_ranks`). Returns `memory` (tier, the five categories,
    `peak_bytes`, and on fake tensors the allocator model's prediction), `sharding` (the
    part of `other` at the peak that sharding adds, by `SHARDING_PARTS`), `events` (the
    allocation order of both steps, for `bench.measure.allocator`), the sharded
    `shards` (per parameter: name, full shape, local and padded numel, element size), and
    with `reference` (real runs) `fsdp_mem_tracker`: a third step under PyTorch's
    `FSDPMemTracker`, its peak per category (its names, lower case: sharded_param,
    unsharded_param, all_gather, reduce_scatter, act, temp, opt, inp, ..., total)."""
    from torch.distributed.device_mesh import init_device_mesh

    fake = step.fake_mode() if job.simulate else None
    with process_group(world_size, rank, fake is not None):
        mesh = init_device_mesh("cpu", (world_size,))  # before fake mode: it holds real ranks
        model, stream = step.setup(job, method, fake)
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        with fake or contextlib.nullcontext():  # FSDP2 makes its buffers with factory calls
            shard(model, mesh)
            # FSDP2's lazy initialisation (at the first forward) may pad a rank's shards again
            # into new storages (on fake tensors, whose data_ptr it cannot compare, always where
            # the rank's rows are fewer than the padded rows): done here, before tracking, so
            # that the tracker registers the final shards as `param`
            model._get_fsdp_state()._lazy_init()
        out = {"world_size": world_size, "rank": rank, "n_params": models.n_params(model),
               "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
               "shards": [{"name": name, "shape": list(shapes[name]), "dtype": str(p.dtype),
                           "element_size": p.element_size(),
                           "local_numel": p.to_local().numel(),
                           "padded_numel": p.to_local().untyped_storage().nbytes() // p.element_size()}
                          for name, p in model.named_parameters()]}
        out.update(_memory(job, method, model, stream, fake))
        if reference and fake is None:
            out["fsdp_mem_tracker"] = _reference(job, method, model, stream, out.pop("_optimizer"))
        out.pop("_optimizer", None)
    return out


def _memory(job: Job, method: Method, model, stream, fake) -> dict:
    """`kinds._memory`'s two steps, with `ShardedTracker`."""
    events: list = []
    tracker = ShardedTracker(events=events)
    take_batch = step.batch_feeder(stream, job.device, fake, tracker)
    tracker.register_model(model)  # after fully_shard: the sharded parameters
    tracker.watch(model)

    out: dict = {}
    before_update: list = []  # the live split as each optimizer step begins

    def hooked(optimizer):
        if hasattr(optimizer, "_optimizer_step_pre_hooks"):  # a torch.optim.Optimizer's hooks
            optimizer.register_step_pre_hook(lambda *_: before_update.append(tracker.live_split()))

    with fake or contextlib.nullcontext(), tracker, cuda_kernels():
        optimizer, loss = step.memory_steps(
            method, model, tracker, take_batch, on_optimizer=hooked,
            after_warm_up=lambda: out.update(first_step_peak_bytes=tracker.peak))
        out["loss"] = None if fake is not None else step.checked(loss, 1)
        del loss
        after = tracker.live_split()
    split = tracker.peak_split.as_row()
    out["memory"] = {"tier": "simulated" if fake is not None else "tracked", **split,
                     "tracked_peak_bytes": split["peak_bytes"]}
    if fake is not None:
        out["memory"].update(step.predict_gpu(events, None))
    out["sharding"] = {**tracker.sharding_at_peak, "bytes": sum(tracker.sharding_at_peak.values())}
    # none where the update runs inside backward (LOMO) or the optimizer has no step hooks
    out["before_update"] = ({c: getattr(before_update[-1], c) for c in ("param", "grad", "optimizer")}
                            if before_update else None)
    out["after_step"] = {c: getattr(after, c) for c in ("param", "grad", "optimizer")}
    out["events"] = events
    out["_optimizer"] = optimizer
    return out


def _reference(job: Job, method: Method, model, stream, optimizer) -> dict:
    """One more step of the same training under PyTorch's `FSDPMemTracker`: its peak bytes
    per category (its own categories, on the CPU device)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    batch = step.next_batch(stream, job.device)
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((batch,))
    with tracker, cuda_kernels():
        method.train_step(model, optimizer, batch)
    snapshot = tracker.get_tracker_snapshot("peak")
    device = next(iter(snapshot))
    return {getattr(k, "name", str(k)).lower(): int(v) for k, v in snapshot[device].items()}


# -- real runs: one process per rank ---------------------------------------------------
def free_port() -> int:
    """A TCP port free on localhost now (the rendezvous of a gloo group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(main, args: tuple, world_size: int) -> None:
    """Run `main(rank, *args)` in `world_size` processes and wait for them all (a failing
    rank fails the call with its traceback), forked by the fork server of `bench.workers`."""
    import torch.multiprocessing as mp

    from bench import workers

    workers.context()  # the fork server's preload, set before start_processes starts it
    mp.start_processes(main, args=args, nprocs=world_size, join=True, start_method="forkserver")


def run_ranks(job: Job, world_size: int, reference: bool = False, threads: int = 1) -> list[dict]:
    """The tracked tier: `world_size` processes (`start_ranks`), a gloo group on localhost,
    each measuring its rank (`measure_rank`); their results in rank order. A failing rank
    fails the call with its traceback."""
    if job.simulate:
        raise ValueError("run_ranks runs real tensors: a simulated job is measured by measure_rank")
    with tempfile.TemporaryDirectory() as folder:
        start_ranks(_rank_main, (world_size, free_port(), job.to_dict(), folder, reference, threads), world_size)
        results = []
        for rank in range(world_size):
            with open(os.path.join(folder, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def _rank_main(rank: int, world_size: int, port: int, job_dict: dict, folder: str,
               reference: bool, threads: int) -> None:
    import torch.distributed as dist

    from bench.method import load

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        job = Job.from_dict(job_dict)
        result = measure_rank(job, load(job.method, job.hparams), world_size, rank, reference)
        with open(os.path.join(folder, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def simulate_ranks(job: Job, world_size: int, ranks=None) -> list[dict]:
    """The simulated tier for several ranks of `world_size` (default: all), one after the
    other in this process."""
    from bench.method import load

    sim = Job.from_dict({**job.to_dict(), "simulate": True})
    return [measure_rank(sim, load(sim.method, sim.hparams), world_size, rank)
            for rank in (range(world_size) if ranks is None else ranks)]

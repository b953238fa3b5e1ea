"""Exact live-tensor memory accounting by category.

`MemoryTracker` sees every tensor PyTorch creates while it is active (a
`TorchDispatchMode`), counts each storage once (views share a storage), and notices
when a storage is freed (a weak-reference finalizer). It keeps the live bytes per
category and the split at the moment of the peak, so the categories of a peak always
add up to that peak.

Categories, and what puts a storage in one:

- ``param``: parameters of the model, registered before the step.
- ``grad``: a storage that became a parameter's ``.grad`` (post-accumulate-grad hook).
- ``optimizer``: persistent optimizer state (what `Method.state_tensors` returns,
  labelled after each optimizer step). Temporaries of the update itself are ``other``.
- ``activation``: a storage autograd saved for backward (saved-tensor pack hook), or
  one made by a forward pass re-run during backward (checkpointing's recomputation:
  ops that run inside backward with grad mode on).
- ``other``: everything else: inputs, buffers, temporaries, the incoming gradient
  before it is accumulated.

A storage's category is the latest label it received; params and inputs registered by
hand keep theirs. The tracker works on real tensors (the *tracked* tier, CPU) and on
fake tensors (`FakeTensorMode`, the *simulated* tier): it only reads sizes.
A wrapper tensor subclass (torchao's quantised optimizer states and the views its ops
return) holds no storage of its own: its `untyped_storage()` claims numel x its dtype's
size, memory it does not hold, so the tracker counts its inner tensors instead
(`bench.hooks.inner_tensors`).
Host memory is not device memory. What a method deliberately keeps in host memory
(`bench.hooks.to_host`, and whatever it makes inside `bench.hooks.on_host()`: offloaded
activations, an offloaded optimizer's state) goes to a separate host ledger, `HostLedger`,
never to a category, the peak or the allocation events (`events=`: the device allocator's
replay); on a CUDA job, the CPU storages a method did not put there are not counted at all.
On the CPU (tracked tier) and on fake tensors (simulated tier) a "host" tensor is a CPU
tensor like the rest: the tracker tells it apart by its storage, made while it attributed
new storages to the host. The ledger gives `host_peak_bytes` (`HostLedger`'s rule) and the
tracker `transfer_bytes`: the bytes copied between host and device (both directions,
`bench.hooks.transfer`) since the last `reset_peak`, i.e. per measured step.
What it cannot see: the allocator (caching, fragmentation, CUDA context, library
workspaces). On CUDA the *measured* tier adds the allocator's own peak beside it; on
fake tensors, `events=` records the allocation order for `bench.measure.allocator` to replay.
"""
from __future__ import annotations

import contextlib
import importlib
import pkgutil
import weakref
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bench.hooks import CapacityExceeded, Tracker, inner_tensors  # CapacityExceeded: raised here
from bench.job import CATEGORIES


@dataclass
class MemorySplit:
    """Bytes per category at one moment; `peak_bytes` is their sum."""

    param: int = 0
    grad: int = 0
    optimizer: int = 0
    activation: int = 0
    other: int = 0

    @property
    def peak_bytes(self) -> int:
        return self.param + self.grad + self.optimizer + self.activation + self.other

    def as_row(self) -> dict:
        row = {f"{c}_bytes": getattr(self, c) for c in CATEGORIES}
        row["peak_bytes"] = self.peak_bytes
        return row


def labelled_peak(events: list) -> tuple[MemorySplit, dict[str, int]]:
    """The split at the peak as `MemoryTracker` keeps it, from its labelled events
    (`labelled=True`): the live bytes per category replayed event by event, the peak counted
    from the last ("mark", "peak") on (the first allocation that exceeds it makes it); and
    at that peak, per part (a sharded tracker's ("part", key, part) events), the bytes of the
    storages still `other`, as `ShardedTracker.sharding_at_peak` counts them (after a new
    storage's own part is set)."""
    totals, live, parts = dict.fromkeys(CATEGORIES, 0), {}, {}  # key -> [bytes, category]; key -> part
    current, peak, pending = 0, None, None  # pending: the key of the allocation that made the peak
    split, at_peak = MemorySplit(), {}

    def other_by_part() -> dict[str, int]:
        out: dict[str, int] = {}
        for key, part in parts.items():
            entry = live.get(key)
            if entry is not None and entry[1] == "other":
                out[part] = out.get(part, 0) + entry[0]
        return out

    for event in events:
        kind = event[0]
        if pending is not None and not (kind == "part" and event[1] == pending):
            at_peak, pending = other_by_part(), None
        if kind == "alloc":
            live[event[1]] = [event[2], event[3]]
            totals[event[3]] += event[2]
            current += event[2]
            if peak is not None and current > peak:
                peak, split, pending = current, MemorySplit(**totals), event[1]
        elif kind == "free":
            entry = live.pop(event[1], None)
            parts.pop(event[1], None)
            if entry is not None:
                totals[entry[1]] -= entry[0]
                current -= entry[0]
        elif kind == "label" and event[1] in live:  # (not a storage resized to nothing)
            entry = live[event[1]]
            totals[entry[1]] -= entry[0]
            totals[event[2]] += entry[0]
            entry[1] = event[2]
        elif kind == "part":
            parts[event[1]] = event[2]
        elif event == ("mark", "peak"):
            peak, split, at_peak = current, MemorySplit(**totals), other_by_part()
    return split, other_by_part() if pending is not None else at_peak


class HostLedger:
    """Host memory a method keeps deliberately, as PyTorch's pinned-memory allocator holds it
    (`CachingHostAllocator`, aten/src/ATen/core/CachingHostAllocator.h): each request is a
    block of its size rounded up to a power of two; a freed block is cached and reused by a
    later request of the same rounded size; nothing cached is given back. `peak_bytes` is
    the bytes of all blocks reserved so far: a high-water mark that never goes down (over the
    warm-up and the measured step alike; it includes what the allocator caches, so it can
    exceed the most bytes ever live at once when block sizes change)."""

    def __init__(self):
        self.live: dict[int, int] = {}  # storage key -> block bytes
        self.cached: dict[int, int] = {}  # block bytes -> free blocks of that size
        self.current = 0  # bytes of blocks in use
        self.peak_bytes = 0  # bytes of blocks reserved

    @staticmethod
    def block(nbytes: int) -> int:
        return 1 << (nbytes - 1).bit_length() if nbytes > 0 else 0

    def alloc(self, key: int, nbytes: int) -> None:
        size = self.block(nbytes)
        if self.cached.get(size):
            self.cached[size] -= 1
        else:
            self.peak_bytes += size
        self.live[key] = size
        self.current += size

    def free(self, key: int) -> None:
        size = self.live.pop(key, None)
        if size is not None:
            self.cached[size] = self.cached.get(size, 0) + 1
            self.current -= size


class MemoryTracker(TorchDispatchMode, Tracker):
    """Track live tensor bytes by category; see the module docstring.

    Use as a context manager around the training steps, after registering what existed
    before (`register_model`, `register`). `capacity_bytes` turns the tracker into a
    memory cap: going over it raises `CapacityExceeded`. What methods may use of it is
    `bench.hooks.Tracker` (they find it with `bench.hooks.active_tracker`). `device`: where
    the step runs; on any device but the CPU, CPU storages are host memory (the ledger's if a
    method put them there, else not counted).
    """

    def __init__(self, capacity_bytes: int | None = None, round_to: int = 1,
                 events: list | None = None, device: str = "cpu", labelled: bool = False):
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self.round_to = round_to
        self.events = events  # if a list: ("alloc", key, nbytes) and ("free", key), in order
        # `labelled`: the events also say each storage's category (`labelled_peak`): an
        # allocation's as a fourth field, each change after it as ("label", key, category),
        # and where the peak starts anew as ("mark", "peak")
        self.labelled = labelled and events is not None
        self.device_is_cpu = torch.device(device).type == "cpu"
        self.host = HostLedger()
        self.transfer_bytes = 0
        self._on_host = 0  # > 0: new storages are host memory
        # storage key (its address, which a later storage may reuse) -> [bytes, category,
        # pinned, serial (which storage: a number no other storage of this tracker gets)]
        self._live: dict[int, list] = {}
        self._serial = 0
        self._totals = dict.fromkeys(CATEGORIES, 0)
        self.current = 0
        self.peak = 0
        self.peak_split = MemorySplit()
        self._hooks: list = []
        self._saved_hooks = None

    # -- storages ---------------------------------------------------------------
    def _size(self, storage) -> int:
        n = storage.nbytes()
        return -(-n // self.round_to) * self.round_to

    def _add(self, tensor: torch.Tensor, category: str, pinned: bool, relabel: bool) -> None:
        if hasattr(type(tensor), "__tensor_flatten__"):  # a wrapper: no storage of its own
            for inner in inner_tensors(tensor):
                self._add(inner, category, pinned, relabel)
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        entry = self._live.get(key)
        if entry is not None:
            if relabel and (pinned or not entry[2]):
                self._relabel(key, entry, category)
                entry[2] = entry[2] or pinned
            return
        if key in self.host.live:  # host memory stays host memory, whatever its label
            return
        if self._on_host and tensor.device.type == "cpu":
            self.host.alloc(key, storage.nbytes())
            weakref.finalize(storage, self.host.free, key)
            return
        if tensor.device.type == "cpu" and not self.device_is_cpu:  # host memory no method put in the ledger
            return
        size = self._size(storage)
        self._live[key] = [size, category, pinned, self._serial]
        self._serial += 1
        self._totals[category] += size
        self.current += size
        if self.events is not None:
            self.events.append(("alloc", key, storage.nbytes(), category) if self.labelled
                               else ("alloc", key, storage.nbytes()))
        weakref.finalize(storage, self._free, key)
        if self.current > self.peak:
            self.peak = self.current
            self.peak_split = MemorySplit(**self._totals)
        if self.capacity_bytes is not None and self.current > self.capacity_bytes:
            raise CapacityExceeded(
                f"live tensors need {self.current:,} bytes, over the capacity of "
                f"{self.capacity_bytes:,} bytes")

    def _relabel(self, key: int, entry: list, category: str) -> None:
        self._totals[entry[1]] -= entry[0]
        self._totals[category] += entry[0]
        if self.labelled and category != entry[1]:
            self.events.append(("label", key, category))
        entry[1] = category

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._totals[entry[1]] -= entry[0]
            self.current -= entry[0]
            if self.events is not None:
                self.events.append(("free", key))

    # -- host -------------------------------------------------------------------
    @contextlib.contextmanager
    def on_host(self):
        """New storages made inside are host memory (the ledger's), not device memory."""
        self._on_host += 1
        try:
            yield
        finally:
            self._on_host -= 1

    def transferred(self, nbytes: int) -> None:
        """Count bytes copied between host and device."""
        self.transfer_bytes += nbytes

    def host_row(self) -> dict:
        return {"host_peak_bytes": self.host.peak_bytes, "transfer_bytes": self.transfer_bytes}

    def register(self, tensors, category: str) -> None:
        """Count tensors created before tracking (inputs, buffers) under a fixed category."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t, category, pinned=True, relabel=True)

    def label(self, tensors, category: str) -> None:
        """Give tensors (already live or not) a category, unless they are pinned."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t, category, pinned=False, relabel=True)

    def register_model(self, model: torch.nn.Module) -> None:
        """Count parameters as `param` and buffers as `other`; label grads as they appear."""
        params = list(model.parameters())
        self.register(params, "param")
        self.register(model.buffers(), "other")
        for p in params:
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self.label([param.grad], "grad")

    def _on_save(self, tensor: torch.Tensor):
        key = tensor.untyped_storage()._cdata
        entry = self._live.get(key)
        if entry is not None and entry[1] == "other" and not entry[2]:
            self._relabel(key, entry, "activation")
        # detached: the same storage without the autograd history (autograd restores it on
        # unpack). Holding `tensor` itself would keep an op's saved output and its graph in
        # a reference cycle when that graph never runs backward (DoRA's detached norm), so
        # the tracker would count bytes a real run frees
        saved = _Saved(tensor.detach())
        self._saved.add(saved)
        return saved

    # -- peak -------------------------------------------------------------------
    def live_bytes(self) -> dict[int, int]:
        """Storage key -> bytes, for every storage alive now."""
        return {key: entry[0] for key, entry in self._live.items()}

    def live_storages(self) -> dict[int, tuple[int, int]]:
        """Storage key -> (its serial, bytes), for every storage alive now: the serial tells
        a storage from an earlier one at the same address."""
        return {key: (entry[3], entry[0]) for key, entry in self._live.items()}

    def category(self, key: int) -> str:
        """The category of the live storage `key`."""
        return self._live[key][1]

    def described(self, key: int) -> list:
        """The labelled events, after its allocation, that say what the live storage `key` is
        now beside its category (none here; a sharded tracker's part)."""
        return []

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (e.g. after a warm-up step), and count
        transfers from zero; the host ledger's high-water mark stays."""
        self.transfer_bytes = 0
        self.peak = self.current
        self.peak_split = MemorySplit(**self._totals)
        if self.labelled:
            self.events.append(("mark", "peak"))

    def live_split(self) -> MemorySplit:
        return MemorySplit(**self._totals)

    # -- dispatch ----------------------------------------------------------------
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """False: `__torch_dispatch__` is not wrapped in PyTorch's guard that keeps
        torch.compile out of a mode's frames (a guard per operator). No step compiles under
        the tracker: a method that compiles runs eagerly there (methods/_common/torchao.py)."""
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE:  # a tensor's device (asked by autograd and operators, most calls): no tensor made
            t = args[0]
            if type(t) is FakeTensor and not t.fake_mode.in_kernel_invocation:
                return t.fake_device  # FakeTensorMode's answer, without a round trip through it
            return func(*args, **(kwargs or {}))
        if func in _PROFILER_MARKS:  # no tensor in or out: the operator's own kernel, below every mode
            with torch._C._DisableTorchDispatch():
                return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        category = "activation" if _recomputing() else "other"
        if isinstance(out, torch.Tensor):  # most operators: one tensor (what tree_flatten would give)
            self._add(out, category, pinned=False, relabel=False)
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t, category, pinned=False, relabel=False)
        return out

    def __enter__(self):
        self._saved = weakref.WeakSet()  # what the graph keeps now (gone once backward frees it)
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._on_save, _Saved.get)
        self._saved_hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._saved_hooks.__exit__(*exc)
            if exc[0] is not None:
                # a step that failed before its backward (e.g. out of memory) leaves a graph
                # that a saved output keeps alive through its own grad_fn, a cycle Python's
                # collector cannot see: it would hold the step's activations for good
                for saved in list(self._saved):
                    saved.tensor = None
            for h in self._hooks:
                h.remove()
            self._hooks.clear()


_OPTIM_MODULES = [f"torch.optim.{m.name}" for m in pkgutil.iter_modules(torch.optim.__path__)
                  if not m.ispkg and not m.name.startswith("_")]


@contextlib.contextmanager
def cuda_kernels():
    """Make a CPU step keep for backward what CUDA's kernels keep, so CPU memory numbers
    (tracked and simulated) stand for a GPU's. Two CPU kernels keep more than CUDA's:

    - dropout: the CPU path saves a mask in the activation's dtype (2-4 bytes per
      element); CUDA's fused kernel (`native_dropout`) saves a 1-byte mask. Routed to
      `native_dropout`, which the CPU also has.
    - attention dropout in `scaled_dot_product_attention`: the CPU falls back to the math
      kernel and keeps three seq x seq tensors per head; CUDA's fused kernels apply the
      dropout inside and keep none. Run without it here (the memory of CUDA's flash
      kernel, whose dropout keeps only a random-number state).

    And one choice PyTorch makes by device: `torch.optim`'s optimizers run their
    multi-tensor (foreach) implementation by default on CUDA, the per-parameter loop on the
    CPU and on fake tensors. The foreach step makes each temporary for all parameters at
    once (e.g. AdamW's denominators: a copy of every parameter's size), which is the peak
    where activations are small (checkpointing on a 1B model: 2.2 GiB more, measured on an
    H100). The CUDA default is taken here too (where a method names `foreach`, its choice
    stands).

    `torch.nn.functional` is patched for the duration (a function mode would miss the
    forward passes checkpointing re-runs inside backward). The loss of a memory job run
    this way has no attention dropout: its memory is the result, not its loss."""
    functional = torch.nn.functional
    dropout, sdpa = functional.dropout, functional.scaled_dot_product_attention
    optim_modules = [m for m in map(importlib.import_module, _OPTIM_MODULES)
                     if hasattr(m, "_default_to_fused_or_foreach")]
    chooses = {m: m._default_to_fused_or_foreach for m in optim_modules}

    def cuda_default(params, differentiable, use_fused=False):  # (fused, foreach) as on CUDA
        return False, not differentiable and not torch.jit.is_scripting()

    def fused_dropout(input, p=0.5, training=True, inplace=False):
        if training and 0 < p < 1 and not inplace:
            return torch.native_dropout(input, p, True)[0]
        return dropout(input, p, training, inplace)

    def flash_like_attention(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        return sdpa(query, key, value, attn_mask, 0.0, *args, **kwargs)

    functional.dropout, functional.scaled_dot_product_attention = fused_dropout, flash_like_attention
    for m in optim_modules:
        m._default_to_fused_or_foreach = cuda_default
    try:
        yield
    finally:
        functional.dropout, functional.scaled_dot_product_attention = dropout, sdpa
        for m, choose in chooses.items():
            m._default_to_fused_or_foreach = choose


class _Saved:
    """A tensor autograd saved, as the tracker's pack hook hands it to the graph."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get(self) -> torch.Tensor:
        return self.tensor


_DEVICE = torch.ops.prim.device.default
# A profiler range's start and end (`torch.profiler.record_function`; FSDP2 opens ranges
# around each of its hooks and collectives): a record object, no tensor
_PROFILER_MARKS = frozenset({torch.ops.profiler._record_function_enter_new.default,
                             torch.ops.profiler._record_function_exit._RecordFunction})


def _recomputing() -> bool:
    """True inside backward with grad mode on: a forward pass being recomputed."""
    return torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled()


@contextlib.contextmanager
def cuda_peak():
    """Measure the CUDA caching allocator around a block: yields a dict filled on exit."""
    stats: dict = {}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        yield stats
    finally:
        torch.cuda.synchronize()
        s = torch.cuda.memory_stats()
        stats.update(
            allocated_peak_bytes=int(s.get("allocated_bytes.all.peak", 0)),
            reserved_peak_bytes=int(s.get("reserved_bytes.all.peak", 0)),
            alloc_retries=int(s.get("num_alloc_retries", 0)),
            cuda_ooms=int(s.get("num_ooms", 0)),
        )

"""What the measuring tool offers the methods it measures, so that no method imports it.

A method module imports the contract (`bench.method`, this module, `bench.job`) and never
`bench.measure`: the tool must not be reached into by what it measures
(tests/unit/test_layout.py holds the rule). The memory tracker
(`bench.measure.tracker.MemoryTracker`) is a `Tracker`; while it measures a step it is on
PyTorch's dispatch-mode stack, and a method that owns its step may use it through this:

- `active_tracker()`: the tracker measuring now, or None (no memory job, or inside
  `untracked()`);
- `tracker.label(tensors, category)`: put tensors in a memory category (one of
  `bench.job.CATEGORIES`), for a step autograd does not see (ROAM's captured graph sets
  no `.grad` and saves nothing for backward);
- `tracker.current`, `tracker.capacity_bytes`: the live tensor bytes now and the memory
  cap (None: no cap); a method that knows a step needs more than the cap (ROAM's traced
  first step) raises `CapacityExceeded`, as the tracker itself does;
- `untracked()`: run a block without the tracker (other modes, e.g. fake tensors, stay
  on): work that is not the training step, such as tracing and planning it.

Host memory (offloading). What a method keeps in host memory is not device memory: the
tracker counts it in a separate host ledger (`host_peak_bytes`, with the pinned-memory
allocator's power-of-two rounding) and the bytes copied each step (`transfer_bytes`).
A method moves data only through these, which do the same work with no tracker (throughput
and convergence jobs: the same numbers):

- `to_host(tensor)`: a host copy (pinned where the tensor is on a CUDA device); on a CPU
  job (the tracked tier, and fake tensors, the simulated tier) a CPU copy the tracker puts
  in the host ledger;
- `to_device(tensor, device)`: a new device copy of a host tensor (on a CPU job a copy the
  tracker counts as device memory);
- `transfer(dst, src)`: `dst.copy_(src)` between host and device into an existing tensor
  (an offloaded optimizer's gradient and parameter), counted;
- `on_host()`: tensors made inside are host memory (an optimizer step run on the host: its
  state and temporaries).

`inner_tensors` is the tracker's rule for a wrapper tensor subclass (torchao's quantised
optimizer states): its memory is that of its inner tensors, which a method's
`state_tensors` returns in its place.

This module imports nothing from bench: the tracker builds on it, not the other way.
"""
from __future__ import annotations

import contextlib

import torch


class CapacityExceeded(RuntimeError):
    """Live tensor bytes went over the configured memory capacity (a simulated OOM)."""


class Tracker:
    """What a method may use of the memory tracker (`bench.measure.tracker.MemoryTracker`
    implements it); see the module docstring."""

    current: int = 0
    capacity_bytes: int | None = None

    def label(self, tensors, category: str) -> None:
        raise NotImplementedError

    def on_host(self):
        """A context in which new storages are host memory."""
        raise NotImplementedError

    def transferred(self, nbytes: int) -> None:
        """Count bytes copied between host and device."""
        raise NotImplementedError


def active_tracker() -> Tracker | None:
    """The innermost tracker on the dispatch-mode stack, or None."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, Tracker):
            return mode
    return None


@contextlib.contextmanager
def untracked():
    """Run without the memory tracker; the other dispatch modes (fake tensors) stay on."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes() as modes, contextlib.ExitStack() as stack:
        for mode in reversed(modes):  # bottom of the stack first
            if not isinstance(mode, Tracker):
                stack.enter_context(mode)
        yield


@contextlib.contextmanager
def on_host():
    """Tensors made inside are host memory (the tracker's host ledger); without a tracker,
    nothing changes."""
    tracker = active_tracker()
    with tracker.on_host() if tracker is not None else contextlib.nullcontext():
        yield


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`: pinned, copied asynchronously on the current stream, from a
    CUDA device (read it on the host only after synchronizing); a plain CPU copy in host
    memory on a CPU job."""
    cuda = tensor.device.type == "cuda"
    with on_host():
        host = torch.empty_like(tensor, device="cpu", pin_memory=cuda)
    return transfer(host, tensor)


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """A new copy of the host tensor `tensor` on `device` (device memory)."""
    return transfer(torch.empty_like(tensor, device=device), tensor)


def transfer(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """`dst.copy_(src)`, one side on the host and the other on the device, counted as a
    transfer of `src`'s bytes; asynchronous to or from a CUDA device. Returns `dst`."""
    with torch.no_grad():
        dst.copy_(src, non_blocking="cuda" in (dst.device.type, src.device.type))
    tracker = active_tracker()
    if tracker is not None:
        tracker.transferred(src.numel() * src.element_size())
    return dst


def inner_tensors(value) -> list[torch.Tensor]:
    """The plain tensors that hold a tensor's memory: itself, or for a wrapper subclass
    (one that flattens, `__tensor_flatten__`) its inner tensors, recursively."""
    if not isinstance(value, torch.Tensor):
        return []
    if hasattr(type(value), "__tensor_flatten__"):
        names, _ = value.__tensor_flatten__()
        return [t for n in names for t in inner_tensors(getattr(value, n))]
    return [value]

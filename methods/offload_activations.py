"""Activation offloading: what autograd saves for backward is copied to host memory in the
forward and copied back to the device when backward needs it.

The technique of torchtune's `OffloadActivations` (training/_activation_offloading.py) and
of PyTorch's `torch.autograd.graph.save_on_cpu`, through
`torch.autograd.graph.saved_tensors_hooks` around the model's forward:

    pack (forward, each tensor t autograd saves)
        if t is on the model's device, t is not a parameter or a buffer, and
           t.numel() x t.element_size() >= min_offload_bytes:
            h = to_host(t)          a host copy (pinned on CUDA, asynchronous)
            keep h                  t itself is freed once nothing else holds it
        else:
            keep t                  on the device, as autograd would
    unpack (backward, when the node that saved t runs)
        t' = to_device(h)           a new device copy, freed after that node's backward

What is offloaded, as torchtune decides it: every saved tensor of at least
`min_offload_bytes` (1024, torchtune's `min_offload_size`) that is not an `nn.Parameter`
object or one of the model's buffers. A view of a weight is neither, so it qualifies: a
Linear's backward keeps W^T, whose host copy costs host memory and a transfer each way
every forward and backward while the device keeps W anyway (torchtune does the same).
What stays on the device: smaller tensors (statistics, masks of few elements, scalars),
parameters and buffers themselves, and what is not on the model's device. A saved tensor
that is also held elsewhere (a block's output that is the next block's input, a batch's
ids) keeps its device memory as well: its host copy saves nothing then. A tensor saved by
two operators is copied twice (one host copy per save, as torchtune and save_on_cpu make).
Only the model's forward is wrapped: what the loss saves after it returns (cross-entropy's
log-probabilities) stays on the device, as torchtune's recipes keep the output layer's
(its backward comes first). In backward each copy comes back as a new device tensor: a
tensor saved twice comes back twice and a weight view beside its weight, so on a small
model the backward peak can be above the plain one (tests/methods/test_offload.py).

Memory (`bench.hooks`): the host copies are the host ledger's (`host_peak_bytes`: the
saved bytes of one forward, each rounded up to a power of two as the pinned-memory
allocator does, at the forward/backward boundary), each copy is a transfer both ways
(`transfer_bytes`: twice the offloaded bytes per step); a copy brought back is
`activation` while its node's backward runs, and so is what stays on the device.

Against `save_on_cpu` (the test's reference): save_on_cpu copies every saved tensor, with
no size threshold and no parameter filter (weights too, not only their views), and on a
CPU-only build its move is a no-op. Loss and gradients are those of the plain model: the
copies are exact.

No stream overlap is modelled: torchtune copies on a side stream and keeps the last 5
offloaded device tensors alive until their copy completes (`max_fwd_stash_size`), and
holds a tensor brought back until the next node starts; here the copy is issued on the
current stream (asynchronous from pinned memory, in order with the compute), so the
device frees a tensor when autograd drops it.

With checkpointing (`checkpointing+offload_activations`): non-reentrant checkpointing
puts its own hooks innermost inside each checkpointed block, so only what is saved
outside the blocks reaches these hooks: each block's input (the checkpoint keeps it for
the recomputation), the embeddings', final norm's and head's saves. The recomputed
forward in backward is outside the wrapped forward and keeps its activations on the
device (torchtune's recipes pair offloading with checkpointing for this reason: one
N x H tensor per block leaves the device). Outer hooks (the memory tracker's, another
method's) still see every saved tensor that stays on the device: packing passes it through
them (the tracker counts it as `activation`); a host copy is not theirs.
Stacks with every method (the optimizer, the step and the loss are untouched; only the
model's forward is wrapped); runs on fake tensors.
"""
from __future__ import annotations

import torch

from bench.hooks import active_tracker, to_device, to_host
from bench.method import Method


class _Offloaded:
    """A saved tensor's host copy, and the device it comes back to."""

    __slots__ = ("host", "device")

    def __init__(self, host: torch.Tensor, device: torch.device):
        self.host, self.device = host, device


class ActivationOffloader:
    """The saved-tensor hooks of one forward pass of `model`."""

    def __init__(self, model: torch.nn.Module, min_offload_bytes: int):
        self.min_offload_bytes = min_offload_bytes
        self.buffers = {id(b) for b in model.buffers()}
        param = next(model.parameters(), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.offloaded = self.offloaded_bytes = self.kept = 0
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.outer_pack, self.outer_unpack = outer if outer is not None else (None, None)

    def offloads(self, t: torch.Tensor) -> bool:
        return (t.device == self.device and t.numel() * t.element_size() >= self.min_offload_bytes
                and not isinstance(t, torch.nn.Parameter) and id(t) not in self.buffers)

    def pack(self, t: torch.Tensor):
        if self.offloads(t):
            self.offloaded += 1
            self.offloaded_bytes += t.numel() * t.element_size()
            value = _Offloaded(to_host(t.detach()), t.device)
        else:
            self.kept += 1
            value = t.detach()  # the same storage; autograd restores the history on unpack
        return (self.outer_pack(value) if self.outer_pack and not isinstance(value, _Offloaded)
                else value), self.outer_unpack

    @property
    def report(self) -> dict:
        return {"offloaded": self.offloaded, "offloaded_bytes": self.offloaded_bytes, "kept": self.kept}


def _unpack(packed):
    # module level (no reference to the forward's offloader: host copies die with their node)
    value, outer_unpack = packed
    if isinstance(value, _Offloaded):
        t = to_device(value.host, value.device)
        tracker = active_tracker()
        if tracker is not None:
            tracker.label([t], "activation")
        return t
    return outer_unpack(value) if outer_unpack else value


class OffloadActivations(Method):
    paper = ("torchtune OffloadActivations (training/_activation_offloading.py), 2024; PyTorch "
             "torch.autograd.graph.save_on_cpu; the idea as in vDNN: Rhu et al., vDNN: Virtualized Deep "
             "Neural Networks for Scalable, Memory-Efficient Neural Network Design, MICRO 2016, "
             "arXiv 1602.08124")
    defaults = dict(min_offload_bytes=1024)
    ranges = {"min_offload_bytes": "[0, inf)"}

    def transform_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Offload what autograd saves during `model`'s forward: a forward pre-hook enters the
        saved-tensor hooks, a forward hook (also called on an exception) leaves them."""
        if getattr(model, "_offload_activations", False):
            return model
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._exit, always_call=True)
        model._offload_activations = True
        self._active = []
        return model

    def _enter(self, model, args):
        offloader = ActivationOffloader(model, int(self.hp["min_offload_bytes"]))
        hooks = torch.autograd.graph.saved_tensors_hooks(offloader.pack, _unpack)
        hooks.__enter__()
        self._active.append((offloader, hooks))

    def _exit(self, model, args, output):
        offloader, hooks = self._active.pop()
        hooks.__exit__(None, None, None)
        self.report = offloader.report


METHOD = OffloadActivations

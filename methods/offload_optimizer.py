"""Optimizer offloading: the AdamW state of the large parameters lives in host memory and
their update runs there; the device keeps the parameters, their gradients and the small
parameters' optimizer.

The algorithm of torchao's `CPUOffloadOptimizer` (torchao/optim/cpu_offload.py, torchao
0.18), after ZeRO-Offload (Ren et al., USENIX ATC 2021, arXiv 2101.06840) without its
sharding or fp32 master copy. Per trainable parameter p on the device:

    numel(p) <  minimal_size (4096)   stepped on the device by one AdamW (`device optimizer`)
    numel(p) >= minimal_size          offloaded:
        at construction   h = to_host(p)             host copy in p's own dtype (pinned on CUDA)
                          h.grad = host buffer        preallocated, p's dtype
                          one AdamW (fused CPU kernel) over h; its state is made on the host
        in backward       once p.grad is accumulated (post-accumulate-grad hook):
                          transfer(h.grad, p.grad)    device -> host
                          p.grad = None               if offload_gradients
        step              the device optimizer steps;
                          then for each p whose gradient came (in order): AdamW on h, on the
                          host; transfer(p, h)        host -> device, the updated parameter
        zero_grad         the device gradients only (the host one is overwritten next step)

Memory: the device `optimizer` category holds only the small parameters' AdamW state; the
device keeps every gradient until zero_grad (as AdamW does) unless `offload_gradients`
(default False, as torchao), which frees each large gradient once copied. Host ledger
(`host_peak_bytes`), per offloaded parameter of b bytes, each block a power of two as
the pinned-memory allocator rounds it: the copy, its gradient, exp_avg and exp_avg_sq
(4 blocks of b rounded up; all in the parameter's dtype) and the 4-byte float32 step
count. Transfers per step (`transfer_bytes`): each offloaded gradient once per micro-batch
(the hook fires after every accumulation; the last copy is the whole gradient) and each
offloaded parameter once: (micro_batches + 1) x the offloaded bytes.

Differences from torchao: torchao copies on a side CUDA stream and steps each parameter as
soon as its gradient's copy is done, overlapping the host steps with the copies; here the
copies are issued on the current stream and the host steps wait for them (one
synchronization per step). Same arithmetic. `offload_gradients` with gradient
accumulation is refused, as torchao documents (it would keep the last micro-batch's
gradient only).

Peer: torchao's `CPUOffloadOptimizer` cannot run here: it asserts that a CUDA or XPU
device is available ("CPU Offload currently only supports CUDA & XPU") and has no CPU
mode, so the test compares against `torch.optim.AdamW` in float64 (the same parameters
after several steps, to rounding) instead. With fake tensors (the simulated tier) the
host AdamW runs on fake tensors too.
"""
from __future__ import annotations

import torch

from bench.hooks import on_host, to_host, transfer
from bench.method import Method, MethodError


class CPUOffloadAdamW(torch.optim.Optimizer):
    """AdamW with the large parameters' state and update on the host; see the module
    docstring. Not `Optimizer.__init__`'s bookkeeping (as torchao's): `param_groups` lists
    the host copies' groups and the device optimizer's."""

    def __init__(self, params, adam_args: dict, minimal_size: int = 4096, offload_gradients: bool = False):
        self.host_of: dict[torch.Tensor, torch.Tensor] = {}  # device parameter -> host copy
        self.host_optimizers: dict[torch.Tensor, torch.optim.Optimizer] = {}
        self.ready: dict[torch.Tensor, None] = {}  # parameters whose gradient is on the host, in order
        self.offload_gradients = offload_gradients
        small = []
        for p in params:
            if not p.requires_grad:
                continue
            if p.numel() < minimal_size:
                small.append(p)
                continue
            host = to_host(p.detach())
            with on_host():
                host.grad = torch.empty_like(host, pin_memory=p.device.type == "cuda")
            self.host_of[p] = host
            self.host_optimizers[p] = torch.optim.AdamW([host], **adam_args, fused=True)
            p.register_post_accumulate_grad_hook(self._grad_to_host)
        self.device_optimizer = torch.optim.AdamW(small, **adam_args) if small else None
        self.state = self.device_optimizer.state if self.device_optimizer else {}

    def _grad_to_host(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        transfer(self.host_of[p].grad, p.grad)
        self.ready.pop(p, None)
        self.ready[p] = None  # stepped in the order the gradients came
        if self.offload_gradients:
            p.grad = None

    @property
    def param_groups(self) -> list[dict]:
        device = self.device_optimizer.param_groups if self.device_optimizer else []
        return device + [g for o in self.host_optimizers.values() for g in o.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        if self.device_optimizer is not None:
            self.device_optimizer.step()
        for p in self.ready:
            if p.device.type == "cuda":
                torch.cuda.current_stream(p.device).synchronize()  # its gradient's copy is done
            with on_host():
                self.host_optimizers[p].step()
            transfer(p, self.host_of[p])
        self.ready.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.host_of:
            p.grad = None
        if self.device_optimizer is not None:
            self.device_optimizer.zero_grad(set_to_none=True)

    def host_state(self) -> list[torch.Tensor]:
        """Everything the optimizer holds on the host: copies, gradients, AdamW state."""
        out = []
        for p, host in self.host_of.items():
            out += [host, host.grad, *self.host_optimizers[p].state[host].values()]
        return out


class OffloadOptimizer(Method):
    paper = ("torchao CPUOffloadOptimizer (torchao/optim/cpu_offload.py), 2024; after Ren et al., "
             "ZeRO-Offload: Democratizing Billion-Scale Model Training, USENIX ATC 2021, arXiv 2101.06840")
    defaults = dict(minimal_size=4096, offload_gradients=False)
    ranges = {"minimal_size": "[1, inf)"}
    # not under ZeRO: DeepSpeed offloads its own partitioned optimizer (ZeRO-Offload); this host
    # AdamW beside it is not what it runs, and its step has no torch.optim hooks for the model's marks
    shards = ("fsdp",)

    def make_optimizer(self, model):
        if self.hp["offload_gradients"] and self.hp["micro_batches"] > 1:
            raise MethodError("offload_optimizer: offload_gradients frees each gradient once copied, so it "
                              "cannot accumulate micro-batches (micro_batches must be 1, as in torchao)")
        return CPUOffloadAdamW(model.parameters(), self.adam_args, int(self.hp["minimal_size"]),
                               self.hp["offload_gradients"])

    def state_tensors(self, optimizer) -> list[torch.Tensor]:
        """The device optimizer's state: what stays in device memory (the host state is the
        host ledger's, and a throughput side parked on the host must not move it)."""
        return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


METHOD = OffloadOptimizer

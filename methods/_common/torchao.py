"""Peer: torchao's low-bit AdamW (`torchao.optim.AdamW8bit`, `AdamW4bit`, `AdamWFp8`).

torchao 0.18.0 (PyPI `torchao`, the PyTorch team's architecture-optimisation library;
tested there on CPU and CUDA). Its AdamW keeps m and v as tensor subclasses holding
block-wise quantised codes, and runs torch's AdamW math per parameter in float32
(`single_param_adam`: dequantise, lerp, requantise on `copy_`), compiled with
`torch.compile`:

    m, v <- dequant(codes_m, s_m), dequant(codes_v, s_v)      (float32)
    theta <- theta - lr wd theta
    m <- lerp(m, g, 1 - b1) ;  v <- lerp(v, g^2, 1 - b2)
    codes_m, s_m <- quant(m) ;  codes_v, s_v <- quant(v)      (one absmax scale per block)
    theta <- theta - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

Formats (read from torchao/optim/subclass_*.py):
- 8-bit (Dettmers et al., ICLR 2022): uint8 codes into a 256-entry dynamic-tree map,
  block 256: 1 byte + 4/256 bytes (float32 scale) per element and state, plus the
  map itself (256 float32 = 1 KiB) per state tensor;
- 4-bit (Li, Chen, Zhu, "Memory Efficient Optimizers with 4-bit States", NeurIPS 2023):
  two codes per byte, block 128, 16-entry maps (dynamic-exponent for m, linear for v,
  64 bytes each): 0.5 + 4/128 bytes per element and state;
- FP8: float8_e4m3fn codes, block 256, no map: 1 + 4/256 bytes per element and state.
Only tensors of >= 4096 elements whose size is a multiple of the block are quantised
(as bitsandbytes); the others keep plain m and v in the parameter's dtype. Each parameter
also has a float32 step tensor (4 bytes) and each group a float32 lr tensor.

How the suite sees them. The subclasses are wrapper tensors without storage of their
own: `state_tensors` returns their inner tensors (codes, scales, maps), which the
tracker counts exactly, and during the step the tracker counts any wrapper an op
returns by its inner tensors too (its own rule, `bench.hooks.inner_tensors`: a
wrapper's `untyped_storage()` claims numel x 4 bytes it does not hold). The tracker (a
TorchDispatchMode) sees an op on a subclass (a `lerp`, a `copy_`) before the subclass
handles it; the temporaries the subclass makes
inside (dequantised values, index tensors of the quantiser) are made with the mode off
the stack, so `step` re-enters the active modes inside the subclasses' handlers
(`_modes_see_inside`): every temporary of the update is then tracked as `other`, on real
and on fake tensors alike.

torch.compile cannot run under a TorchDispatchMode (the tracker, fake tensors): there the
step runs eagerly (`torch.compiler.set_stance("force_eager")`), which is torchao's own
math op by op, with more temporaries than the compiled (fused) kernel; `method_report`
says which ran. Throughput and convergence jobs compile as torchao ships (the first step
at each new shape pays the compilation: tens of seconds on a 2-core CPU); `compile=False`
runs eagerly everywhere. No value is read in the step, so it runs on fake tensors,
once torchao's constant code maps (built with `.tolist()` on first use) exist: the method
builds them on real tensors before the step (`_build_code_maps`).
"""
from __future__ import annotations

import contextlib

import torch

from bench.hooks import inner_tensors
from bench.method import Method, require_package

PIP = "torchao==0.18.0"


def _subclasses():
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit
    from torchao.optim.subclass_fp8 import OptimStateFp8

    return OptimState8bit, OptimState4bit, OptimStateFp8


def _build_code_maps() -> None:
    """Build torchao's 8-bit and 4-bit code maps (constants, cached by torchao) on real
    tensors: torchao makes them with `.tolist()`, which fake tensors cannot answer, so
    built first inside a simulated step they would fail it (and built by an earlier real
    run in the same process they would not: a run's outcome must not depend on that)."""
    from torch.utils._python_dispatch import _disable_current_modes

    from torchao.optim import subclass_4bit, subclass_8bit

    with _disable_current_modes():
        for module in (subclass_8bit, subclass_4bit):
            module.get_qmap_signed()
            module.get_qmap_unsigned()


@contextlib.contextmanager
def _modes_see_inside(classes):
    """While active, the dispatch modes that are on the stack now (the memory tracker,
    fake tensors) also see the ops that `classes`' `__torch_dispatch__` runs inside.

    A mode handles an op before a subclass does, and runs it with itself popped; the
    subclass's handler would then create its temporaries unseen. The patched handler
    pushes back the modes that are missing from the stack while it runs."""
    from torch.utils._python_dispatch import (_get_current_dispatch_mode_stack, _pop_mode,
                                              _push_mode)

    modes = _get_current_dispatch_mode_stack()
    if not modes:
        yield
        return
    originals = {cls: cls.__dict__.get("__torch_dispatch__") for cls in classes}

    def patched(cls, func, types, args=(), kwargs=None):
        missing = [m for m in modes if not any(m is s for s in _get_current_dispatch_mode_stack())]
        for m in missing:
            _push_mode(m)
        try:
            return _dispatch_of(cls, originals)(cls, func, types, args, kwargs)
        finally:
            for _ in missing:
                _pop_mode()

    for cls in classes:
        cls.__torch_dispatch__ = classmethod(patched)
    try:
        yield
    finally:
        for cls, original in originals.items():
            if original is None:
                del cls.__torch_dispatch__
            else:
                cls.__torch_dispatch__ = original


def _dispatch_of(cls, originals):
    original = originals.get(cls)
    if original is not None:
        return original.__func__
    for base in cls.__mro__[1:]:
        found = base.__dict__.get("__torch_dispatch__")
        if found is not None:
            return found.__func__
    raise TypeError(f"{cls.__name__} has no __torch_dispatch__")


class TorchaoAdamW(Method):
    """One of torchao's low-bit AdamW optimizers (`optimizer_name` in `torchao.optim`)."""

    optimizer_name = ""
    paper = ""
    defaults = dict(block_size=256, bf16_stochastic_round=False, compile=True)
    peer_of = "adama_8bit"  # the suite's own block-wise low-bit Adam moments
    package = PIP

    def make_optimizer(self, model):
        optim = require_package("torchao.optim", self.package, self.name)
        _build_code_maps()
        hp = self.hp
        inner = getattr(optim, self.optimizer_name)(
            model.parameters(), **self.adam_args, block_size=hp["block_size"],
            bf16_stochastic_round=hp["bf16_stochastic_round"])
        original_step = inner.step
        classes = _subclasses()

        def step(closure=None):
            from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

            eager = not hp["compile"] or bool(_get_current_dispatch_mode_stack())
            self.report["step"] = "eager" if eager else "torch.compile"
            stance = torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext()
            with stance, _modes_see_inside(classes):
                return original_step(closure)

        inner.step = step
        return inner

    def state_tensors(self, optimizer):
        out = [t for state in optimizer.state.values() for v in state.values()
               for t in inner_tensors(v)]
        out += [g["lr"] for g in optimizer.param_groups if isinstance(g["lr"], torch.Tensor)]
        return out

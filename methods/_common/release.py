"""Gradient release: act on each parameter's gradient as soon as backward has produced it,
then free it, so at most about one parameter's gradient is alive at a time.

Used by the optimizers that work inside backward (AdamA folds the gradient into its
moments, GaLore's per-layer mode runs the whole update). `GradientRelease(params, fn)`
registers a post-accumulate-grad hook on every parameter that requires a gradient; the
hook runs `fn(p)` without autograd recording, then sets `p.grad = None`.

Hooks run in registration order: hooks registered on a parameter before this one (the
memory tracker's, which labels the gradient) still see `p.grad`; hooks registered after
it see `None`. A parameter used several times in a step (tied weights) gets one call,
after all its contributions are summed.

The hooks hold `fn` weakly when it is a bound method (an optimizer's; pass a bound method,
not a closure over the optimizer): a hook lives on
the parameter's autograd metadata, which Python's garbage collector cannot see through,
so a strong reference back to the optimizer (and through it to the parameters) would keep
the model and its optimizer state alive after their last use (seen on a GPU: gigabytes
left allocated by one job into the next).

What cannot work with released gradients: anything that needs every gradient at once
after backward (global gradient-norm clipping, a GradScaler's unscale and inf check).
"""
from __future__ import annotations

import weakref
from typing import Callable, Iterable

import torch


class GradientRelease:
    """Run `fn(p)` under `torch.no_grad()` when `p.grad` is ready, then free `p.grad`."""

    def __init__(self, params: Iterable[torch.Tensor], fn: Callable[[torch.Tensor], None]):
        self._fn = weakref.WeakMethod(fn) if hasattr(fn, "__self__") else (lambda: fn)
        self.handles = [p.register_post_accumulate_grad_hook(self._hook)
                        for p in params if p.requires_grad]

    def _hook(self, p: torch.Tensor) -> None:
        fn = self._fn()
        if fn is None:  # its optimizer is gone: nothing acts on the gradient any more
            return
        with torch.no_grad():
            fn(p)
        p.grad = None

    def remove(self) -> None:
        """Unregister every hook (gradients then stay in `p.grad` as usual)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()

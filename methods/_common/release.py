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

What cannot work with released gradients: anything that needs every gradient at once
after backward (global gradient-norm clipping, a GradScaler's unscale and inf check).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch


class GradientRelease:
    """Run `fn(p)` under `torch.no_grad()` when `p.grad` is ready, then free `p.grad`."""

    def __init__(self, params: Iterable[torch.Tensor], fn: Callable[[torch.Tensor], None]):
        self.fn = fn
        self.handles = [p.register_post_accumulate_grad_hook(self._hook)
                        for p in params if p.requires_grad]

    def _hook(self, p: torch.Tensor) -> None:
        with torch.no_grad():
            self.fn(p)
        p.grad = None

    def remove(self) -> None:
        """Unregister every hook (gradients then stay in `p.grad` as usual)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()

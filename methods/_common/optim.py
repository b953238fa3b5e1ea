"""A base for optimizers that update each parameter on its own."""
from __future__ import annotations

import torch


class PerParameterOptimizer(torch.optim.Optimizer):
    """`step()` calls `self._update(p, group)` for every parameter that has a gradient;
    subclasses define `_update` (which a per-layer variant can also run inside backward)."""

    def _update(self, p: torch.Tensor, group: dict) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

"""GaLore per layer: each weight's GaLore update runs inside backward, then its gradient
is freed, so the full gradient buffer never exists.

Zhao et al., ICML 2024, arXiv 2403.03507: the per-layer weight updates the paper
combines GaLore with (after LOMO; galore-torch's README: one optimizer per parameter,
stepped from a post-accumulate-grad hook). The update is methods/galore.py's, unchanged (same defaults, same targeted
weights, same state); only when it runs differs:

    for each step (one batch, one backward):
        backward; as soon as a parameter's gradient G is complete:
            the GaLore update of methods/galore.py (plain AdamW for the others), then free G
        (no optimizer.step(), no zero_grad: nothing is left to do after backward)

The hooks are methods/_common/release.py's, shared with AdamA. Only one micro-batch per step:
with N micro-batches every micro-batch's backward would run a full update, N optimizer
steps instead of one (the gradient-accumulation problem of galore-torch's per-layer mode,
jiaweizzhao/GaLore#78), so `micro_batches` other than 1 is refused
(`max_micro_batches = 1`). Like AdamA it cannot
serve what needs all gradients after backward (global gradient-norm clipping, fp16 loss
scaling). Compared with galore.py, peak memory loses the gradient buffer (one
parameter's gradient alive at a time); the SVD refreshes run inside backward.
"""
from __future__ import annotations

from bench.method import lm_loss
from methods._common.release import GradientRelease
from methods.galore import GaLore, GaLoreAdamW, param_groups


class LayerwiseGaLoreAdamW(GaLoreAdamW):
    """GaLoreAdamW whose per-parameter update runs from a gradient-release hook."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self._group_of = {id(p): group for group in self.param_groups for p in group["params"]}
        self._release = GradientRelease([p for group in self.param_groups for p in group["params"]],
                                        self._update_released)

    def _update_released(self, p):
        self._update(p, self._group_of[id(p)])

    def step(self, closure=None):
        return None  # every update already ran inside backward

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # gradients are released inside backward


class GaLoreLayerwise(GaLore):
    defaults = {**GaLore.defaults, "micro_batches": 1}
    max_micro_batches = 1  # the update runs inside every backward (galore accumulates)
    loss_scaling = False  # each update runs in backward, before an overflow could be seen

    def make_optimizer(self, model):
        return LayerwiseGaLoreAdamW(param_groups(model, self.hp), **self.adam_args)

    def train_step(self, model, optimizer, batch):
        loss = lm_loss(model, batch)
        loss.backward()  # the hooks update every parameter and release its gradient
        return loss.detach()


METHOD = GaLoreLayerwise

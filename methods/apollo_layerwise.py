"""APOLLO per layer: each weight's APOLLO update runs inside backward, then its gradient is
freed, so the full gradient buffer never exists (APOLLO-Mini per layer:
`apollo_layerwise@rank=1,scale=128,scale_type=tensor`).

Zhu et al., "APOLLO: SGD-like Memory, AdamW-level Performance", MLSys 2025,
arXiv 2412.05270: its LLaMA-7B-in-12-GB setting combines APOLLO-Mini with layer-wise
gradient updates (the authors' `*_per_layer` optimizers: one optimizer per parameter,
stepped from a post-accumulate-grad hook) and int8 weights. The update is
methods/apollo.py's, unchanged (defaults, targeted weights, state); only when it runs
differs:

    for each step (one batch, one backward):
        backward; as soon as a parameter's gradient G is complete:
            the APOLLO update of methods/apollo.py (its AdamW for the others), then free G

The hooks are methods/_common/release.py's (as AdamA and galore_layerwise). One
micro-batch per step (`max_micro_batches = 1`): with N micro-batches each backward would
make its own optimizer step. Nothing that needs every gradient after backward (global
gradient-norm clipping, fp16 loss scaling) can be served. The int8 weights of the
paper's setting are not part of this suite.
"""
from __future__ import annotations

from bench.method import lm_loss
from methods._common.release import GradientRelease
from methods.apollo import APOLLO, APOLLOAdamW, param_groups


class LayerwiseAPOLLOAdamW(APOLLOAdamW):
    """APOLLOAdamW whose per-parameter update runs from a gradient-release hook."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        group_of = {id(p): group for group in self.param_groups for p in group["params"]}
        self._release = GradientRelease([p for group in self.param_groups for p in group["params"]],
                                        lambda p: self._update(p, group_of[id(p)]))

    def step(self, closure=None):
        return None  # every update already ran inside backward

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # gradients are released inside backward


class APOLLOLayerwise(APOLLO):
    paper = ("Zhu et al., APOLLO: SGD-like Memory, AdamW-level Performance, MLSys 2025, "
             "arXiv 2412.05270 (layer-wise updates)")
    defaults = {**APOLLO.defaults, "micro_batches": 1}
    max_micro_batches = 1  # the update runs inside every backward (apollo accumulates)
    loss_scaling = False  # each update runs in backward, before an overflow could be seen

    def make_optimizer(self, model):
        return LayerwiseAPOLLOAdamW(param_groups(model, self.hp), **self.adam_args)

    def train_step(self, model, optimizer, batch):
        loss = lm_loss(model, batch)
        loss.backward()  # the hooks update every parameter and release its gradient
        return loss.detach()


METHOD = APOLLOLayerwise

"""8-bit GaLore per layer: galore_8bit's update (Adam's moments in 8-bit blocks) run inside
backward per parameter, each gradient freed at once, so neither the full gradient buffer
nor 16/32-bit moments exist.

Zhao et al., ICML 2024, arXiv 2403.03507: the combination of the paper's single-GPU
LLaMA-7B claim (8-bit GaLore with per-layer weight updates; galore-torch's
`galore_adamw8bit_per_layer`). The update and its state are methods/galore_8bit.py's;
when it runs is methods/galore_layerwise.py's (the gradient-release hooks of
methods/_common/release.py; one micro-batch per step, `max_micro_batches = 1`).
"""
from __future__ import annotations

from methods.galore import param_groups
from methods.galore_8bit import MIN_8BIT_SIZE, GaLoreAdamW8bit
from methods.galore_layerwise import GaLoreLayerwise, LayerwiseGaLoreAdamW


class LayerwiseGaLoreAdamW8bit(LayerwiseGaLoreAdamW, GaLoreAdamW8bit):
    """GaLoreAdamW8bit's per-parameter update, run from a gradient-release hook."""


class GaLoreLayerwise8bit(GaLoreLayerwise):
    defaults = {**GaLoreLayerwise.defaults, "min_8bit_size": MIN_8BIT_SIZE}
    ranges = {**GaLoreLayerwise.ranges, "min_8bit_size": "[0, inf)"}

    def make_optimizer(self, model):
        return LayerwiseGaLoreAdamW8bit(param_groups(model, self.hp), min_8bit_size=self.hp["min_8bit_size"],
                                        **self.adam_args)

    def state_tensors(self, optimizer):
        return optimizer.state_tensors()


METHOD = GaLoreLayerwise8bit

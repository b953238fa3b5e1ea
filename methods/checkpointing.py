"""Activation checkpointing: keep only each Transformer block's input, recompute inside.

Chen et al., "Training Deep Nets with Sublinear Memory Cost", arXiv 1604.06174, 2016.
Every block of the model runs under `torch.utils.checkpoint` (non-reentrant): its
internal activations are dropped after forward and recomputed during backward, trading
about one extra forward pass for activation memory.
"""
from bench.method import Method


class Checkpointing(Method):
    paper = "Chen et al., Training Deep Nets with Sublinear Memory Cost, arXiv 1604.06174, 2016"

    def transform_model(self, model):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return model


METHOD = Checkpointing

"""Activation checkpointing: keep only each Transformer block's input, recompute inside.

Chen et al., "Training Deep Nets with Sublinear Memory Cost", arXiv 1604.06174, 2016.
Every block of the model runs under `torch.utils.checkpoint` (non-reentrant): its
internal activations are dropped after forward and recomputed during backward, trading
about one extra forward pass for activation memory.

`policy` chooses what a block keeps:

- `full` (the default): nothing but its input; the whole block is recomputed.
- `selective`: PyTorch's selective activation checkpointing
  (`torch.utils.checkpoint.create_selective_checkpoint_contexts`, as torchtitan's
  per-op policy, without its every-other-matmul rule): the outputs of the matmuls
  (aten mm, addmm, bmm, linear) and of the attention kernels (scaled_dot_product_*
  attention, the flash/efficient/cuDNN forwards: every output, the log-sum-exp with it)
  are kept during forward and handed back to the recomputation, which re-runs everything
  else (pointwise ops, norms, activations, dropout with its saved random state). The
  expensive ops run once; a block keeps its matmul and attention outputs instead of
  everything autograd would save. Those kept outputs are `activation` memory (labelled
  so for the memory tracker: PyTorch keeps them in its own cache, not through autograd's
  saved tensors).
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from bench.hooks import active_tracker
from bench.method import Method

POLICIES = ("full", "selective")


def _packets(names) -> frozenset:
    aten = torch.ops.aten
    return frozenset(getattr(aten, n) for n in names if hasattr(aten, n))


# what `selective` keeps: by operator (any overload)
SAVED_OPS = _packets([
    "mm", "addmm", "bmm", "linear",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
    "_efficient_attention_forward",
])


def save_matmuls_and_attention(ctx, op, *args, **kwargs):
    """The selective policy: keep (MUST_SAVE) the outputs of SAVED_OPS, recompute the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op._overloadpacket in SAVED_OPS:
        tracker = active_tracker()
        if tracker is not None:  # called in forward only (the recomputation reads the cache)
            tracker.label(tree_flatten(ctx.op_output)[0], "activation")
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """The two contexts of one checkpointed call under the selective policy."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(save_matmuls_and_attention)


class Checkpointing(Method):
    paper = "Chen et al., Training Deep Nets with Sublinear Memory Cost, arXiv 1604.06174, 2016"
    defaults = dict(policy="full")
    choices = {"policy": POLICIES}

    def transform_model(self, model):
        kwargs = {"use_reentrant": False}
        if self.hp["policy"] == "selective":
            kwargs["context_fn"] = selective_contexts
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        return model


METHOD = Checkpointing

"""Gradient accumulation: AdamW over N micro-batches per optimizer step.

Each micro-batch's loss is scaled by 1/N and back-propagated; gradients add up in
`p.grad`, and one AdamW step follows. Activations shrink to a micro-batch's; the full
gradient buffer stays alive across micro-batches. The baseline AdamA is measured against.
"""
from bench.method import Method


class GradAccum(Method):
    paper = "standard practice; e.g. Goyal et al., Accurate, Large Minibatch SGD, 2017"
    defaults = dict(micro_batches=4)


METHOD = GradAccum

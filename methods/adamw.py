"""AdamW: the baseline every method is compared against.

Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.
`torch.optim.AdamW`, one optimizer step per batch, no memory reduction: the contract's
defaults are exactly this method.
"""
from bench.method import Method


class AdamW(Method):
    paper = "Loshchilov & Hutter, Decoupled Weight Decay Regularization, ICLR 2019"


METHOD = AdamW

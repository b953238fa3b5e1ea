"""Peer: torchao's 4-bit AdamW (`torchao.optim.AdamW4bit`, torchao 0.18.0).

Li, Chen, Zhu, "Memory Efficient Optimizers with 4-bit States", NeurIPS 2023, as
implemented by torchao: m as 4-bit codes of a dynamic-exponent map, v as 4-bit linear
codes (no zero), two codes per byte, one float32 absmax per block of 128 elements: about
1.06 bytes of state per parameter instead of AdamW's 8. (torchao follows the paper's
block-wise quantisation, not its rank-1 normalisation of v.) How it runs and is counted:
methods/_common/torchao.py.
"""
from methods._common.torchao import TorchaoAdamW


class TorchaoAdamW4bit(TorchaoAdamW):
    optimizer_name = "AdamW4bit"
    paper = ("Li, Chen, Zhu, Memory Efficient Optimizers with 4-bit States, NeurIPS 2023 "
             "(torchao 0.18.0 AdamW4bit)")
    defaults = {**TorchaoAdamW.defaults, "block_size": 128}


METHOD = TorchaoAdamW4bit

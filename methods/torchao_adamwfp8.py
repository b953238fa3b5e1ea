"""Peer: torchao's FP8 AdamW (`torchao.optim.AdamWFp8`, torchao 0.18.0).

m and v as float8_e4m3fn codes with one float32 absmax scale per block of 256 elements
(scaled so the block's largest magnitude maps to e4m3's largest, 448): about 2.03 bytes
of state per parameter, like the 8-bit variant, with a floating-point instead of a
lookup-table code. torchao's own design (no paper of its own). It runs on the CPU too
(float8 is a storage type there; the arithmetic is float32). How it runs and is counted:
methods/_common/torchao.py.
"""
from methods._common.torchao import TorchaoAdamW


class TorchaoAdamWFp8(TorchaoAdamW):
    optimizer_name = "AdamWFp8"
    paper = "torchao 0.18.0 AdamWFp8 (block-wise FP8 E4M3 optimizer states)"
    defaults = {**TorchaoAdamW.defaults, "block_size": 256}


METHOD = TorchaoAdamWFp8

"""Peer: torchao's 8-bit AdamW (`torchao.optim.AdamW8bit`, torchao 0.18.0).

Dettmers, Lewis, Shleifer, Zettlemoyer, "8-bit Optimizers via Block-wise Quantization",
ICLR 2022, as implemented in PyTorch by torchao: m and v as uint8 codes of a dynamic-tree
map with one float32 absmax per block of 256 elements, about 2.03 bytes of state per
parameter instead of AdamW's 8. Beside bitsandbytes' kernel (adamw_8bit) and the suite's
own 8-bit AdamA states (adama_8bit). How it runs and is counted: methods/_common/torchao.py.
"""
from methods._common.torchao import TorchaoAdamW


class TorchaoAdamW8bit(TorchaoAdamW):
    optimizer_name = "AdamW8bit"
    paper = ("Dettmers et al., 8-bit Optimizers via Block-wise Quantization, ICLR 2022 "
             "(torchao 0.18.0 AdamW8bit)")
    defaults = {**TorchaoAdamW.defaults, "block_size": 256}


METHOD = TorchaoAdamW8bit

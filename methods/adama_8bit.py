"""AdamA stacked with 8-bit optimizer states: AdamA's gradient release plus m and v kept
in block-wise 8-bit codes (about 2 bytes per parameter instead of 8 in float32).

The combination the AdamA paper uses to fit larger models (Zhang et al., ECAI 2023,
arXiv 2305.19982, with optimizer-state memory reduction); the quantiser is described in
methods/adama.py.
"""
from methods.adama import AdamA


class AdamA8bit(AdamA):
    shards = False  # not under FSDP2: its 8-bit moments are plain tensors, folded with sharded (DTensor) gradients
    defaults = {**AdamA.defaults, "state_dtype": "int8"}


METHOD = AdamA8bit

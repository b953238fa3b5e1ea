"""Peer: 8-bit AdamW from bitsandbytes (block-wise quantised moments).

Dettmers, Lewis, Shleifer, Zettlemoyer, "8-bit Optimizers via Block-wise Quantization",
ICLR 2022; `bitsandbytes.optim.AdamW8bit` (bitsandbytes 0.50.2, the first release whose
optimizers run on the CPU). m and v are kept as 8-bit codes of a dynamic (tree) map with
one absmax per block of 256 values, about 2 bytes of state per parameter instead of 8.
Tensors smaller than `min_8bit_size` elements keep 32-bit states, as bitsandbytes does.
The comparison row for optimizer-state reduction (MicroAdam, AdamA with 8-bit states).
"""
from bench.method import Method, require_package


class AdamW8bit(Method):
    paper = "Dettmers et al., 8-bit Optimizers via Block-wise Quantization, ICLR 2022 (bitsandbytes)"
    defaults = dict(min_8bit_size=4096)
    simulates = False  # bitsandbytes reads a tensor's value inside its step
    shards = False  # not under FSDP2 (real run): bitsandbytes' 8-bit update takes plain tensors, not DTensors
    peer_of = "adama_8bit"  # the suite's own block-wise 8-bit Adam moments
    package = "bitsandbytes==0.50.2"

    def make_optimizer(self, model):
        bnb = require_package("bitsandbytes", self.package, self.name)
        return bnb.optim.AdamW8bit(model.parameters(), **self.adam_args,
                                   min_8bit_size=self.hp["min_8bit_size"])


METHOD = AdamW8bit

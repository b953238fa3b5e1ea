"""Peer: the authors' CAME package, came-pytorch 0.1.3 (`came_pytorch.CAME`), on our models.

Luo et al., CAME: Confidence-guided Adaptive Memory Efficient Optimization, ACL 2023,
arXiv 2307.02047; PyPI came-pytorch 0.1.3 (yangluo7/CAME, MIT). Every parameter in one
group, with the hyperparameters of methods/came.py (the README's lr 2e-4, weight decay
1e-2, betas (0.9, 0.999, 0.9999), eps (1e-30, 1e-16), clip threshold 1), so the two rows
differ only in the implementation.

What differs from ours (methods/came.py documents the algorithm): for bfloat16/float16
parameters the package keeps its state in float32 (it upcasts the gradient and builds the
state from it), twice ours for the full first moment; and it stores a 0-d tensor `RMS`
(the parameter's RMS, computed every step and never used) per parameter, counted here as
optimizer state because it is one (4 bytes per parameter tensor). Its step reads no
tensor value, so it runs on fake tensors.

Needs `pip install came-pytorch==0.1.3`; without it `make_optimizer` raises a MethodError
naming the package, and the suite records the job with status error.
"""
from __future__ import annotations

from bench.method import Method, require_package
from methods.came import CAME


class CAMEPytorch(Method):
    shards = False  # not under FSDP2: came-pytorch's step mixes plain-tensor state with sharded (DTensor) gradients
    paper = ("came-pytorch 0.1.3 (CAME), Luo et al., CAME: Confidence-guided Adaptive Memory "
             "Efficient Optimization, ACL 2023, arXiv 2307.02047")
    defaults = dict(CAME.defaults)
    ranges = CAME.ranges
    peer_of = "came"
    package = "came-pytorch==0.1.3"

    def make_optimizer(self, model):
        came_pytorch = require_package("came_pytorch", self.package, self.name)
        hp = self.hp
        return came_pytorch.CAME(model.parameters(), lr=hp["lr"], betas=tuple(hp["betas"]),
                                 eps=tuple(hp["eps"]), clip_threshold=hp["clip_threshold"],
                                 weight_decay=hp["weight_decay"])


METHOD = CAMEPytorch

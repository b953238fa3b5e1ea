"""Peer: the authors' APOLLO package, apollo-torch 1.0.3 (`APOLLOAdamW`), on our models.

Zhu et al., APOLLO: SGD-like Memory, AdamW-level Performance, MLSys 2025,
arXiv 2412.05270; PyPI apollo-torch 1.0.3 (zhuhanqing/APOLLO, CC-BY-NC). Parameter groups
as the authors' script: the rest, then the projected weights with `rank`,
`update_proj_gap`, `scale`, `proj_type` "std", `proj` "random", `scale_type`; the
weights, defaults and config overrides are methods/apollo.py's (APOLLO-Mini is the
variant `apollo_torch@rank=1,scale=128,scale_type=tensor`).

Where it differs from ours: it stores the random projection between refreshes (the
projector object's `ortho_matrix`, r x min(m, n), counted here as optimizer state) where
ours regenerates it every step from the seed; after the first refresh period its seeds
come from torch's generator, ours from Python's. Its step reads tensor values (the next
seed with `.tolist()`, the limiter with Python's `max` of a tensor), so it cannot run on
fake tensors: `simulates = False`, and a simulated job fails with the suite's "cannot
run on fake tensors" message.

Needs `pip install apollo-torch==1.0.3` (pure Python; imports transformers and
bitsandbytes, which import on CPU); without it `make_optimizer` raises a MethodError.
"""
from __future__ import annotations

import torch

from bench.method import Method, require_package
from methods._common.lowrank import split_params
from methods.apollo import APOLLO


class APOLLOTorch(Method):
    paper = ("apollo-torch 1.0.3 (APOLLOAdamW), Zhu et al., APOLLO: SGD-like Memory, AdamW-level "
             "Performance, MLSys 2025, arXiv 2412.05270")
    defaults = dict(APOLLO.defaults)
    choices, ranges = APOLLO.choices, APOLLO.ranges
    simulates = False
    shards = False  # not under FSDP2 (real run): its projection, a plain tensor, meets a DTensor gradient
    peer_of = "apollo"
    package = "apollo-torch==1.0.3"

    def make_optimizer(self, model):
        APOLLOAdamW = require_package("apollo_torch", self.package, self.name).APOLLOAdamW
        hp = self.hp
        projected, rest = split_params(model, hp["target_modules"])
        groups = [{"params": rest},
                  {"params": projected, "rank": hp["rank"], "update_proj_gap": hp["update_proj_gap"],
                   "scale": hp["scale"], "proj_type": "std", "proj": "random",
                   "scale_type": hp["scale_type"]}]
        return APOLLOAdamW([g for g in groups if g["params"]], **self.adam_args)

    def state_tensors(self, optimizer):
        out = []
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    out.append(value)
                elif isinstance(getattr(value, "ortho_matrix", None), torch.Tensor):
                    out.append(value.ortho_matrix)
        return out


METHOD = APOLLOTorch

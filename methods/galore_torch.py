"""Peer: the authors' GaLore package, galore-torch 1.0 (`GaLoreAdamW`), on our models.

Zhao et al., ICML 2024, arXiv 2403.03507; PyPI galore-torch 1.0 (jiaweizzhao/GaLore,
Apache-2.0). Parameter groups as its README shows: the non-projected parameters, then
the projected weights with `rank`, `update_proj_gap`, `scale`, `proj_type`. The weights
chosen, the defaults (rank 128, update_proj_gap 200, scale 0.25, proj_type "std",
lr 0.01) and the config overrides are those of methods/galore.py, so the two rows differ
only in the implementation.

Aligned explicitly with ours, where the package's defaults differ: eps is passed as ours
(1e-8; the package's default is 1e-6), and betas and weight decay are passed too;
`no_deprecation_warning=True` silences its FutureWarning. What cannot be aligned by an
argument: it adds eps to sqrt(V) before the bias correction (an effective
eps / sqrt(1 - b2^t)), applies weight decay after the update, always runs the SVD in
float32, and for float32 weights keeps its projector as a view of the SVD's whole U or
V' (min(m, n)^2 elements alive, not r min(m, n)); in bfloat16 the projector is a copy.

Its projector lives in `state["projector"]` (a Python object, not a tensor), so
`state_tensors` adds `projector.ortho_matrix` to the moments.

Needs `pip install galore-torch==1.0`, whose `__init__` imports bitsandbytes (>= 0.50
imports on CPU) and transformers; without them `make_optimizer` raises a MethodError
naming the missing import, and the suite records the job with status error.
"""
from __future__ import annotations

import torch

from bench.method import Method, require_package
from methods._common.lowrank import split_params
from methods.galore import GaLore


class GaLoreTorch(Method):
    paper = ("galore-torch 1.0 (GaLoreAdamW), Zhao et al., GaLore: Memory-Efficient LLM Training "
             "by Gradient Low-Rank Projection, ICML 2024, arXiv 2403.03507")
    defaults = dict(GaLore.defaults)
    choices, ranges = GaLore.choices, GaLore.ranges
    peer_of = "galore"
    package = "galore-torch==1.0"

    def make_optimizer(self, model):
        GaLoreAdamW = require_package("galore_torch", self.package, self.name).GaLoreAdamW
        hp = self.hp
        projected, rest = split_params(model, hp["target_modules"])
        groups = [{"params": rest},
                  {"params": projected, "rank": hp["rank"], "update_proj_gap": hp["update_proj_gap"],
                   "scale": hp["scale"], "proj_type": hp["proj_type"]}]
        return GaLoreAdamW([g for g in groups if g["params"]], **self.adam_args, correct_bias=True,
                           no_deprecation_warning=True)

    def state_tensors(self, optimizer):
        out = []
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    out.append(value)
                elif hasattr(value, "ortho_matrix"):  # its GaLoreProjector
                    matrix = value.ortho_matrix
                    out.extend(matrix if isinstance(matrix, (list, tuple)) else
                               [matrix] if matrix is not None else [])
        return out


METHOD = GaLoreTorch

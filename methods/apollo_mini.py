"""APOLLO-Mini: APOLLO (methods/apollo.py) with a rank-1 projection and one tensor-wise
scaling factor per weight; state 2 max(m, n) + 1 elements per m x n weight.

Zhu et al., "APOLLO: SGD-like Memory, AdamW-level Performance", MLSys 2025,
arXiv 2412.05270, APOLLO-Mini: rank 1, s = ||R~|| / ||R||, and the update scaled by
sqrt(128) (the authors' scripts: `--rank 1 --scale_type tensor --apollo_scale 128`,
lr 0.01, T = 200). Everything else, and the code, is methods/apollo.py.
"""
from __future__ import annotations

from methods.apollo import APOLLO


class APOLLOMini(APOLLO):
    paper = ("Zhu et al., APOLLO: SGD-like Memory, AdamW-level Performance, MLSys 2025, "
             "arXiv 2412.05270 (APOLLO-Mini)")
    defaults = dict(APOLLO.defaults, rank=1, scale=128.0, scale_type="tensor")


METHOD = APOLLOMini

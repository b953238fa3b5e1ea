"""Approx-BP and MS-BP: low-memory activations and norms for fine-tuning.

Yang, Shi, Wang, Zhen, Shi, Xu, "Reducing Fine-Tuning Memory Overhead by Approximate and
Memory-Sharing Backpropagation", ICML 2024, arXiv 2406.16282 (code: yyyyychen/LowMemoryBP,
CUDA only). Pure PyTorch here, in two parts:

    activations.py   Approx-BP: GELU -> ReGELU2, SiLU -> ReSiLU2. Forward unchanged; the
                     backward uses the derivative of a sum of three shifted ReLUs, a
                     4-level step function, so each element keeps a 2-bit code (bit-packed)
                     instead of its input.
    norms.py         MS-BP: LayerNorm / RMSNorm that keep their output (shared with the
                     next layer, which keeps it anyway) instead of their input
                     (`norms.swap_norms(model) -> dict`; written beside this file).

    Saving per replaced activation of n elements, e bytes each: n (e - 2/8) where the
    input was saved only for the activation (GPT-2's Python GELU saved 4 tensors:
    n (4e - 2/8)); see methods/fewbit for where each model's activation sits.

`activations` and `norms` (both default True) switch the parts; `report` says what each
replaced.
"""
from __future__ import annotations

import importlib
import importlib.util

from torch import nn

from bench.method import Method

from .activations import swap_activations_approx


def _swap_norms():
    """norms.swap_norms if that module exists and defines it, else None."""
    if importlib.util.find_spec(f"{__name__}.norms") is None:
        return None
    return getattr(importlib.import_module(f"{__name__}.norms"), "swap_norms", None)


class ApproxBP(Method):
    paper = ("Yang, Shi, Wang, Zhen, Shi, Xu, Reducing Fine-Tuning Memory Overhead by Approximate "
             "and Memory-Sharing Backpropagation, ICML 2024")
    defaults = dict(activations=True, norms=True)
    # fewbit replaces the same activations; Tempo the same norms (and keeps their outputs too)
    incompatible = frozenset({"fewbit", "tempo"})

    def transform_model(self, model: nn.Module) -> nn.Module:
        report = {}
        if self.hp["activations"]:
            report["activations"] = swap_activations_approx(model)
        if self.hp["norms"]:
            swap = _swap_norms()
            report["norms"] = swap(model) if swap else "not replaced: methods/approx_bp/norms.py has no swap_norms"
        self.report = report
        return model


METHOD = ApproxBP

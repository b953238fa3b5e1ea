"""Approx-BP's activations: ReGELU2 and ReSiLU2 (exact forward, a 2-bit step derivative).

Yang, Shi, Wang, Zhen, Shi, Xu, "Reducing Fine-Tuning Memory Overhead by Approximate and
Memory-Sharing Backpropagation", ICML 2024, arXiv 2406.16282 (code: yyyyychen/LowMemoryBP,
package `lomem`, CUDA only). Pure PyTorch here, through the same layer as `fewbit`
(`methods._common.step_activation`): only the table differs.

The paper's Approx-BP theory lets the backward use the derivative of a different
primitive h~ than the forward's f. For GELU and SiLU it picks h~ as a sum of 2^k - 1
shifted ReLUs (k = 2):

    h~(x) = sum_{i=1}^{3} a_i max(x - c_i, 0),   sum_i a_i = 1,  sum_i a_i c_i = 0
    forward   y = f(x)                           (GELU: the erf form; SiLU)
    saved     code = #{i : x > c_i}              2 bits per element
    backward  dL/dx = h~'(x) dL/dy = (sum_{i <= code} a_i) dL/dy

(a, c) minimise the L2 distance integral (f - h~)^2 dx between the primitives (not the
derivatives: so these are not Few-Bit's optimal 2-bit derivative tables; the official
repository's search_act/README.md states the objective and the parametrisation). The
values below are the official implementation's, float literals copied as numbers from
yyyyychen/LowMemoryBP at commit bb2980f (2024-12-11):
    lomem/csrc/regelu2_cuda.cu   ReGELU2_a, ReGELU2_c
    lomem/csrc/resilu2_cuda.cu   ReSiLU2_a, ReSiLU2_c
Their kernels compare x > c_i in float32 and store the 2-bit codes four per byte, little
endian; we store them the same way (`methods._common.bitpack`) but compare in the input's
dtype (c_i rounded to bfloat16 for a bfloat16 input).

GPT-2's GELU is the tanh approximation (transformers' NewGELUActivation): its forward
stays as it is and ReGELU2's derivative is used for it (the two GELUs differ by at most
4.7e-4, their derivatives by 9e-4, far below ReGELU2's own step error).
"""
from __future__ import annotations

from torch import nn

from methods._common.step_activation import StepDerivativeActivation, swap_activations

REGELU2_A = (-0.04922261145617846, 1.0979632065417297, -0.048740595085551286)
REGELU2_C = (-3.1858810036855245, -0.001178821281161997, 3.190832613414926)
RESILU2_A = (-0.04060357190528599, 1.080925428529668, -0.040321856624382146)
RESILU2_C = (-6.3050461001646445, -0.0008684942046214787, 6.325815242089708)


def step_table(a, c) -> tuple[list[float], list[float]]:
    """(borders, levels) of h~' for h~ = sum a_i max(x - c_i, 0): borders c (ascending),
    levels the partial sums 0, a_1, a_1 + a_2, a_1 + a_2 + a_3."""
    levels, total = [0.0], 0.0
    for a_i in a:
        total += a_i
        levels.append(total)
    return list(c), levels


TABLES = {
    "regelu2": step_table(REGELU2_A, REGELU2_C),
    "resilu2": step_table(RESILU2_A, RESILU2_C),
}
# derivative name (methods._common.step_activation.derivative_name) -> Approx-BP's replacement
REPLACEMENT = {"gelu": "regelu2", "gelu_tanh": "regelu2", "silu": "resilu2"}
BITS = 2


def table_for(name: str):
    which = REPLACEMENT.get(name)
    if which is None:
        return None
    borders, levels = TABLES[which]
    return borders, levels, BITS


def swap_activations_approx(model: nn.Module) -> dict:
    """Replace GELUs by ReGELU2 and SiLUs by ReSiLU2; returns what was replaced."""
    found = swap_activations(model, table_for)
    kinds = {}
    for m in model.modules():
        if isinstance(m, StepDerivativeActivation):
            which = REPLACEMENT[m.name]
            kinds[f"{m.replaces} -> {which}"] = kinds.get(f"{m.replaces} -> {which}", 0) + 1
    report = {"replaced": kinds or "none replaced"}
    if found["left"]:
        report["left"] = found["left"]
    return report


class ReGELU2(StepDerivativeActivation):
    """GELU (erf) forward, ReGELU2's 2-bit step derivative backward."""

    def __init__(self):
        import torch.nn.functional as F

        super().__init__(F.gelu, *TABLES["regelu2"], BITS, name="gelu", replaces="GELU")


class ReSiLU2(StepDerivativeActivation):
    """SiLU forward, ReSiLU2's 2-bit step derivative backward."""

    def __init__(self):
        import torch.nn.functional as F

        super().__init__(F.silu, *TABLES["resilu2"], BITS, name="silu", replaces="SiLU")

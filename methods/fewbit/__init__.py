"""Few-Bit Backward: keep a b-bit code of each activation input instead of the input.

Novikov, Bershatsky, Gusak, Shonenkov, Dimitrov, Oseledets, "Few-Bit Backward: Quantized
Gradients of Activation Functions for Memory Footprint Reduction", ICML 2022, arXiv
2202.00441 (code: SkoltechAI/fewbit, CUDA/C++ with a Python fallback that keeps one byte
a code). Our own pure-PyTorch implementation (CPU, CUDA, fake tensors), codes bit-packed.

For a pointwise y = f(x), backward needs only f'(x). Replace f' by the step function q
that minimises the weighted L2 error (section 3 of the paper):

    minimise  integral (f'(x) - q(x))^2 w(x) dx,    q(x) = l_k on (x_k, x_{k+1}]
    borders   x_1 < ... < x_{2^b - 1}               (x_0 = L, x_{2^b} = R)
    levels    l_k = integral f' w / integral w over (x_k, x_{k+1}]      (the best levels)
    borders   solved globally by dynamic programming on a fine grid (tables.py)

    forward   y = f(x)                                     unchanged, the layer's own code
              c = #{k : x_k < x} in 0 .. 2^b - 1           saved, b bits per element
    backward  dL/dx = l_c * dL/dy

`bits` (default 3, the paper's) sets b; `weight` ("uniform", "normal", "normal:<sigma>")
and `interval` (default [-100, 100] with w = 1, the library's setting) choose the
tables. Step derivatives (ReLU, LeakyReLU) are exact at 1 bit and always use 1 bit.

Memory per replaced layer of n elements, e bytes each: the input (n e bytes) is no
longer saved, n b / 8 bytes of codes are. Where the input was saved only by the
activation (the next Linear saves the output), the activation memory drops by
n (e - b/8): GPT-2's MLP GELU (`mlp.act`, transformers' NewGELUActivation, written out in
Python: it saves four tensors of n elements, so n (4e - b/8)), BERT's
`intermediate.intermediate_act_fn` (GELUActivation, F.gelu: n (e - b/8)); LLaMA's SwiGLU
`mlp.act_fn` (SiLU): the product act(gate) * up saves act(gate) and up, not the gate,
so the gate's n e bytes are freed too: n (e - b/8). The forward is the replaced layer
itself (GPT-2 keeps its tanh approximation; its table is then gelu_tanh's).
"""
from __future__ import annotations

from torch import nn

from bench.method import Method

from methods._common.step_activation import StepDerivativeActivation, swap_activations

from . import tables


class FewBit(Method):
    paper = ("Novikov, Bershatsky, Gusak, Shonenkov, Dimitrov, Oseledets, Few-Bit Backward: "
             "Quantized Gradients of Activation Functions for Memory Footprint Reduction, ICML 2022")
    defaults = dict(bits=3, weight="uniform", interval=list(tables.INTERVAL))
    ranges = {"bits": "[1, 8]"}
    incompatible = frozenset({"approx_bp"})  # it replaces the same activations

    def table_for(self, name: str):
        bits = 1 if name in tables.STEPWISE else int(self.hp["bits"])
        if name not in tables.ACTIVATIONS:
            return None
        borders, levels = tables.table(name, bits, self.hp["weight"], tuple(self.hp["interval"]))
        return borders, levels, bits

    def transform_model(self, model: nn.Module) -> nn.Module:
        found = swap_activations(model, self.table_for)
        used = {m.name: m for m in model.modules() if isinstance(m, StepDerivativeActivation)}
        self.report = {
            "activations": found["replaced"] or "none replaced",
            **({"left": found["left"]} if found["left"] else {}),
            "bits": int(self.hp["bits"]),
            "saved_per_element": f"{int(self.hp['bits'])}/8 byte (bit-packed codes)",
            "tables": {name: {"borders": list(m.borders), "levels": list(m.levels)}
                       for name, m in sorted(used.items())},
        }
        return model


METHOD = FewBit

"""8-bit GaLore: GaLore (methods/galore.py) with Adam's moments kept as 8-bit block-wise
codes, about 1 byte an element instead of the parameter's 2 or 4.

Zhao et al., ICML 2024, arXiv 2403.03507: "8-bit GaLore", the variant of the paper's 7B
runs (galore-torch's `GaLoreAdamW8bit`: bitsandbytes' 8-bit AdamW run on the projected
gradient). The update is galore.py's Algorithm 1 (same defaults, same projected weights,
same projector); only the moments' storage differs:

    M~, V~ <- decode(M), decode(V)                    (float32)
    M' <- b1 M~ + (1 - b1) R ;  V' <- b2 V~ + (1 - b2) R^2
    N  <- (M' / (1 - b1^t)) / (sqrt(V' / (1 - b2^t)) + eps)    (from M', V' as computed)
    W  <- W - lr wd W ;  W <- W - lr alpha P N         (N cast to W's dtype, then P N)
    M, V <- encode(M'), encode(V')

encode/decode (methods/_common/quant8.py): blocks of 256 consecutive elements, one
float32 absmax each; M on bitsandbytes' signed dynamic map, V itself on its unsigned one
(`create_dynamic_map`), each element rounded to the nearest code, a negative M never to
0: what bitsandbytes' 8-bit blockwise Adam kernel does (block size 256, its
`Optimizer2State` maps "dynamic" and "udynamic"). The update uses M' and V' before they
are rounded, as that kernel does: in float32 the first step is galore.py's, bit for bit.

Which states are 8-bit: every Adam state with at least `min_8bit_size` elements (4096,
bitsandbytes' default), i.e. a projected weight's M and V and also a plain parameter's m
and v (embeddings, LM head, norms): GaLoreAdamW8bit is bitsandbytes' AdamW8bit for every
parameter, so it quantizes those too. A smaller state keeps galore.py's update and dtype
(the parameter's; bitsandbytes keeps float32 there). At LLaMA-7B every state is 8-bit
(the smallest, a norm weight, has 4096 elements).

Optimizer-state bytes: per 8-bit state of N elements, N + 4 ceil(N / 256), two per
parameter; a projected weight adds its projector (r min(m, n) elements, parameter's
dtype); the two code maps and their midpoints, 4 (256 + 255) bytes each, once per device.

What rounding does to the update: V holds squares, so an element whose gradients are
below about 4e-4 of its block's largest has V under 1.6e-7 of the block's absmax, which
decodes to 0 (the unsigned map's smallest code is 3.25e-7), while its M, about 4e-4 of
its absmax, keeps a code; if that element's gradient is then 0, its step is M / eps. On
the tiny models (width 128) a block spans two embedding rows, so a rare token's row can
sit beside a frequent one's, and when the rare token is absent from a batch its row
takes such steps (seen on llama-tiny: 8-bit GaLore's embedding moved by tens in three
steps, 32-bit GaLore's by 0.03). bitsandbytes' answer is its StableEmbedding (32-bit
state for the embedding); at LLaMA-7B's width (4096) a block lies inside one row.
bitsandbytes' CPU library does not show it: its 65536-bin table rounds values below
about 1.5e-5 of the absmax, zero included, to a code near 1.5e-5, never to 0.

The update runs over whole blocks in chunks (at most 64 of at least 2^22 elements), so its
float32 temporaries stay small (16 MiB each; the fused CUDA kernel keeps them in
registers): in one piece the LM head's of LLaMA-7B would be 0.5 GiB each. No tensor value
is read on the Python side, so it simulates (fake tensors).

Where it differs from GaLoreAdamW8bit (bitsandbytes on CUDA): weight decay is applied
before the update (galore.py's; GaLoreAdamW8bit decays a projected weight after projecting
back, and the kernel decays the others after the update); eps is added after the bias
correction, as both bitsandbytes' 8-bit kernels do (not galore-torch's 32-bit AdamW);
no skipping of non-finite gradient elements; GaLoreAdamW8bit also copies each projected
weight per step (`p.saved_data = p.data.clone()`), a transient it has and this has not.
"""
from __future__ import annotations

import math

import torch

from methods._common.chunks import chunk_size
from methods._common.quant8 import BLOCK, CodeMap, Quantized8bit
from methods.galore import GaLore, GaLoreAdamW, param_groups, state_shape

MIN_8BIT_SIZE = 4096  # bitsandbytes' min_8bit_size: smaller states are not quantized
CHUNK_LEAST, CHUNK_PIECES = 2**22, 64  # elements per chunk of the update, at most chunks


class GaLoreAdamW8bit(GaLoreAdamW):
    """GaLoreAdamW whose Adam states of at least `min_8bit_size` elements are 8-bit
    (`exp_avg`, `exp_avg_sq`: `Quantized8bit`); `state_tensors()` lists what it keeps."""

    def __init__(self, params, min_8bit_size: int = MIN_8BIT_SIZE, **kwargs):
        self.min_8bit_size = min_8bit_size
        self._maps: dict[str, tuple[CodeMap, CodeMap]] = {}  # device -> (signed, unsigned)
        super().__init__(params, **kwargs)

    def _maps_on(self, device) -> tuple[CodeMap, CodeMap]:
        key = str(device)
        if key not in self._maps:
            self._maps[key] = (CodeMap(True, device), CodeMap(False, device))
        return self._maps[key]

    def _update(self, p: torch.Tensor, group: dict) -> None:
        projected = group["rank"] is not None
        shape = state_shape(p.shape, group["rank"], group["proj_type"]) if projected else p.shape
        if math.prod(shape) < self.min_8bit_size:
            return super()._update(p, group)  # galore.py's update, states in p's dtype
        g = p.grad
        state = self.state[p]
        if not state:
            signed, unsigned = self._maps_on(p.device)
            state["step"] = 0
            state["exp_avg"] = Quantized8bit(shape, p.device, "dynamic", signed, padded=False)
            state["exp_avg_sq"] = Quantized8bit(shape, p.device, "udynamic", unsigned, padded=False)
        t = state["step"]
        if projected:
            if t % group["update_proj_gap"] == 0:
                self._refresh_projector(state, g, group)
            r = self._project(state, g)
        else:
            r = g
        t += 1
        state["step"] = t
        beta1, beta2 = group["betas"]
        lr, eps = group["lr"], group["eps"]
        root2 = math.sqrt(1 - beta2 ** t)
        if group["weight_decay"]:
            p.mul_(1 - lr * group["weight_decay"])
        work = torch.promote_types(p.dtype, torch.float32)  # float32, float64 for float64
        m_q, v_q = state["exp_avg"], state["exp_avg_sq"]
        flat_r = r.reshape(-1)
        n = torch.empty(shape, dtype=p.dtype, device=p.device) if projected else None
        target = (n if projected else p).view(-1)  # the normalised update, or p itself
        numel = flat_r.numel()
        size = chunk_size(numel, CHUNK_LEAST, CHUNK_PIECES, BLOCK)
        for start in range(0, numel, size):
            stop = min(numel, start + size)
            x = flat_r[start:stop].to(work)
            m = m_q.decode(start, stop).to(work)
            v = v_q.decode(start, stop).to(work)
            m.lerp_(x, 1 - beta1)
            v.mul_(beta2).addcmul_(x, x, value=1 - beta2)
            denom = (v.sqrt() / root2).add_(eps)
            if projected:
                target[start:stop].copy_(m / denom)
            else:
                target[start:stop].addcdiv_(m, denom, value=-lr / (1 - beta1 ** t))
            m_q.encode(m, start)
            v_q.encode(v, start)
        if projected:
            p.add_(self._project_back(state, n), alpha=-lr * group["scale"] / (1 - beta1 ** t))

    def state_tensors(self) -> list[torch.Tensor]:
        out = []
        for state in self.state.values():
            for value in state.values():
                if isinstance(value, Quantized8bit):
                    out.extend(value.tensors())
                elif isinstance(value, torch.Tensor):
                    out.append(value)
        for maps in self._maps.values():
            for code in maps:
                out.extend(code.tensors())
        return out


class GaLore8bit(GaLore):
    defaults = {**GaLore.defaults, "min_8bit_size": MIN_8BIT_SIZE}
    ranges = {**GaLore.ranges, "min_8bit_size": "[0, inf)"}

    def make_optimizer(self, model):
        return GaLoreAdamW8bit(param_groups(model, self.hp), min_8bit_size=self.hp["min_8bit_size"],
                               **self.adam_args)

    def state_tensors(self, optimizer):
        return optimizer.state_tensors()


METHOD = GaLore8bit

"""MicroAdam: Adam rebuilt each step from a window of m sparse gradients, with 4-bit
error feedback; about 0.9 bytes of optimizer state per parameter instead of 8.

Modoranu, Safaryan, Malinovsky, Kurtic, Robert, Richtarik, Alistarh, "MicroAdam: Accurate
Adaptive Optimization with Low Space Overhead and Provable Convergence", NeurIPS 2024,
arXiv 2405.15593. The official code (IST-DASLab/MicroAdam, package
ista-daslab-optimizers) is CUDA-only and bf16-only; this is our own pure-PyTorch
implementation of its algorithm. It runs on any device and on fake tensors, for float32,
bfloat16 (and float64) parameters.

Algorithm 1, per parameter tensor of d elements, flattened; step t = 1, 2, ...:

    a   <- g_t + Q^-1(e_t)                         add the dequantised error feedback
    I_t <- TopK(|a|) in each top-k block           ceil(k * size) per block of
                                                   `topk_block` elements (the last block
                                                   may be shorter)
    V_t <- a[I_t]                                  signed values
    (I, V)[(t-1) mod m] <- (I_t, V_t)              ring buffer of the last m sparse gradients
    a[I_t] <- 0
    e_{t+1} <- Q(a)                                4-bit error feedback: what top-k dropped
    theta <- theta (1 - lr wd)                     decoupled weight decay
    M <- sum over the window's rows r:  beta1^age(r) V_r  scattered at I_r
    S <- sum over the window's rows r:  beta2^age(r) V_r^2 scattered at I_r
         age(r) = (t - 1 - r) mod m, rows r < min(t, m)
    u <- c1 M / (sqrt(c2 S) + eps),   c1 = (1-beta1)/(1-beta1^t),  c2 = (1-beta2)/(1-beta2^t)
    if 0 < alpha < 1:                              densification ("for pre-training")
        u <- u + alpha Q^-1(e_{t+1});   e_{t+1} <- Q((1 - alpha) Q^-1(e_{t+1}))
    theta <- theta - lr u

Adam's moments are never stored: M and S are rebuilt each step from the window, so with
k = 100% and m >= t this is exactly Adam (c1 M and c2 S are Adam's bias-corrected m and v);
with a finite window they are Adam's sums truncated to the last m gradients. With
alpha = 0 the update is non-zero on at most m k d coordinates (the union of the window's
top-k sets); the error feedback carries the rest into later steps.

The quantiser Q is asymmetric, 4 bits, per block of `quant_block` elements:

    lo, hi = min, max of the block                stored in bfloat16, rounded outwards
    step   = (hi - lo) / 15                       (1 for a constant block: no 0/0)
    code   = clamp(floor((x - lo) / step + 1/2), 0, 15)      two codes per byte
    Q^-1   = code * step + lo                     |Q^-1(Q(x)) - x| <= step / 2

Rounding lo down and hi up to bfloat16 (the paper's dtype for them) keeps every x of the
block inside [lo, hi], so the half-step bound holds for the stored, rounded values.

State per parameter tensor (`state_bytes` below is the exact count):

    I      (m, K) int16      top-k indices, relative to their top-k block     2 m K bytes
    V      (m, K) bfloat16   top-k values                                     2 m K bytes
    error  ceil(d/2) uint8   4-bit error feedback, two codes per byte         d/2 bytes
    lo, hi ceil(d/q) bf16    per quantisation block                           4 d/q bytes
    step   Python int        (no tensor, like the ring position (step-1) mod m)

K = k d up to rounding, so bytes = (0.5 + 4 m k) d + 4 ceil(d/q): 0.9 bytes per parameter
plus 4/q for m = 10, k = 1% (0.916 with the defaults below), whatever the parameter
dtype: values are stored in bfloat16 and indices in int16 as in the paper, also for
float32 parameters (the arithmetic runs in float32; float64 for float64 parameters).

Choices where the paper leaves freedom:
- `topk_block` = 4096. The official code sizes it from the GPU's shared memory (about
  20K elements on an A100). It must stay below 32768 so that indices fit int16. 4096
  splits the tiny models' weight matrices (16K-65K elements, all multiples of 4096) into
  several blocks, so the selection is spread over each matrix, and is small beside the
  large models' matrices (a tail block is at most 0.1% of a 4M-element matrix);
  ceil(0.01 * 4096) = 41 keeps k within 0.1% of 1%. Tensors smaller than a block
  (biases, norms) are one block: a 128-element bias keeps ceil(1.28) = 2 values.
- `quant_block` = 256. The paper's scripts use 64 (Llama-2-7B) to 100000 (README). 256
  costs 4/256 = 0.016 bytes per parameter for lo and hi (under 2% of the 0.9) while each
  block is still local (a fraction of a row of the large models, two rows of the tiny
  ones); it divides 4096, so quantisation blocks nest inside top-k blocks.

Transient memory: the step handles one tensor at a time in float32 (a, |a| for top-k, the
dense M and S), about 12.5 bytes per element of the tensor being updated (17.5 with
alpha), all freed before the next tensor; the official CUDA kernels work in place in the
bf16 gradient instead.

Differences from the official code, none of which changes the algorithm: the gradient is
not used as scratch space (`p.grad` is left intact); lo and hi have ceil(d/q) entries
(the official code allocates one more); the step count and bias correction are per
tensor (the same as its global count when every parameter gets a gradient each step);
the alpha = -2 variant ("quant-error densification") is not implemented. Like the
official code, and unlike the paper's analysis, v takes no AMSGrad-style maximum.
"""
from __future__ import annotations

import math

import torch

from bench.method import Method, MethodError
from methods._common.optim import PerParameterOptimizer

INDEX_LIMIT = 32768  # top-k indices are int16, relative to their block: block < 32768
LEVELS = 15  # 4-bit codes 0..15
_LOW16 = 0xFFFF
_HIGH16 = -65536  # int32 0xFFFF0000: the bits a bfloat16 keeps of a float32


# -- sizes and the memory formula -----------------------------------------------------------
def _ceil_frac(n: int, k: float) -> int:
    """ceil(k n) as a whole number of elements, at least 1 for a non-empty block
    (rounded first, so 0.07 * 100 is 7, not 8)."""
    return max(1, math.ceil(round(n * k, 9))) if n else 0


def topk_layout(numel: int, k: float, block: int) -> tuple[int, int, int, int]:
    """(full blocks, top-k per full block, tail size, top-k of the tail) for a tensor."""
    full, tail = divmod(numel, block)
    return full, _ceil_frac(block, k), tail, _ceil_frac(tail, k)


def kept_per_step(numel: int, k: float, block: int) -> int:
    """K: how many (index, value) pairs one step adds to the window."""
    full, k_full, _, k_tail = topk_layout(numel, k, block)
    return full * k_full + k_tail


def state_bytes(numel: int, m: int = 10, k: float = 0.01, topk_block: int = 4096,
                quant_block: int = 256) -> int:
    """Exact persistent state of one tensor: int16 indices and bfloat16 values of the
    window (4 m K), 4-bit error codes (ceil(d/2)), bfloat16 lo and hi per quantisation
    block (4 ceil(d/q)). About (0.5 + 4 m k) d + 4 d / q."""
    return (4 * m * kept_per_step(numel, k, topk_block) + -(-numel // 2)
            + 4 * -(-numel // quant_block))


def ideal_state_bytes(numel: int, m: int = 10, k: float = 0.01, quant_block: int = 256) -> float:
    """The paper's formula, (0.5 + 4 m k) d, plus the per-block lo and hi (no rounding)."""
    return (0.5 + 4 * m * k) * numel + 4 * numel / quant_block


# -- the 4-bit quantiser ---------------------------------------------------------------------
def _outward_bf16(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 lo rounded down and hi rounded up to bfloat16 (bit masks: exact, on any
    device and on fake tensors). Clearing the low 16 bits rounds the magnitude down;
    adding 0xFFFF first rounds it up."""
    lb, hb = lo.contiguous().view(torch.int32), hi.contiguous().view(torch.int32)
    lo_bits = torch.where(lo >= 0, lb & _HIGH16, (lb + _LOW16) & _HIGH16)
    hi_bits = torch.where(hi >= 0, (hb + _LOW16) & _HIGH16, hb & _HIGH16)
    return (lo_bits.view(torch.float32).to(torch.bfloat16),
            hi_bits.view(torch.float32).to(torch.bfloat16))


def quant_step(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """(hi - lo) / 15 in float32; 1 where the block is constant (any step decodes it)."""
    step = (hi.float() - lo.float()) / LEVELS
    return torch.where(step > 0, step, torch.ones_like(step))


def quantise(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q(x) of a 1-D tensor: (codes: ceil(d/2) uint8, lo: ceil(d/block) bf16, hi: same)."""
    x = x.float()
    d = x.numel()
    blocks = -(-d // block)
    pad = blocks * block - d
    if pad:  # repeat the last element: the last block's min and max stay its own
        x = torch.cat([x, x[-1:].expand(pad)])
    xb = x.view(blocks, block)
    lo, hi = _outward_bf16(xb.amin(dim=1), xb.amax(dim=1))
    step = quant_step(lo, hi)[:, None]
    codes = (xb - lo.float()[:, None]).div_(step).add_(0.5).floor_().clamp_(0, LEVELS)
    codes = codes.to(torch.uint8).flatten()
    even = d + (d & 1)
    codes = codes[:even] if codes.numel() >= even else torch.cat([codes, codes.new_zeros(1)])
    return codes[0::2] | (codes[1::2] << 4), lo, hi


def dequantise(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, numel: int,
               block: int) -> torch.Tensor:
    """Q^-1: the float32 values of `numel` elements quantised by `quantise`."""
    blocks = lo.numel()
    c = torch.stack([codes & 15, codes >> 4], dim=1).flatten()
    full = blocks * block
    c = c[:full] if c.numel() >= full else torch.cat([c, c.new_zeros(full - c.numel())])
    x = c.view(blocks, block).float().mul_(quant_step(lo, hi)[:, None]).add_(lo.float()[:, None])
    return x.flatten()[:numel]


# -- the optimizer -----------------------------------------------------------------------------
class MicroAdamOptimizer(PerParameterOptimizer):
    """MicroAdam (Algorithm 1 of the paper, as in the module docstring).

    `m`: window length (sparse gradients kept); `k`: density of top-k (fraction of each
    block); `alpha`: densification, 0 (off) or 0 < alpha < 1; `topk_block` and
    `quant_block`: block sizes of the top-k selection and of the 4-bit error quantiser.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 m=10, k=0.01, alpha=0.0, topk_block=4096, quant_block=256):
        # the values allowed: MicroAdam.ranges
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.m, self.k, self.alpha = m, k, alpha
        self.topk_block, self.quant_block = topk_block, quant_block

    # -- state -------------------------------------------------------------------------------
    def _init_state(self, p: torch.Tensor) -> dict:
        d = p.numel()
        kept = kept_per_step(d, self.k, self.topk_block)
        blocks = -(-d // self.quant_block)
        state = self.state[p]
        state["step"] = 0  # a Python int: nothing to read back, on real or fake tensors
        state["I"] = torch.zeros(self.m, kept, dtype=torch.int16, device=p.device)
        state["V"] = torch.zeros(self.m, kept, dtype=torch.bfloat16, device=p.device)
        state["error"] = torch.zeros(-(-d // 2), dtype=torch.uint8, device=p.device)
        state["error_lo"] = torch.zeros(blocks, dtype=torch.bfloat16, device=p.device)
        state["error_hi"] = torch.zeros(blocks, dtype=torch.bfloat16, device=p.device)
        return state

    def _offsets(self, p: torch.Tensor) -> torch.Tensor:
        """Start of each stored index's top-k block: local index + offset = flat index."""
        _, k_full, _, _ = topk_layout(p.numel(), self.k, self.topk_block)
        kept = self.state[p]["I"].shape[1]
        return torch.arange(kept, device=p.device).div_(k_full, rounding_mode="floor") * self.topk_block

    def error_feedback(self, p: torch.Tensor) -> torch.Tensor:
        """Q^-1(e): the dequantised error feedback of `p` (float32, p's shape)."""
        s = self.state[p]
        return dequantise(s["error"], s["error_lo"], s["error_hi"], p.numel(),
                          self.quant_block).view(p.shape)

    def window(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stored rows: (flat indices (n, K) int64, values (n, K) bf16, ages (n,))."""
        s = self.state[p]
        t = s["step"]
        n = min(t, self.m)
        ages = (((t - 1) % self.m) - torch.arange(n, device=p.device)) % self.m
        return s["I"][:n].long() + self._offsets(p), s["V"][:n], ages

    def _store_error(self, state: dict, x: torch.Tensor) -> None:
        codes, lo, hi = quantise(x, self.quant_block)
        state["error"].copy_(codes)
        state["error_lo"].copy_(lo)
        state["error_hi"].copy_(hi)

    # -- the update of one parameter (step() runs it for each) ---------------------------------
    def _update(self, p: torch.Tensor, group: dict) -> None:
        if p.grad.is_sparse:
            raise MethodError("microadam does not support sparse gradients")
        state = self.state[p] or self._init_state(p)
        state["step"] += 1
        t, m, d = state["step"], self.m, p.numel()
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        work = torch.float64 if p.dtype == torch.float64 else torch.float32

        # a = g + Q^-1(e_t)
        a = self.error_feedback(p).flatten().to(work)
        a.add_(p.grad.reshape(-1))

        # top-k per block of |a|: int16 indices relative to the block, bf16 values
        full, k_full, tail, k_tail = topk_layout(d, self.k, self.topk_block)
        local = []
        if full:
            head = a[: full * self.topk_block].view(full, self.topk_block)
            local.append(head.abs().topk(k_full, dim=1, sorted=False).indices.flatten())
        if tail:
            local.append(a[full * self.topk_block:].abs().topk(k_tail, sorted=False).indices)
        local = torch.cat(local) if len(local) > 1 else local[0]
        flat = local + self._offsets(p)
        row = (t - 1) % m
        state["I"][row].copy_(local)
        state["V"][row].copy_(a[flat])

        # e_{t+1} = Q(a with the selected coordinates zeroed)
        a.index_fill_(0, flat, 0)
        self._store_error(state, a)
        del a

        if wd:
            p.mul_(1 - lr * wd)

        # moments rebuilt from the window: beta^age-weighted sums, Adam's bias correction
        idx, values, ages = self.window(p)
        values = values.to(work)
        ages = ages.to(work)
        idx = idx.flatten()
        moment1 = torch.zeros(d, dtype=work, device=p.device)
        moment1.index_add_(0, idx, (values * torch.pow(beta1, ages)[:, None]).flatten())
        moment2 = torch.zeros(d, dtype=work, device=p.device)
        moment2.index_add_(0, idx, (values.square_() * torch.pow(beta2, ages)[:, None]).flatten())
        c1 = (1 - beta1) / (1 - beta1 ** t)
        c2 = (1 - beta2) / (1 - beta2 ** t)
        update = moment1.mul_(c1).div_(moment2.mul_(c2).sqrt_().add_(eps))
        del moment2

        if self.alpha > 0:  # densify with alpha of the error feedback; keep 1 - alpha of it
            e = self.error_feedback(p).flatten()
            update.add_(e.to(work), alpha=self.alpha)
            self._store_error(state, e.mul_(1 - self.alpha))

        p.add_(update.view(p.shape), alpha=-lr)  # in the working precision, rounded once to p's


class MicroAdam(Method):
    shards = False  # not under FSDP2: its sparse gradient window is a plain tensor added to sharded (DTensor) gradients
    paper = ("Modoranu et al., MicroAdam: Accurate Adaptive Optimization with Low Space Overhead "
             "and Provable Convergence, NeurIPS 2024, arXiv 2405.15593")
    defaults = dict(m=10, k=0.01, alpha=0.0, topk_block=4096, quant_block=256)
    # m: window length; k: top-k density; alpha: densification, 0 (off) or below 1;
    # topk_block: indices within a block must fit int16
    ranges = {"m": "[1, inf)", "k": "(0, 1]", "alpha": "[0, 1)",
              "topk_block": f"[1, {INDEX_LIMIT})", "quant_block": "[1, inf)"}

    def make_optimizer(self, model):
        hp = self.hp
        return MicroAdamOptimizer(model.parameters(), **self.adam_args, m=hp["m"], k=hp["k"],
                                  alpha=hp["alpha"], topk_block=hp["topk_block"],
                                  quant_block=hp["quant_block"])

    # state_tensors: the default (every tensor in optimizer.state) is exactly I, V, error,
    # error_lo and error_hi; the step count is a Python int.


METHOD = MicroAdam

"""AdamA: Adam accumulation, which releases each gradient during backward.

Zhang, Han, Cao, Dai, Miao, Cao, Yang, Xu, "Adam Accumulation to Reduce Memory Footprints
of both Activations and Gradients for Large-scale DNN Training", ECAI 2023,
arXiv 2305.19982. No official code exists; this is our implementation of the paper's
algorithm.

Gradient accumulation keeps a full gradient buffer alive across N micro-batches. AdamA
folds each micro-batch gradient G_i into Adam's moments as soon as backward has produced
it for a parameter, and frees it, so only one tensor's gradient is alive at a time:

    at the first gradient of parameter p in step t:   m <- b1 m ;  v <- b2 v
    for each micro-batch i = 1..N, inside backward, per parameter:
        m <- m + (1 - b1) G_i / N
        v <- v + (1 - b2) G_i^2 / N          (v_norm = "mean", the default)
        v <- v + (1 - b2) (G_i / N)^2        (v_norm = "sum_scaled")
        free G_i
    after micro-batch N:   t <- t + 1
        p <- p - lr wd p                                 (decoupled weight decay)
        p <- p - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

m is exactly Adam-with-accumulation's m (the sum is linear). v differs: the mean of
squared micro-batch gradients, never below the square of their mean (Jensen), equal
when the micro-batch gradients agree.

Why `mean` is the default: it reduces to Adam whenever the micro-batch gradients agree
(v has the scale of one squared gradient, whatever N is). `sum_scaled`, the reading of
one third-party implementation, makes v N times smaller in that case, so steps grow
about sqrt(N) times with the number of micro-batches. Both equal Adam for N = 1.

Cannot be combined with what needs every gradient at once or per micro-batch:
global gradient-norm clipping (`max_grad_norm` must stay None: every gradient is
released during backward), fp16 with a GradScaler (`grad_scaler` must stay False, and
fp16 parameters are refused: a scaler cannot unscale gradients already folded into the
moments), and L2 (coupled) weight decay (`weight_decay_mode` must stay "decoupled": the
decay added to the gradient would be applied per micro-batch). Those options exist to say
so: their declared `choices` are the one value that works.

`state_dtype` keeps m and v in the parameter's dtype (`param`, default, as torch's Adam
does), float32, bfloat16, or 8-bit blocks (`int8`: block-wise absmax-quantised m, and
sqrt(v) on a block-wise logarithmic 8-bit code): the optimizer-state reduction the paper
combines AdamA with; the quantiser is methods/_common/quant8.py's (`linear` and `log`).
"""
from __future__ import annotations

import math

import torch

from bench.method import Method, MethodError, accumulate
from methods._common.quant8 import BLOCK, LOG_RANGE, LOG_STEP, Quantized8bit  # noqa: F401 (tests use them)
from methods._common.release import GradientRelease

STATE_DTYPES = ("param", "float32", "bfloat16", "int8")


class AdamAOptimizer(torch.optim.Optimizer):
    """Adam whose moments absorb each micro-batch gradient inside backward.

    Call `begin(n)` before the first backward of a mini-batch of n micro-batches, run the
    backward passes (each on the micro-batch loss divided by n), then `step()`.
    Gradients never survive a backward: the hooks set `p.grad = None`.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 v_norm="mean", state_dtype="param"):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.v_norm, self.state_dtype = v_norm, state_dtype
        self.micro_batches = 1
        self._decayed: set[int] = set()
        self._release = GradientRelease(  # _fold runs inside backward, then p.grad is freed
            [p for group in self.param_groups for p in group["params"]], self._fold)
        self._group_of = {id(p): group for group in self.param_groups for p in group["params"]}

    def begin(self, micro_batches: int) -> None:
        self.micro_batches = micro_batches
        self._decayed.clear()

    # -- moments in their storage format ---------------------------------------------
    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        state["step"] = 0  # a Python int: no tensor to read back (and none on fake tensors)
        if self.state_dtype == "int8":
            state["exp_avg"] = Quantized8bit(p.shape, p.device, "linear")
            state["exp_avg_sq_root"] = Quantized8bit(p.shape, p.device, "log")
        else:
            dtype = p.dtype if self.state_dtype == "param" else getattr(torch, self.state_dtype)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return state

    def _moments(self, state: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if self.state_dtype == "int8":
            return state["exp_avg"].decode(), state["exp_avg_sq_root"].decode().square()
        return state["exp_avg"], state["exp_avg_sq"]

    def _store(self, state: dict, m: torch.Tensor, v: torch.Tensor) -> None:
        if self.state_dtype == "int8":
            state["exp_avg"].encode(m)
            state["exp_avg_sq_root"].encode(v.sqrt())

    # -- the algorithm ---------------------------------------------------------------------
    def _fold(self, p: torch.Tensor) -> None:  # a GradientRelease hook: no_grad, then p.grad = None
        group = self._group_of[id(p)]
        beta1, beta2 = group["betas"]
        state = self.state[p] or self._init_state(p)
        m, v = self._moments(state)
        if id(p) not in self._decayed:  # once per mini-batch
            m.mul_(beta1)
            v.mul_(beta2)
            self._decayed.add(id(p))
        g = p.grad  # = G_i / N: the micro-batch loss was divided by N
        n = self.micro_batches
        m.add_(g, alpha=1 - beta1)
        v.addcmul_(g, g, value=(1 - beta2) * (n if self.v_norm == "mean" else 1))
        self._store(state, m, v)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if id(p) not in self._decayed:  # no gradient this mini-batch
                    continue
                state = self.state[p]
                state["step"] += 1
                t = state["step"]
                m, v = self._moments(state)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v.sqrt() / math.sqrt(1 - beta2 ** t)).add_(group["eps"])
                p.addcdiv_(m.to(p.dtype), denom.to(p.dtype), value=-group["lr"] / (1 - beta1 ** t))
        self._decayed.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # gradients are released inside backward

    def state_tensors(self) -> list[torch.Tensor]:
        out = []
        for state in self.state.values():
            for value in state.values():
                if isinstance(value, Quantized8bit):
                    out.extend(value.tensors())
                elif isinstance(value, torch.Tensor):
                    out.append(value)
        return out


class AdamA(Method):
    paper = ("Zhang et al., Adam Accumulation to Reduce Memory Footprints of both Activations "
             "and Gradients for Large-scale DNN Training, ECAI 2023, arXiv 2305.19982")
    defaults = dict(micro_batches=4, v_norm="mean", state_dtype="param",
                    weight_decay_mode="decoupled", max_grad_norm=None, grad_scaler=False)
    # gradients are folded into the moments in backward, before they could be unscaled:
    # float16 parameters are refused (make_optimizer); mixed float16 runs unscaled
    loss_scaling = False
    # the last three admit only the value that works (the module docstring says why)
    choices = {"v_norm": ("mean", "sum_scaled"), "state_dtype": STATE_DTYPES,
               "weight_decay_mode": ("decoupled",), "max_grad_norm": (None,),
               "grad_scaler": (False,)}

    def make_optimizer(self, model):
        hp = self.hp
        if any(p.dtype == torch.float16 for p in model.parameters()):
            raise MethodError("adama: fp16 training needs a GradScaler, which cannot unscale "
                              "gradients that are already folded into the moments; use "
                              "bfloat16 or float32")
        return AdamAOptimizer(model.parameters(), **self.adam_args, v_norm=hp["v_norm"],
                              state_dtype=hp["state_dtype"])

    def train_step(self, model, optimizer, batch):
        n = self.hp["micro_batches"]
        optimizer.begin(n)
        loss = accumulate(model, batch, n)  # the hooks fold and release every gradient
        optimizer.step()
        return loss

    def state_tensors(self, optimizer):
        return optimizer.state_tensors()


METHOD = AdamA

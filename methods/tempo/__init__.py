"""Tempo: save each layer's output instead of its input, where the output is kept anyway.

Andoorveedu, Zhu, Zheng, Pekhimenko, "Tempo: Accelerating Transformer-Based Model Training
through Memory Footprint Reduction", NeurIPS 2022, arXiv 2210.10246 (code:
UofT-EcoSystem/Tempo, CUDA kernels). This is a pure-PyTorch re-implementation (CPU, CUDA,
fake tensors) of its three drop-in layers; the model and its parameters stay the same.

    In-place GELU                       y = GELU(x)
        baseline saves   x                (GPT-2's tanh GELU, written out in Python: x,
                                           tanh(.), x/2 and 1 + tanh(.), four tensors)
        Tempo saves      y, m = [x >= x_min]   (y is the next Linear's saved input anyway;
                                           m is bit-packed, 1/8 byte per element)
        backward         x = GELU^-1(y) on the branch m, a fixed number of safeguarded
                         Newton steps; dx = GELU'(x) dy
    In-place LayerNorm                  y = gamma * xhat + beta,  xhat = (x - mean) * rstd
        baseline saves   x, mean, rstd
        Tempo saves      y, rstd, gamma, beta (+ xhat of the column with the smallest |gamma|)
        backward         xhat = (y - beta) / gamma
                         g = dy * gamma ; ds = sum_j g_j xhat_j ; db = sum_j g_j
                         dx = rstd * (g - (xhat * ds + db) / N)
                         dgamma = sum_rows dy * xhat ; dbeta = sum_rows dy
    Softmax -> dropout -> matmul (attention probabilities times V)
        baseline saves   s = softmax(scores), the dropout mask, d = dropout(s), V
        Tempo saves      s, the mask (bit-packed), V
        backward         d = s * mask / (1 - p)          (recomputed)
                         dV = d^T dout ; dd = dout V^T ; ds = dd * mask / (1 - p)
                         dscores = s * (ds - sum(ds * s))

Saving per layer and sequence (S tokens, hidden H, A heads, e bytes per element): GELU
S*4H*(e - 1/8) (BERT; GPT-2's Python GELU saved four tensors, so S*4H*(4e - 1/8)),
LayerNorm S*H*e per norm, attention A*S^2*(e + 1 - 1/8) (the baseline's mask is bool on
CUDA, and in the suite's CPU memory jobs, which run dropout through the same fused kernel;
PyTorch's plain CPU dropout keeps its mask in the activation dtype: A*S^2*(2e - 1/8)).
Tempo does nothing where these layers are absent or already lean:
SDPA/flash attention kernels never materialise the SxS probabilities (PyTorch's CPU
math fallback for SDPA with dropout does; Tempo swaps eager attention only), attention
dropout 0 saves nothing twice, and LLaMA has SwiGLU and RMSNorm. `self.report` says what
was replaced and why not.

"In-place" is the paper's name: the layers keep their output (which the next layer keeps
anyway) instead of their input; here the output is a new tensor and the input is freed
when the caller drops it.

Exactness. LayerNorm and attention backward are exact up to rounding (attention is
bit-identical to the eager path on CPU: same operations, same random draws). GELU loses
information only where GELU itself does (measured on dense grids, all four variants):
  - near x_min, where GELU' = 0, a rounding error dy of y moves x by sqrt(2 dy / GELU''),
    so the slope is off by up to sqrt(2 GELU''(x_min) dy): 5e-9 (float64), 1.6e-4 to
    2.8e-4 (float32: y's own rounding error differs between CPUs' float32 erf), 3e-2
    (bfloat16) absolute, for |x - x_min| below ~1e-3;
  - elsewhere by about GELU''(x) dy / |GELU'(x)|: below 5e-14 (float64) and 2e-5
    (float32) for |x - x_min| > 1e-3, a few ulps for most x;
  - where GELU(x) rounds to 0 on the left branch (x below -7.1 to -8.4 in float64, -5.1
    to -5.6 in float32, by variant) x is lost: the slope is taken as 0; the true slope
    there is below 5e-15 (float64) and 1e-6 (float32) in magnitude;
  - bfloat16 slopes are computed in float32 from the rounded y: within 3.3e-2 of
    autograd's, whose own error against the exact slope is up to 1.3e-2.
LayerNorm with gamma_j = 0 has no xhat_j in y: the column with the smallest |gamma| keeps
its xhat exactly (`ln_exact_columns` columns, default 1, costing S*e per norm, the size of
the mean that is no longer saved); further zero columns get xhat = 0 (their dgamma and
their own dx are then wrong, everything else stays exact), and xhat is clamped to
|xhat| <= sqrt(N), which holds for every true xhat, so nothing is ever inf or NaN.
"""
from __future__ import annotations

import functools
import math
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from bench.method import Method
from methods._common.chunks import chunk_size

# -- bit-packed masks ------------------------------------------------------------------


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8, 8 elements per byte (little-endian bits, zero padded)."""
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    weights = torch.bitwise_left_shift(torch.ones_like(shifts), shifts)
    return (flat.view(-1, 8).to(torch.uint8) * weights).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of `pack_bits`: the bool tensor of `shape`."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = torch.bitwise_right_shift(packed.unsqueeze(-1), shifts).bitwise_and_(1)
    return bits.view(-1)[: math.prod(shape)].view(shape).bool()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- in-place GELU -----------------------------------------------------------------------

_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_LOG_2PI = math.log(2.0 * math.pi)
_K = math.sqrt(2.0 / math.pi)  # tanh approximation: GELU(x) ~ x sigmoid(2K (x + A x^3))
_A = 0.044715

# Per family: argmin x_min, minimum GELU(x_min), curvature GELU''(x_min) (40-digit solves).
_GELU_MIN = {
    "erf": (-0.7517915246935644574579, -0.1699712074799036616939, 0.4314939923140469197865),
    "tanh": (-0.7524614220710162584880, -0.1700407505712540506391, 0.4304000910248585090799),
}


def _gelu_python_tanh(x):  # transformers' NewGELUActivation / gelu_python_tanh, verbatim
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_python_erf(x):  # transformers' gelu_python, verbatim
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


# variant -> (forward, as the replaced module computes it; family of the inverse)
GELU_VARIANTS = {
    "erf": (F.gelu, "erf"),
    "erf_python": (_gelu_python_erf, "erf"),
    "tanh": (lambda x: F.gelu(x, approximate="tanh"), "tanh"),
    "tanh_python": (_gelu_python_tanh, "tanh"),
}


def _gelu_and_slope(x: torch.Tensor, family: str, value: bool = True):
    """GELU(x) (None unless `value`) and GELU'(x), in x's dtype, with few temporaries."""
    if family == "erf":
        cdf = (x * -_SQRT_HALF).erfc_().mul_(0.5)
        slope = (x * x).mul_(-0.5).exp_().mul_(_INV_SQRT_2PI).mul_(x).add_(cdf)  # cdf + x pdf
        return (cdf.mul_(x) if value else None), slope
    x2 = x * x
    u = (x2 * _A).add_(1).mul_(x).mul_(2 * _K)  # 2K (x + A x^3)
    s = torch.sigmoid(u)
    du = x2.mul_(3 * _A).add_(1).mul_(2 * _K)
    slope = u.neg_().sigmoid_().mul_(s).mul_(x).mul_(du).add_(s)  # s + x s (1 - s) u'
    return (s.mul_(x) if value else None), slope


def _cbrt_(z: torch.Tensor) -> torch.Tensor:
    """Real cube root, in place."""
    return torch.copysign(z.abs().pow_(1.0 / 3.0), z, out=z)


def gelu_inverse(y: torch.Tensor, right: torch.Tensor, family: str, steps: int | None = None):
    """x with GELU(x) = y on the branch `right` (x >= x_min) or left (x < x_min).

    Returns x (float32, or float64 for float64 y) and a flag where x is lost (left branch,
    y == 0: GELU underflowed, x is somewhere below about -5). Newton's method, a fixed
    number of steps (3 in float32, 4 in float64: enough everywhere, measured on a dense
    grid): on the right branch on GELU(x) - y, on the left on log(GELU(x) / y) (the tail
    decays like exp(-x^2/2)). With t = x - x_min, each step keeps t * [0, 2]: the iterate
    stays on its side of x_min and at most doubles its distance to it, so steps near the
    flat minimum cannot run away. Starting points: near x_min the quadratic
    t = +-sqrt(2 (y - GELU(x_min)) / GELU''(x_min)); for y > 0 also x >= y; in the left
    tail the asymptote (a point left of the root, from which the steps rise monotonically).
    Both branches are computed for every element and blended with 0/1 masks, every value
    kept finite (no NaN slow paths); in-place operations keep the temporaries few, since
    this runs inside backward, beside all activations.
    """
    x_min, f_min, curv = _GELU_MIN[family]
    cd = _compute_dtype(y.dtype)
    y = y.to(cd)
    if steps is None:
        steps = 4 if cd == torch.float64 else 3
    tiny, huge = torch.finfo(cd).tiny, torch.finfo(cd).max
    lost = (~right).logical_and_(y == 0)
    on_right = right.to(cd)
    on_left = 1 - on_right
    # the left branch's target y < 0 (GELU(x_min) on right elements, a harmless stand-in)
    y_left = (y * on_left).add_(on_right, alpha=f_min).clamp_max_(-tiny)
    r = (y - f_min).clamp_min_(0).mul_(2 / curv).sqrt_()
    if family == "erf":  # |GELU(x)| <= pdf(x) on the left: x >= -sqrt(-2 log|y| - log 2pi)
        tail = y_left.neg().log_().mul_(-2).sub_(_LOG_2PI).clamp_min_(0).sqrt_().neg_()
    else:  # log|y| ~ 2K (x + A x^3): Cardano's root of A x^3 + x - log|y| / 2K = 0
        half_q = y_left.neg().log_().mul_(-0.5 / (2 * _K * _A))
        disc = (half_q * half_q).add_(1 / (27 * _A ** 3)).sqrt_()
        tail = _cbrt_(disc - half_q)
        tail.add_(_cbrt_(half_q.add_(disc).neg_()))
        del half_q, disc
    tail.sub_(x_min).clamp_max_(0)
    # right: t = max(y - x_min, r) for y > 0 (x >= y there), else the quadratic r
    t = y.clamp_min(0)
    t.sub_((y > 0).to(cd), alpha=x_min)
    torch.maximum(t, r, out=t)
    # left: the quadratic -r near the minimum (y < -0.1), else the tail
    near = (y < -0.1).to(cd)
    start_left = r.neg_().mul_(near).addcmul_(tail, near.neg_().add_(1))
    del r, tail, near
    t.mul_(on_right).addcmul_(start_left, on_left)
    del start_left
    for _ in range(steps):
        f, slope = _gelu_and_slope(t + x_min, family)
        left = torch.div(f, y_left).abs_().clamp_(tiny, huge).log_().mul_(f)  # log(f / y) f
        residual = f.sub_(y).mul_(on_right).addcmul_(left, on_left)  # right: f - y
        del f, left
        # (t - residual / slope) / t, kept in [0, 2]; 0/0 (t = 0, slope = 0): stay
        ratio = residual.div_(slope.mul_(t)).neg_().add_(1)
        del slope
        t = torch.nan_to_num_(ratio, nan=1.0, posinf=2.0, neginf=0.0).clamp_(0, 2).mul_(t)
    return t.add_(x_min), lost


# The inversion needs about eight temporaries of its input's size: it runs in up to 8 pieces
# (of at least 65536 elements, so small tensors are not cut into many small operations).
GELU_BACKWARD_CHUNKS = 8
GELU_BACKWARD_MIN_CHUNK = 1 << 16


def gelu_backward_from_output(grad_y: torch.Tensor, y: torch.Tensor, right: torch.Tensor,
                              family: str) -> torch.Tensor:
    """dL/dx = GELU'(x) dL/dy, from y = GELU(x) and the branch bit; GELU'(x) is taken as 0
    where x is lost (see the module docstring)."""
    grad_x = torch.empty(y.shape, dtype=grad_y.dtype, device=grad_y.device)
    gx, gy, ys, rs = grad_x.view(-1), grad_y.reshape(-1), y.reshape(-1), right.reshape(-1)
    n = ys.numel()
    size = chunk_size(n, GELU_BACKWARD_MIN_CHUNK, GELU_BACKWARD_CHUNKS)
    for start in range(0, n, size):
        piece = slice(start, start + size)
        x, lost = gelu_inverse(ys[piece], rs[piece], family)
        _, slope = _gelu_and_slope(x, family, value=False)
        del x
        gx[piece] = slope.masked_fill_(lost, 0).mul_(gy[piece])
    return grad_x


class InplaceGELUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, variant: str, pack: bool):
        fn, family = GELU_VARIANTS[variant]
        y = fn(x)
        right = x >= _GELU_MIN[family][0]
        ctx.family, ctx.shape, ctx.pack = family, right.shape, pack
        ctx.save_for_backward(y, pack_bits(right) if pack else right)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        y, right = ctx.saved_tensors
        if ctx.pack:
            right = unpack_bits(right, ctx.shape)
        return gelu_backward_from_output(grad_y, y, right, ctx.family), None, None


class InplaceGELU(nn.Module):
    """GELU that keeps its output and a branch bit for backward, not its input."""

    def __init__(self, variant: str = "erf", pack_masks: bool = True):
        super().__init__()
        if variant not in GELU_VARIANTS:
            raise ValueError(f"unknown GELU variant {variant!r}; known: {', '.join(GELU_VARIANTS)}")
        self.variant, self.pack_masks = variant, pack_masks

    def forward(self, x):
        return InplaceGELUFunction.apply(x, self.variant, self.pack_masks)

    def extra_repr(self):
        return f"variant={self.variant}, pack_masks={self.pack_masks}"


def gelu_variant(module: nn.Module) -> str | None:
    """The GELU variant a module computes, or None if it is not a GELU Tempo replaces."""
    from transformers import activations as act

    kind = type(module)
    if kind is nn.GELU:
        return "tanh" if module.approximate == "tanh" else "erf"
    if kind is act.GELUActivation:
        return "erf" if module.act is F.gelu else "erf_python"
    if kind is act.NewGELUActivation:
        return "tanh_python"
    if kind is act.GELUTanh:
        return "tanh" if isinstance(module.act, functools.partial) else "tanh_python"
    return None


# -- in-place LayerNorm ------------------------------------------------------------------


def _smallest_columns(weight: torch.Tensor, k: int) -> torch.Tensor:
    """The k columns with the smallest |gamma| (a stable sort: forward and backward agree)."""
    return torch.sort(weight.detach().reshape(-1).abs(), stable=True).indices[:k]


class InplaceLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps, exact_columns: int):
        y, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        n = math.prod(normalized_shape)
        lead = x.shape[: x.dim() - len(normalized_shape)]
        k = min(exact_columns, n) if weight is not None else 0
        cols = None
        if k:
            idx = _smallest_columns(weight, k)
            cols = ((x.reshape(*lead, n)[..., idx] - mean.reshape(*lead, 1)) * rstd.reshape(*lead, 1)).to(x.dtype)
        ctx.n, ctx.k = n, k
        ctx.save_for_backward(y, rstd, weight, bias, cols)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        y, rstd, weight, bias, cols = ctx.saved_tensors
        n, k = ctx.n, ctx.k
        cd = _compute_dtype(y.dtype)
        xhat = y.reshape(-1, n).to(cd)
        g = grad_y.reshape(-1, n).to(cd)
        if bias is not None:
            xhat = xhat - bias.reshape(-1).to(cd)
        if weight is not None:
            w = weight.reshape(-1).to(cd)
            zero = w == 0
            xhat = (xhat / torch.where(zero, 1, w)).masked_fill_(zero, 0)
            bound = math.sqrt(n)  # every true xhat has |xhat| <= sqrt(N - 1)
            xhat = xhat.clamp_(-bound, bound)
            if k:
                xhat.index_copy_(1, _smallest_columns(weight, k), cols.reshape(-1, k).to(cd))
            gw = g * w
        else:
            gw = g
        ds = (gw * xhat).sum(1, keepdim=True)
        db = gw.sum(1, keepdim=True)
        dx = rstd.reshape(-1, 1).to(cd) * (gw - (xhat * ds + db) / n)
        d_weight = d_bias = None
        if weight is not None and ctx.needs_input_grad[1]:
            d_weight = (g * xhat).sum(0).reshape(weight.shape).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            d_bias = g.sum(0).reshape(bias.shape).to(bias.dtype)
        return dx.reshape(grad_y.shape).to(grad_y.dtype), d_weight, d_bias, None, None, None


class InplaceLayerNorm(nn.LayerNorm):
    """LayerNorm that keeps its output, rstd and parameters for backward, not its input."""

    @classmethod
    def from_layer_norm(cls, ln: nn.LayerNorm, exact_columns: int = 1) -> "InplaceLayerNorm":
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape, new.eps, new.elementwise_affine = ln.normalized_shape, ln.eps, ln.elementwise_affine
        new.weight, new.bias = ln.weight, ln.bias  # the same Parameter objects (or None)
        new.exact_columns = exact_columns
        return new

    def forward(self, x):
        if torch.is_autocast_enabled(x.device.type):  # autocast's float32 layer_norm: as before
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return InplaceLayerNormFunction.apply(x, self.weight, self.bias, tuple(self.normalized_shape),
                                              self.eps, self.exact_columns)


# -- softmax -> dropout -> matmul ---------------------------------------------------------


class SoftmaxDropoutMatmulFunction(torch.autograd.Function):
    """dropout(softmax(scores), p) @ value, keeping softmax's output and the mask only."""

    @staticmethod
    def forward(ctx, scores, value, p: float, pack: bool):
        probs = torch.softmax(scores, dim=-1)
        dropped = F.dropout(probs, p=p, training=True)  # the eager path's op and random draws
        # The dropout mask: where probs == 0 it is irrelevant (d, dV and dscores are 0 there).
        keep = dropped != 0
        out = torch.matmul(dropped, value)
        ctx.p, ctx.pack, ctx.shape = p, pack, keep.shape
        ctx.save_for_backward(probs, pack_bits(keep) if pack else keep, value)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        probs, keep, value = ctx.saved_tensors
        if ctx.pack:
            keep = unpack_bits(keep, ctx.shape)
        scale = keep.to(probs.dtype).div_(1 - ctx.p)  # as dropout builds its scaled mask
        grad_value = torch.matmul((probs * scale).transpose(-1, -2), grad_out)
        grad_dropped = torch.matmul(grad_out, value.transpose(-1, -2)).mul_(scale)
        grad_scores = torch._softmax_backward_data(grad_dropped, probs, -1, probs.dtype)
        return grad_scores, grad_value, None, None


ATTENTION_NAME = "tempo"


def tempo_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Transformers' eager attention (GPT-2, BERT), with the fused softmax-dropout-matmul."""
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros((), dtype=scores.dtype, device=scores.device).masked_fill(
                ~attention_mask, torch.finfo(scores.dtype).min)
        scores = scores + attention_mask
    p = dropout if module.training else 0.0
    if p > 0 and scores.dtype == value.dtype and not torch.is_autocast_enabled(scores.device.type):
        out = SoftmaxDropoutMatmulFunction.apply(scores, value, p, getattr(module, "tempo_pack_masks", True))
        weights = None  # the dropped probabilities are never materialised for the caller
    else:
        weights = F.dropout(torch.softmax(scores, dim=-1).type(value.dtype), p=p, training=module.training)
        out = torch.matmul(weights, value)
    return out.transpose(1, 2).contiguous(), weights


def register_attention() -> None:
    """Make `config._attn_implementation = "tempo"` mean eager masks + our attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION_NAME, tempo_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)


ATTENTION_CLASSES = {"gpt2": ("GPT2Attention",), "bert": ("BertSelfAttention", "BertCrossAttention")}
ATTENTION_DROPOUT_KEYS = ("attn_pdrop", "attention_probs_dropout_prob", "attention_dropout")


def _attention_dropout(config) -> float:
    for key in ATTENTION_DROPOUT_KEYS:
        if getattr(config, key, None) is not None:
            return float(getattr(config, key))
    return 0.0


# -- the method ----------------------------------------------------------------------------


class Tempo(Method):
    paper = ("Andoorveedu, Zhu, Zheng, Pekhimenko, Tempo: Accelerating Transformer-Based Model "
             "Training through Memory Footprint Reduction, NeurIPS 2022")
    # bitpack_masks: the GELU branch bits and the dropout masks 8 per byte (the paper's
    # code keeps them as bool, 1 byte each: set False to reproduce that).
    # ln_exact_columns: LayerNorm columns (smallest |gamma|) whose xhat is kept exactly.
    defaults = dict(bitpack_masks=True, ln_exact_columns=1)

    def transform_model(self, model: nn.Module) -> nn.Module:
        pack = bool(self.hp["bitpack_masks"])
        exact = int(self.hp["ln_exact_columns"])
        gelus, norms = Counter(), 0
        acts, other_norms = set(), set()
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                variant = gelu_variant(child)
                if variant is not None:
                    setattr(parent, name, InplaceGELU(variant, pack))
                    gelus[variant] += 1
                elif type(child) is nn.LayerNorm:
                    setattr(parent, name, InplaceLayerNorm.from_layer_norm(child, exact))
                    norms += 1
                elif isinstance(child, InplaceGELU):  # transformed before
                    gelus[child.variant] += 1
                elif isinstance(child, InplaceLayerNorm):
                    norms += 1
                else:
                    module_path = type(child).__module__
                    if module_path.endswith("activations") or module_path == "torch.nn.modules.activation":
                        acts.add(type(child).__name__)
                    if "Norm" in type(child).__name__:
                        other_norms.add(type(child).__name__)
        report = {}
        report["gelu"] = (sum(gelus.values()) if gelus else
                          f"not replaced: no GELU in the model (activations: {', '.join(sorted(acts)) or 'none'})")
        if gelus:
            report["gelu_variants"] = dict(gelus)
        report["layernorm"] = (norms if norms else
                               f"not replaced: no nn.LayerNorm in the model "
                               f"(norms: {', '.join(sorted(other_norms)) or 'none'})")
        report["attention"] = self._swap_attention(model, pack)
        if not (gelus or norms or isinstance(report["attention"], int)):
            report["summary"] = "nothing replaced: Tempo leaves this model as it is (memory unchanged)"
        report["masks"] = "bit-packed, 1/8 byte per element" if pack else "bool, 1 byte per element"
        self.report = report
        return model

    @staticmethod
    def _swap_attention(model: nn.Module, pack: bool):
        config = getattr(model, "config", None)
        if config is None:
            return "not replaced: not a transformers model"
        impl = config._attn_implementation
        model_type = getattr(config, "model_type", "?")
        classes = ATTENTION_CLASSES.get(model_type, ())
        modules = [m for m in model.modules() if type(m).__name__ in classes]
        if impl == ATTENTION_NAME:
            return len(modules)
        if impl != "eager":
            return (f"not replaced: {impl} attention never materialises the SxS probabilities in its "
                    f"fused kernels (PyTorch's CPU math fallback for dropout does; Tempo swaps eager "
                    f"attention only)")
        p = _attention_dropout(config)
        if p <= 0:
            return "not replaced: attention dropout is 0, so no dropout output is saved beside the softmax"
        if not modules:
            return f"not replaced: no Tempo attention for model type {model_type}"
        if getattr(config, "reorder_and_upcast_attn", False):
            return "not replaced: reorder_and_upcast_attn has its own attention path"
        register_attention()
        for m in modules:
            m.tempo_pack_masks = pack
        config._attn_implementation = ATTENTION_NAME
        return len(modules)


METHOD = Tempo

"""WTA-CRS: a linear layer keeps a sampled subset of its input rows for the weight gradient.

Zirui Liu, Guanchu Wang, Shaochen Zhong, Zhaozhuo Xu, Daochen Zha, Ruixiang Tang, Zhimeng
Jiang, Kaixiong Zhou, Vipin Chaudhary, Shuai Xu, Xia Hu, "Winner-Take-All Column Row
Sampling for Memory Efficient Adaptation of Language Model", NeurIPS 2023, arXiv 2305.15265
(code: zirui-ray-liu/WTACRS; the estimator below is read from it). A linear layer
y = x W^T + b over n = B L tokens has the weight gradient grad_W = sum_t g_t x_t^T, one
column-row pair per token (g_t the output gradient of token t). WTA-CRS estimates that sum
from k of the n pairs, so the forward keeps k rows of x instead of all n:

    forward (x: n x d_in)
        y = F.linear(x, W, b)                                  exact
        k = min(max(floor(ratio n), min_rows), n)              ratio 0.3, min_rows 10
        if k = n: keep x as it is                              (exact, as a plain layer)
        p_t = ||x_t|| / sum_u ||x_u||                          the sampling distribution
        q_c = sum of the c largest p_t                         c = 1 .. k-1
        c* = argmin_c (1 - q_c) / (k - c)                      (first minimum)
        C = the c* rows of largest p if (1 - q_c*) / (k - c*) <= 1/k, else C = {}
        k_s = k - |C| >= 1                                      stochastic draws
        j_1 .. j_ks ~ p restricted to the complement of C, renormalised: p'_j = p_j / (1 - P_C)
                                                                (with replacement)
        keep  x_c (c in C)  and  x_js * (1 - P_C) / (k_s p_js) = x_js * R / (k_s ||x_js||),
              R = sum_{j not in C} ||x_j||, and the k row indices (int64)
    backward (g: n x d_out)
        grad_x = g W                                           exact (needs W only)
        grad_b = sum_t g_t                                     exact (needs no x)
        grad_W = sum_{c in C} g_c x_c^T + (1/k_s) sum_s (1 - P_C) / p_js g_js x_js^T
               = g[idx]^T @ kept rows

Unbiased: C is a function of x alone, and one draw has E[(1 - P_C) / p_j g_j x_j^T] =
sum_{j not in C} p'_j (1 - P_C) / p_j g_j x_j^T = sum_{j not in C} g_j x_j^T, so E[grad_W] =
the exact gradient for every x and g (rows with ||x_j|| = 0 are never drawn and add
nothing; if every row outside C is zero the draws get weight 0, still exact). Variance
(Frobenius, of one step's grad_W):
    Var = (1/k_s) [R sum_{j not in C} ||x_j|| ||g_j||^2 - ||sum_{j not in C} g_j x_j^T||_F^2]
(the paper's (1/k_s)[(1 - P_C) sum ||x_j||^2 ||g_j||^2 / p_j - ||.||_F^2] with p_j = ||x_j|| /
sum ||x||). With C empty this is plain column-row sampling (CRS) with k draws.

The probabilities. The paper's p_t is proportional to ||x_t|| ||g_t||, the output gradient
known only in backward; the official code caches, per training example, the gradient norms
of the last time that example was seen (zero on a first visit, when p is proportional to
||x_t|| alone). Here every step draws a fresh batch (no example is seen twice, and there is
no dataset index to key a cache), so there is no per-example cache: p_t is proportional to
||x_t|| (norms in float32, or float64 for a float64 input). The winner rule is the official
code's (`k_adaptive_3D`: score over c = 1..k-1; c = k, all rows deterministic, is never
chosen, so at least one draw remains).

Where the official code is biased (`seq2seq/approxlinear/functional.py`, with the paper's
configurations: `deter_adaptive`, `sample_replacement` and `mix_replacement` all true), and
this implementation is not:
  1. With C empty and `mix_replacement`, it draws the k rows without replacement and keeps
     them unweighted (no 1/(k p_j)): its expectation is sum_t pi_t g_t x_t^T (pi_t the
     chance that row t is drawn), not grad_W. Here C empty is CRS with replacement, weighted.
  2. With an all-zero norm cache (every first visit of an example) it scales the drawn rows
     by 1 - P_C only, without 1 / (k_s p'_j). Here the weight is always (1 - P_C)/(k_s p_j).
  3. With P_C > 0.999 it drops the stochastic part (multiplies it by 0): the rows outside C,
     up to 0.1% of the probability mass, are lost. Here they are always drawn and weighted.
  (Also: it computes p = (norm + 1e-8) / (sum + 1e-8), which does not sum to 1 while
  multinomial samples from the renormalised vector, a bias of about n 1e-8 / sum; here p is
  exactly the normalised norm.)

Randomness: the draws use the global RNG of the input's device (`torch.multinomial` with no
generator), which the suite seeds once per job (`torch.manual_seed(job.seed)` before the
model is built): a run is deterministic under the job's seed. Under `checkpointing` the
recomputation restores the RNG state (`preserve_rng_state`), so it draws the same rows.

Layers (`wta_layers`): "paper" (the default), as the paper's configurations: in full
fine-tuning every linear layer inside the Transformer blocks except the query, key and
value projections (LLaMA o_proj, gate_proj, up_proj, down_proj; GPT-2 attn.c_proj,
mlp.c_fc, mlp.c_proj, not the fused QKV attn.c_attn; BERT attention.output.dense,
intermediate.dense, output.dense). With LoRA before it in the stack (`lora+wta_crs`: the
model has methods.lora.LoRALinear layers, or peft's with `lora_peft+wta_crs`, their base
weights frozen) it samples the inputs
of the LoRA A matrices of the query, key and value projections (GPT-2: of c_attn), as the
paper's LoRA configurations do; a frozen layer saves no input, so nothing else needs it.
"all-linear": every linear layer in the blocks (with LoRA: every LoRA A). The paper also
samples the two attention matmuls (scores Q K^T and probabilities times V, per batch and
head); they are out of scope here (the suite's attention is one SDPA kernel, which keeps its
own tensors). `wta_crs+lora` (LoRA after it) samples nothing: LoRA freezes the layers this
method changed, and a frozen layer runs plainly; put `lora` first.

A wrapped layer stays the same module (its class becomes a subclass of nn.Linear or GPT-2's
Conv1D with this forward): parameter names and state dicts are unchanged. It samples only
in training with grad enabled and a trainable weight; otherwise it is the plain layer.

Shared samples: p depends on x alone, so wrapped layers that read the same input tensor
(LLaMA's gate_proj and up_proj; the q, k, v LoRA A under LoRA) share one draw and keep its
rows once. Each layer's estimate stays unbiased; their errors correlate, which leaves the
summed variance of all the gradients unchanged. (The official code draws per layer: its p
includes each layer's own gradient norms.)

Memory: a call saves k (d_in e + 8) bytes (e: the input's element size; the kept rows in the
input's dtype, scaled, plus int64 indices; once for the layers sharing an input) instead of
its input, n d_in e bytes; at k = n it saves its input as a plain layer does. Whether that
frees the input depends on whether another op saves the same tensor (LLaMA's gate_proj and
up_proj read the same normed states: both are wrapped, so it is freed; an input that the
attention kernel keeps as its output is not). `transform_model` finds out with one small
probe forward (8 tokens, in training mode, RNG state restored, checkpointing off;
remembered per model structure within the process) under `saved_tensors_hooks`:
`method_report` lists the layers whose input is freed (`inputs_freed`) and those whose
input another op still saves (`inputs_held`), per layer name and count, the bytes freed per
token and the bytes kept per sampled row; the bytes a forward of n tokens saves (k < n) are
the plain forward's minus freed_bytes_per_token n plus kept_bytes_per_row k. Measured on
the tiny models: LLaMA's o_proj input is held (SDPA keeps its output, of which o_proj's
input is a view), so there WTA-CRS adds its kept rows on top; every other paper layer's
input of LLaMA, GPT-2 and BERT is freed. With checkpointing before it, `method_report`
says that the figures hold for a block while it is recomputed.

Fake tensors (the simulated tier): every shape depends on n and k only; |C| is a 0-d tensor
used through masks (k rows are kept whatever |C| is), and nothing reads a value.
"""
from __future__ import annotations

import contextlib
import math
import weakref

import torch
import torch.nn.functional as F

from bench.method import Method, MethodError
from methods.lora import LoRALinear, fake_mode_of, linear_types, select_targets

# last name component of a query, key or value projection (fused ones included)
QKV = frozenset({"q_proj", "k_proj", "v_proj", "query", "key", "value", "c_attn", "q_attn",
                 "qkv_proj", "query_key_value", "Wqkv", "qkv"})
PROBE_TOKENS = 8


def kept_rows(n: int, ratio: float, min_rows: int) -> int:
    """k = min(max(floor(ratio n), min_rows), n)."""
    return min(max(math.floor(ratio * n), min_rows), n)


def saved_bytes(n: int, d_in: int, element_size: int, ratio: float, min_rows: int) -> int:
    """Bytes one wrapped call over n tokens saves for backward (besides its weight): the k
    kept rows and their int64 indices (shared by the layers reading the same input), or at
    k = n the input itself."""
    k = kept_rows(n, ratio, min_rows)
    return n * d_in * element_size if k == n else k * (d_in * element_size + 8)


def winner_count(top: torch.Tensor, total: torch.Tensor, k: int) -> torch.Tensor:
    """|C| as a 0-d int64 tensor: `top` holds the k largest norms (descending), `total` the
    sum of all. q_c = top[:c].sum() / total; c* = first argmin over c = 1..k-1 of
    (1 - q_c) / (k - c); |C| = c* if that score is at most 1/k, else 0."""
    if k < 2:
        return torch.zeros((), dtype=torch.int64, device=top.device)
    q = torch.cumsum(top[:k - 1], 0) / total
    score = (1 - q) / torch.arange(k - 1, 0, -1, dtype=q.dtype, device=q.device)  # k - c
    low, best = score.min(dim=0)  # the first minimum (a NaN, for a zero total, is no winner)
    return (best + 1) * (low <= 1 / k)


def draw(weights: torch.Tensor, k: int) -> torch.Tensor:
    """k indices drawn with replacement with probability proportional to `weights` (the
    global RNG of their device). A function of its own so that a test can fix the draw."""
    return torch.multinomial(weights, k, replacement=True)


def sample(x2d: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k rows WTA-CRS keeps of x2d (n x d_in, k < n): (indices, int64 [k]; weights [k],
    1 for the winners and R / (k_s ||x_j||) for the draws; |C|, a 0-d tensor). Slots
    0..|C|-1 hold the winners, the others the k_s = k - |C| draws (k draws are made and the
    first |C| dropped: iid, so the rest are k_s iid draws). About 30 small operations on
    vectors of n (no n x d_in temporary but the kept rows), none reading a value."""
    n, device = x2d.shape[0], x2d.device
    acc = torch.float64 if x2d.dtype == torch.float64 else torch.float32
    norms = torch.linalg.vector_norm(x2d, dim=1).to(acc)
    top, order = torch.topk(norms, k)
    c = winner_count(top, norms.sum(), k)
    winner = torch.arange(k, device=device) < c
    rest = torch.ones(n, dtype=torch.bool, device=device).scatter(0, order, ~winner)
    r = norms * rest  # ||x_j|| outside C, 0 in C
    mass = r.sum()
    # every row outside C zero (or a non-finite input): draw uniformly there, with weight 0
    usable = (mass > 0) & (mass < math.inf)
    drawn = draw(torch.where(usable, r, rest.to(acc)), k)
    picked = r[drawn]  # 0 for a zero row (or a row of C, which a draw never meets)
    w = (mass / (picked * (k - c))).masked_fill(picked == 0, 0)
    idx = torch.where(winner, order, drawn)
    return idx, w.masked_fill(winner, 1), c


SAMPLE = "_wta_crs_sample"  # the attribute of an input tensor that holds its sample


def kept(x: torch.Tensor, x2d: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scaled kept rows (k x d_in, x's dtype) and their int64 indices. Layers that read
    the same input tensor (LLaMA's gate_proj and up_proj; the q, k, v LoRA A) share one
    sample, held by the input tensor object itself (so it lives no longer than the input,
    and the first of those layers' backwards drops it): each layer's estimate stays unbiased,
    the summed variance of all their gradients is unchanged (only their errors correlate),
    and the rows are kept once. A changed input (version) draws again."""
    held = getattr(x, SAMPLE, None)
    if held is not None and held[0] == x._version and held[1] == k:
        return held[2], held[3]
    idx, w, _ = sample(x2d, k)
    rows = x2d.index_select(0, idx)
    rows.mul_(w.to(rows.dtype).unsqueeze(1))
    setattr(x, SAMPLE, (x._version, k, rows, idx))
    return rows, idx


class _WTACRS(torch.autograd.Function):
    """y = x W^T + b (nn.Linear) or x W + b (Conv1D, W stored d_in x d_out); the weight
    gradient from k sampled rows (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv1d: bool, k: int, probe: bool):
        d_in = x.shape[-1]
        x2d = x.reshape(-1, d_in)
        n = x2d.shape[0]
        if conv1d:
            y = torch.addmm(bias, x2d, weight) if bias is not None else x2d @ weight
            y = y.view(*x.shape[:-1], weight.shape[1])
        else:
            y = F.linear(x, weight, bias)
        ctx.conv1d, ctx.has_bias, ctx.x_shape = conv1d, bias is not None, x.shape
        if probe:  # the probe forward: save nothing (no backward runs)
            return y
        if k >= n:
            ctx.save_for_backward(x, None, weight)
        else:
            ctx.save_for_backward(*kept(x, x2d, k), weight)
            ctx.source = weakref.ref(x)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        rows, idx, weight = ctx.saved_tensors
        source = ctx.source() if hasattr(ctx, "source") else None
        if source is not None and hasattr(source, SAMPLE):
            delattr(source, SAMPLE)  # the rows live on in the saved tensors that need them
        d_out = grad_out.shape[-1]
        g2d = grad_out.reshape(-1, d_out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g2d @ weight.t() if ctx.conv1d else g2d @ weight).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            x2d = rows.reshape(-1, rows.shape[-1])
            g = g2d if idx is None else g2d.index_select(0, idx)
            grad_w = x2d.t() @ g if ctx.conv1d else g.t() @ x2d
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2d.sum(0)
        return grad_x, grad_w, grad_b, None, None, None


class _Sampled:
    """The forward of a wrapped layer (mixed into a subclass of its own class)."""

    wta_ratio: float = 0.3
    wta_min_rows: int = 10
    wta_probe: list | None = None  # the probe forward: (layer, input) pairs land here

    def forward(self, x):
        weight = self.weight
        if self.wta_probe is not None:
            self.wta_probe.append((self, x))
        elif not (self.training and torch.is_grad_enabled() and weight.requires_grad):
            return super().forward(x)
        n = x.numel() // x.shape[-1] if x.shape[-1] else 0
        k = kept_rows(n, self.wta_ratio, self.wta_min_rows)
        conv1d = not isinstance(self, torch.nn.Linear)
        return _WTACRS.apply(x, weight, self.bias, conv1d, k, self.wta_probe is not None)


_CLASSES: dict[type, type] = {}


def sampled_class(cls: type) -> type:
    """The subclass of nn.Linear or Conv1D with WTA-CRS's forward."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"WTACRS{cls.__name__}", (_Sampled, cls), {"__module__": __name__})
    return _CLASSES[cls]


def wrap(module: torch.nn.Module, ratio: float, min_rows: int) -> None:
    if not isinstance(module, _Sampled):
        module.__class__ = sampled_class(type(module))
    module.wta_ratio, module.wta_min_rows = ratio, min_rows


def layer_kind(name: str) -> str:
    """`model.layers.0.mlp.up_proj` -> `mlp.up_proj` (the name inside a block)."""
    parts = name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), -1)
    return ".".join(parts[index + 1:])


def lora_a(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(adapted layer, its LoRA A) qualified names: methods.lora's LoRALinear (`lora_A`), or a
    peft LoRA layer (`lora_A` a ModuleDict of adapters, `lora_peft`)."""
    out = []
    for name, m in model.named_modules():
        a = getattr(m, "lora_A", None)
        if isinstance(m, LoRALinear) or (hasattr(m, "base_layer") and isinstance(a, torch.nn.ModuleDict)):
            keys = list(a) if isinstance(a, torch.nn.ModuleDict) else [None]
            out += [(name, f"{name}.lora_A" + (f".{key}" if key is not None else "")) for key in keys]
    return out


def choose_layers(model: torch.nn.Module, which: str) -> list[str]:
    """Qualified names of the linear layers to wrap (see the module docstring)."""
    adapted = lora_a(model)
    if adapted:
        chosen = [a for n, a in adapted if which == "all-linear" or n.rsplit(".", 1)[-1] in QKV]
        if not chosen:
            raise MethodError(f"wta_crs with LoRA samples the LoRA A inputs of the query, key and value "
                              f"projections, and LoRA adapts none here (it adapts "
                              f"{', '.join(sorted({layer_kind(n) for n, _ in adapted}))}); "
                              f"use wta_crs@wta_layers=all-linear to sample every LoRA A")
        return chosen
    try:
        linear = select_targets(model, "all-linear")
    except MethodError:
        raise MethodError(f"wta_crs: {type(model).__name__} has no linear layer inside its blocks") from None
    chosen = [n for n in linear if which == "all-linear" or n.rsplit(".", 1)[-1] not in QKV]
    if not chosen:
        raise MethodError(f"wta_crs: every linear layer of {type(model).__name__}'s blocks is a query, key "
                          f"or value projection; use wta_crs@wta_layers=all-linear")
    return chosen


_PROBES: dict[tuple, dict] = {}  # structure -> finding (a capacity search builds one model many times)


def structure(model: torch.nn.Module, layers: dict[str, torch.nn.Module]) -> tuple:
    """What decides which tensors a forward saves: module names and classes (other methods'
    swaps), which parameters train, the config (sizes, dropout, attention kernel), dtype,
    device type, the wrapped layers."""
    param = next(model.parameters())
    config = getattr(model, "config", None)
    return (tuple((n, type(m).__qualname__) for n, m in model.named_modules()),
            tuple(p.requires_grad for p in model.parameters()),
            config.to_json_string() if hasattr(config, "to_json_string") else None,
            getattr(config, "_attn_implementation", None), param.dtype, param.device.type,
            tuple(layers))


def probe(model: torch.nn.Module, layers: dict[str, torch.nn.Module]) -> dict:
    """Which wrapped layers' inputs no other op saves for backward: one forward of
    PROBE_TOKENS tokens with the wrapped layers saving nothing, every saved storage recorded
    (`saved_tensors_hooks`); the global RNG state is restored after it. Remembered per
    model structure (`structure`) within the process."""
    key = structure(model, layers)
    if key not in _PROBES:
        if len(_PROBES) >= 16:
            _PROBES.clear()
        _PROBES[key] = _probe(model, layers)
    return dict(_PROBES[key])


def _probe(model: torch.nn.Module, layers: dict[str, torch.nn.Module]) -> dict:
    param = next(model.parameters())
    fake = fake_mode_of(param)
    saved, seen = {}, []

    def pack(t):
        saved[t.untyped_storage()._cdata] = True
        return t

    devices = [param.device] if param.device.type == "cuda" else []
    modes = {m: m.training for m in model.modules()}
    model.train()  # what a training step saves (dropout included)
    # checkpointed blocks save nothing in forward; probe what one saves when recomputed
    checkpointed = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in checkpointed:
        m.gradient_checkpointing = False
    for m in layers.values():
        m.wta_probe = seen
    try:
        with contextlib.ExitStack() as stack:
            if fake is not None:
                stack.enter_context(fake)
            stack.enter_context(torch.random.fork_rng(devices=devices))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t))
            ids = torch.zeros((1, PROBE_TOKENS), dtype=torch.long, device=param.device)
            out = model(input_ids=ids)
            del out
    finally:
        for m in layers.values():
            m.wta_probe = None
        for m, mode in modes.items():
            m.training = mode
        for m in checkpointed:
            m.gradient_checkpointing = True
    names = {id(m): n for n, m in layers.items()}
    freed, held, storages = {}, {}, {}
    seen = [(layer, x) for layer, x in seen if layer.weight.requires_grad]  # a frozen one runs plainly
    for layer, x in seen:
        storage = x.untyped_storage()
        kind = layer_kind(names[id(layer)])
        if storage._cdata in saved:
            held[kind] = held.get(kind, 0) + 1
        else:
            freed[kind] = freed.get(kind, 0) + 1
            storages[storage._cdata] = storage.nbytes()
    inputs = {id(x): x for _, x in seen}  # one sample per input tensor
    per_row = sum(x.shape[-1] * x.element_size() + 8 for x in inputs.values())
    return {"inputs_freed": freed, "inputs_held": held,
            "freed_bytes_per_token": sum(storages.values()) // PROBE_TOKENS,
            "kept_bytes_per_row": per_row}


class WTACRS(Method):
    paper = ("Liu, Wang, Zhong, Xu, Zha, Tang, Jiang, Zhou, Chaudhary, Xu, Hu, Winner-Take-All Column Row "
             "Sampling for Memory Efficient Adaptation of Language Model, NeurIPS 2023, arXiv 2305.15265")
    defaults = dict(ratio=0.3, min_rows=10, wta_layers="paper")
    choices = {"wta_layers": ("paper", "all-linear")}
    ranges = {"ratio": "(0, 1]", "min_rows": "[1, inf)"}

    def transform_model(self, model):
        hp = self.hp
        names = choose_layers(model, hp["wta_layers"])
        layers = {}
        for name in names:
            module = model.get_submodule(name)
            if not isinstance(module, linear_types()):
                raise MethodError(f"wta_crs: {name} is a {type(module).__name__}, not a linear layer")
            wrap(module, hp["ratio"], hp["min_rows"])
            layers[name] = module
        kinds = list(dict.fromkeys(layer_kind(n) for n in names))
        report = {"layers": kinds, "count": len(names),
                  "rows_kept": f"k = min(max(floor({hp['ratio']} n), {hp['min_rows']}), n) of n tokens a call"}
        try:
            report.update(probe(model, layers))
        except Exception as e:  # a model whose forward needs more than input_ids
            report["probe"] = f"not run ({type(e).__name__}: {e})"
        if any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
            report["checkpointing"] = ("blocks are recomputed in backward: their inputs are freed "
                                       "anyway; the figures hold for a block while it is recomputed")
        self.report = report
        return model


METHOD = WTACRS

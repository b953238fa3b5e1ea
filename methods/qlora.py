"""QLoRA: LoRA over base weights stored as 4-bit NormalFloat (NF4) with double quantization.

Dettmers, Pagnoni, Holtzman, Zettlemoyer, "QLoRA: Efficient Finetuning of Quantized LLMs",
NeurIPS 2023, arXiv 2305.14314 (Section 3: NF4, double quantization, one storage and one
compute data type). Every linear layer inside the Transformer blocks is stored as NF4; the
LoRA adapters of methods/lora.py sit beside the layers `targets` selects (default: the same
layers, "all-linear"):

    once, in transform_model, layer by layer (W: d_out x d_in as nn.Linear stores it; GPT-2's
    Conv1D weight, stored d_in x d_out, is transposed first, as transformers does for 4-bit):
        w = W flattened row-major, in float32 (n = d_in d_out weights; a float64 model's W is
            rounded to float32 first); blocks of 64 consecutive weights, the last may be partial
        c1_b = max_i |w_i|  over block b                             (float32, one per block)
        q_i  = the NF4 code nearest w_i / c1_b: w_i * (1 / c1_b) clamped to [-1, 1], bucketed on
               the 15 float32 midpoints of the code book, a tie to the lower code
        packed: two codes a byte, element 2i in the high nibble, 2i+1 in the low one (an odd
               n pads one code 7, the code of 0.0)
        double quantization of the n/64 scales c1:
        mu   = mean(c1);  c = c1 - mu                                (float32, one per layer)
        c2_k = max_j |c_j|  over blocks of 256 scales                (float32)
        a_j  = the 8-bit code of c_j / c2_k in the signed dynamic map D (bitsandbytes'
               create_dynamic_map(signed=True), 256 values in [-0.99297, 1]): bitsandbytes 0.50's
               CPU rule, a table of 65536 bins: a_j = T[floor(((clamp(c_j * (1 / c2_k), -1, 1)
               + 1) * 0.5) * 65535 + 0.5)], T[i] = how many midpoints of D lie below
               -1 + 2 i / 65535; a block of 256 zeros gets code 0
        stored: packed (uint8, ceil(n/2)), a (uint8, ceil(n/64)), c2 (float32, ceil(n/16384)),
               mu (float32, one value)
    forward, per layer (s = alpha / r; A, B as methods/lora.py makes them):
        c1~ = D[a] * c2 + mu                                         (float32)
        W~  = NF4[q] * c1~ (float32), cast to the compute dtype: the model's dtype
        y   = x W~^T + b + s B(A(drop(x)))                           (W~ freed after the matmul)
    backward: dx = dy W~ + LoRA's terms, W~ dequantized again and freed; W and b get no
        gradient (frozen, as every base parameter: LoRA's rule); A and B train with AdamW.

NF4's code book is bitsandbytes' float32 table (`get_4bit_type("nf4")`, Appendix E's
values); D and the second-level rule are bitsandbytes 0.50.2's on the CPU, so codes, scales
and dequantized values are bitsandbytes' byte for byte (`quantize_4bit(w, quant_type="nf4",
blocksize=64, compress_statistics=True)`, `dequantize_4bit`; tests/methods/test_qlora.py).
bitsandbytes' backends disagree among themselves on the second level only: its pure-PyTorch
fallback (no native library) rounds c / c2 to the exact nearest code, which differs from the
CPU library's 65536-bin table in about 0.2% of the scale codes, by one step. The paper calls
the second level "8-bit Floats"; the code uses this dynamic map. torchao's `to_nf4` is not
bit-identical (its code book is rounded to 4 decimals, its scales are linear int8, and it
needs n to be a multiple of 16384), so it is not the peer.

Memory, per quantized layer of n weights (what `param` counts, the exact formula):

    bytes(n) = ceil(n/2) + ceil(n/64) + 4 ceil(ceil(n/64) / 256) + 4
             = 0.515869140625 n + 4 for n a multiple of 16384  (4.127 bits a weight)

codes, scale codes, second-level scales and the offset mu: four frozen `nn.Parameter`s
(uint8, uint8, float32, float32), so the tracker counts them as `param`. The code books are
buffers shared by every layer on a device, `other`: NF4 as a byte table (byte b -> NF4[b >> 4],
NF4[b & 15], so that one lookup decodes a byte: 256 x 2 x 4 B) and D (256 x 4 B), 3,072 bytes
once (bitsandbytes keeps NF4, 64 B, and D, 1,024 B, in every layer's QuantState). Embeddings, norms, biases and
the LM head stay in the model's dtype (`param`, as bitsandbytes and peft leave them); the
adapters are `param` (r (d_in + d_out) each; `trainable_params` equals lora's), their
gradients `grad`, their AdamW moments `optimizer`. The dequantized W~ is a temporary
(`other`: made with grad mode off, inside the base path's autograd Function in forward and
again in its backward; under `checkpointing` the copy the recomputed forward makes is
labelled `activation` while it lives, as everything a recomputation makes). Making it takes
int32 byte indices (2 B a weight) and the float32 values (4 B a weight; for a float32 model
they are W~ itself, else they live beside W~ while cast), and the scales c1~ (4 B per 64
weights); a layer over 2^24 weights is made in chunks of 2^24 weights into W~, so those
temporaries stay at 6 B per weight of one chunk.

What autograd saves: the base path's Function saves nothing (`save_for_backward` is not used;
it keeps a reference to its layer, whose packed tensors are parameters anyway; bitsandbytes'
MatMul4Bit likewise keeps only the packed weight, and x never: W needs no gradient). The
adapters save what LoRA's do: A keeps its input x (N x d_in, shared by the adapters reading
the same x) and B keeps A's output (N x r). So a forward saves exactly what lora's saves (a
frozen full-precision layer saves only W, a parameter) and activation memory is lora's.

Layers: the quantized ones are "all-linear"'s (every Linear/Conv1D inside the blocks,
whatever `targets` says); the adapted ones are `targets`' (LoRA's hyperparameters: `rank` 16,
`alpha` 32, `dropout` 0, `targets`; QLoRA's paper puts adapters on every linear layer, its
Section 4). A layer both quantized and adapted is LoRA over NF4; a quantized layer without an
adapter is NF4 alone; an adapted layer outside the blocks (e.g. `targets=lm_head`) is LoRA over
its full-precision weight. `method_report` adds to lora's the quantized layers, their weights
and their bytes. The packed codes say how many weights they hold (`holds_weights`: n; the
scales 0), so a result's `n_params` is the model's, as before quantizing.
The adapters are made in model order as lora makes them, so they draw lora's A from the same
seed. It stacks as lora does (`checkpointing`, `grad_accum`, the activation methods, an
optimizer member such as `qlora+adamw_8bit`), but not with `lora` or `lora_peft`: it is LoRA
already, and a second LoRA would adapt its adapters.

transform_model quantizes layer by layer (each full-precision weight is released as its
layer is replaced) and in chunks of 2^24 weights, so its own peak is one layer's packed result
plus a chunk's temporaries (about 20 bytes a weight of the chunk). It runs on fake tensors too
(the simulated tier: nothing reads a value), where it makes the same tensors, so a simulated
job knows the packed sizes. Cast a model before transform_model, not after (a cast would turn
the float32 scales and code books into the new dtype).
"""
from __future__ import annotations

import contextlib

import torch

from bench.method import Method
from methods.lora import ALL_LINEAR, LoRA, LoRALinear, fake_mode_of, in_out_features, report, select_targets

BLOCK = 64  # weights per first-level block (one absmax each)
BLOCK2 = 256  # first-level scales per second-level block
LUT_BINS = 65536  # bins of bitsandbytes 0.50's CPU table for the 8-bit scale codes
CHUNK = 2**24  # weights quantized or dequantized at a time (a multiple of BLOCK)

# bitsandbytes' NF4 code book (functional.get_4bit_type("nf4")), float32 values
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0)


def _dynamic_map() -> tuple[float, ...]:
    """bitsandbytes' `create_dynamic_map(signed=True)` (8 bits, up to 7 exponent bits), the
    same operations: 127 positive and 127 negative values, 0 and 1, sorted."""
    data = []
    for i in range(7):
        boundaries = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32, device="cpu")
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0, 1.0]
    return tuple(float(v) for v in torch.tensor(sorted(data), dtype=torch.float32).tolist())


DYNAMIC = _dynamic_map()  # made on import: real tensors, outside any fake mode


def packed_bytes(n: int) -> int:
    """Bytes a layer of n weights keeps: codes, scale codes, second-level scales, offset."""
    blocks = -(-n // BLOCK)
    return -(-n // 2) + blocks + 4 * -(-blocks // BLOCK2) + 4


class CodeBooks:
    """The code books on one device, buffers every layer shares: NF4 as a byte table (byte b ->
    NF4[b >> 4], NF4[b & 15]: 256 x 2 float32) and the dynamic map D (256 float32); and, for
    quantizing, the midpoints of NF4 and the 65536-bin table of D."""

    def __init__(self, device):
        nf4 = torch.tensor(NF4, dtype=torch.float32, device=device)
        self.pairs = torch.stack([nf4.repeat_interleave(16), nf4.repeat(16)], 1)  # byte -> its two codes
        self.dynamic = torch.tensor(DYNAMIC, dtype=torch.float32, device=device)
        self.bounds = (nf4[:-1] + nf4[1:]) / 2
        mid = 0.5 * (self.dynamic[:-1] + self.dynamic[1:])
        i = torch.arange(LUT_BINS, dtype=torch.float32, device=device)
        # bin i's value, -1 + 2 i / 65535 in float32 (a true division: tensor by tensor)
        value = (2.0 * i) / torch.full_like(i, LUT_BINS - 1) + (-1.0)
        self.table = torch.searchsorted(mid, value).to(torch.uint8)  # midpoints strictly below


@torch.no_grad()
def quantize(weight: torch.Tensor, books: CodeBooks) -> dict:
    """NF4 with double quantization of a weight (d_out x d_in): the four stored tensors
    (module docstring); bitsandbytes 0.50.2's bytes on the CPU."""
    flat = weight.reshape(-1)
    n = flat.numel()
    blocks = -(-n // BLOCK)
    packed = torch.empty(-(-n // 2), dtype=torch.uint8, device=weight.device)
    absmax = torch.empty(blocks, dtype=torch.float32, device=weight.device)
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        part = flat[start:stop].float()
        full = (stop - start) // BLOCK * BLOCK
        whole = part[:full].view(-1, BLOCK)
        scale = whole.abs().amax(-1)
        scaled = [torch.clamp(whole * (1.0 / scale.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)]
        if full < stop - start:  # the last, partial block (bitsandbytes divides here)
            rest = part[full:].abs().max().clamp(min=1e-38)
            scale = torch.cat([scale, rest.unsqueeze(0)])
            scaled.append(torch.clamp(part[full:] / rest, -1, 1))
        scaled = torch.cat(scaled) if len(scaled) > 1 else scaled[0]
        if scaled.numel() % 2:
            scaled = torch.nn.functional.pad(scaled, (0, 1))
        codes = torch.bucketize(scaled, books.bounds, out_int32=True).to(torch.uint8)
        packed[start // 2:start // 2 + codes.numel() // 2] = (codes[::2] << 4) | codes[1::2]
        absmax[start // BLOCK:start // BLOCK + scale.numel()] = scale
    offset = absmax.mean()
    centred = absmax - offset
    groups = -(-blocks // BLOCK2)
    padded = torch.nn.functional.pad(centred, (0, groups * BLOCK2 - blocks)).view(groups, BLOCK2)
    scale2 = padded.abs().amax(-1)
    inverse = torch.where(scale2 > 0, 1.0 / scale2, torch.zeros_like(scale2))
    normed = (padded * inverse.view(-1, 1)).clamp(-1, 1)
    bins = ((normed + 1.0) * 0.5 * (LUT_BINS - 1) + 0.5).to(torch.int32)
    codes2 = books.table.index_select(0, bins.view(-1)).view(groups, BLOCK2)
    codes2 = torch.where(scale2.view(-1, 1) > 0, codes2, torch.zeros_like(codes2))
    return {"weight_nf4": packed, "absmax_codes": codes2.reshape(-1)[:blocks].clone(),
            "absmax_scales": scale2, "absmax_offset": offset}


def dequantize(packed, absmax_codes, absmax_scales, absmax_offset, pairs, dynamic, shape, dtype) -> torch.Tensor:
    """W~ (shape, dtype) from the stored tensors: NF4[q] * (D[a] * c2 + mu) in float32, then
    cast (bitsandbytes' dequantize_4bit, value for value); `pairs` is NF4 as a byte table
    (byte b -> NF4[b >> 4], NF4[b & 15]). Few operations: on fake tensors each one costs."""
    n = shape[0] * shape[1]
    scale2 = absmax_scales.repeat_interleave(BLOCK2)
    if scale2.numel() != absmax_codes.numel():
        scale2 = scale2[:absmax_codes.numel()]
    scale = (dynamic.index_select(0, absmax_codes.int()) * scale2).add_(absmax_offset)
    if n <= CHUNK:
        return _values(packed, scale, n, pairs).to(dtype).view(shape)
    out = torch.empty(n, dtype=dtype, device=packed.device)
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        first = start // BLOCK
        part = _values(packed[start // 2:(stop + 1) // 2], scale[first:first + -(-(stop - start) // BLOCK)],
                       stop - start, pairs)
        out[start:stop].copy_(part)
    return out.view(shape)


def _values(packed: torch.Tensor, scale: torch.Tensor, n: int, pairs: torch.Tensor) -> torch.Tensor:
    """NF4[q] * scale, float32, for n weights: `packed` their ceil(n/2) bytes, `scale` their
    blocks' scales."""
    values = pairs.index_select(0, packed.int()).view(-1)
    if values.numel() != n:
        values = values[:n]
    full = n // BLOCK * BLOCK
    if full == n:
        values.view(-1, BLOCK).mul_(scale.view(-1, 1))
    else:
        values[:full].view(-1, BLOCK).mul_(scale[:-1].view(-1, 1))
        values[full:].mul_(scale[-1])
    return values


class _NF4Matmul(torch.autograd.Function):
    """y = x W~^T + b with W~ dequantized in forward and again in backward; saves nothing
    (the layer, whose tensors are parameters, is kept on ctx, as bitsandbytes does)."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        w = layer.dequantize()
        return torch.nn.functional.linear(x.to(w.dtype), w, layer.bias).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None
        w = ctx.layer.dequantize()
        return (grad.to(w.dtype) @ w).to(grad.dtype), None


class NF4Linear(torch.nn.Module):
    """A frozen linear layer stored as NF4 with double quantization (module docstring);
    computes in the dtype of the weight it replaced."""

    def __init__(self, layer: torch.nn.Module, books: CodeBooks):
        super().__init__()
        self.in_features, self.out_features = in_out_features(layer)
        weight = layer.weight if isinstance(layer, torch.nn.Linear) else layer.weight.t()
        self.compute_dtype = layer.weight.dtype
        for key, value in quantize(weight.detach(), books).items():
            setattr(self, key, torch.nn.Parameter(value, requires_grad=False))
            # how many of the model's weights a packed parameter holds (bench.models.n_params)
            self._parameters[key].holds_weights = weight.numel() if key == "weight_nf4" else 0
        self.bias = layer.bias  # frozen, in the model's dtype (or None)
        self.register_buffer("nf4_pairs", books.pairs, persistent=False)
        self.register_buffer("dynamic", books.dynamic, persistent=False)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.weight_nf4, self.absmax_codes, self.absmax_scales, self.absmax_offset,
                          self.nf4_pairs, self.dynamic, (self.out_features, self.in_features), self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NF4Matmul.apply(x, self)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, compute_dtype={self.compute_dtype}, nf4+double-quant")


class QLoRA(Method):
    shards = False  # not under FSDP2: fully_shard rejects its scalar NF4 parameters (absmax_offset)
    paper = ("Dettmers, Pagnoni, Holtzman, Zettlemoyer, QLoRA: Efficient Finetuning of Quantized LLMs, "
             "NeurIPS 2023, arXiv 2305.14314")
    defaults = dict(LoRA.defaults)
    choices, ranges = LoRA.choices, LoRA.ranges
    incompatible = frozenset({"lora", "lora_peft"})  # it is LoRA already: a second would adapt the adapters

    def transform_model(self, model):
        hp = self.hp
        adapted = set(select_targets(model, hp["targets"]))
        quantized = set(select_targets(model, ALL_LINEAR))
        for p in model.parameters():
            p.requires_grad_(False)
        names = [name for name, _ in model.named_modules() if name in adapted | quantized]
        books, weights, nbytes = {}, 0, 0
        for name in names:  # in model order: the adapters draw lora's A from the same seed
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            layer = getattr(parent, child)
            module = LoRALinear(layer, hp["rank"], hp["alpha"], hp["dropout"]) if name in adapted else layer
            if name in quantized:
                fake = fake_mode_of(layer.weight)
                with fake or contextlib.nullcontext():
                    device = layer.weight.device
                    if device not in books:
                        books[device] = CodeBooks(device)
                    base = NF4Linear(layer, books[device])
                if module is layer:
                    module = base
                else:
                    module.base_layer = base
                weights += layer.weight.numel()
                nbytes += packed_bytes(layer.weight.numel())
            setattr(parent, child, module)
            del layer, module  # the full-precision weight goes with its layer
        self.report = {**report(sorted(adapted, key=names.index), model), "quantized_layers": len(quantized),
                       "quantized_weights": weights, "nf4_bytes": nbytes,
                       "code_book_bytes": 4 * (2 * 256 + len(DYNAMIC)) * len(books)}
        return model


METHOD = QLoRA

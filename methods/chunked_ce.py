"""Chunked cross-entropy: the LM head and the loss computed `chunk` tokens at a time, so the
whole logits (and their float32 copy) never exist; each chunk's logits are recomputed in
backward.

The technique of Liger-Kernel's fused linear cross-entropy (Hsu et al., arXiv 2410.10989)
and Apple's Cut Cross-Entropy (Wijmans et al., ICLR 2025, arXiv 2411.09009), written as
one `torch.autograd.Function` in plain PyTorch (theirs are Triton kernels). For the
hidden states h [N, H] that enter the LM head (weight W [V, H], bias b if any) and the
labels y (-100: unlabelled), in the loss precision (float32 for a half-precision model,
as Hugging Face upcasts):

    forward, per chunk C of c rows:  z = (h_C W^T + b) upcast        c x V, then freed
                                     lse_C = logsumexp(z), z_y = z[y]
             loss = sum over labelled rows of (lse - z_y) / (number labelled)
             keep h (the head's input, which the plain loss keeps too), lse (N numbers)
    backward, per chunk:             z recomputed, g = s (softmax(z) - onehot(y)) with
                                     s = dloss / (number labelled) (0 on unlabelled rows),
                                     cast to the model's dtype as the plain loss's is
                                     dh_C = g W       (written in place into dh [N, H])
                                     dW += g^T h_C,  db += sum of g's rows

Loss and gradients are the plain loss's (`bench.method.logits_loss`: the same labels,
which are aligned with the inputs, no shift, and the same -100), up to rounding: tied
weights (GPT-2's head is its token embedding, BERT's decoder too, and BERT's decoder bias
is `cls.predictions.bias`) get their gradient through the same parameter. A frozen head
(LoRA) gets no weight gradient, and none is computed.

How the head is found: the model runs (`model(input_ids=...)`, through every method's
changes) with its output embedding (`get_output_embeddings()`, a plain `nn.Linear`)
replaced for that call by the identity, which records its input, weight and bias. So what
the model does before its head is kept: BERT's masked-LM head applies its transform
(dense, GELU, LayerNorm) before the decoder, LLaMA and GPT-2 their final norm. A model that
changes its logits after the head (Gemma 2's soft-capping, a logit scale) returns something
other than the head's output and is refused with a MethodError, as is a head that is not a
plain `nn.Linear`.

Hyperparameters:
- `chunk` 1024: tokens per chunk (the micro-batch's B T tokens are flattened; the last
  chunk may be shorter; a chunk at least N is one chunk, which still keeps no logits for
  backward and holds one float32 N x V tensor at a time, not three).
- `weight_grad_dtype` "float32": the head's weight (and bias) gradient is summed over chunks
  in float32 for a half-precision model (V H 4 bytes alive during the loss's backward),
  then cast, as one matmul over all tokens sums in float32 before its single rounding;
  "param" sums in the parameter's dtype (no buffer; one rounding per chunk). The same in
  float32 and float64.

Memory, in bytes per token per vocabulary entry (N tokens of a micro-batch, V entries;
`method_report` states it first, `baseline` and `chunked_ce`, with the run's bytes). The
plain loss upcasts the logits to float32 (a bfloat16 model's own logits are freed then:
`lm_loss` keeps no reference to them), keeps log_softmax's float32 output for backward, and
peaks in backward with three float32 N x V tensors alive: the kept log-probabilities,
nll_loss's gradient and log_softmax's gradient. Float32 and bfloat16 models alike: forward
peak 8, kept 4, backward peak 12 (a Hugging Face model given the labels computes the loss
while its forward still holds its logits: a bfloat16 forward peak of 10, the float32 one
stays 8, its upcast being no copy). chunked_ce keeps none of it: 4 bytes per token (the
log-sum-exp, float32) and, while the loss runs, one chunk: 4 bytes per chunk token per
vocabulary entry for a float32 model, 6 for bfloat16 (the chunk's logits and their float32
copy), plus in backward the hidden states' gradient (N H e, which the plain loss makes too)
and, for a half-precision model with `weight_grad_dtype` float32, the V H 4-byte sum.

Stacks with every method that computes the loss through
`bench.method.lm_loss` (all that own the step do, but ROAM, which traces its own loss:
incompatible). Under `mesa8bit`, the head's input is kept by this loss after the model's
forward has returned, so it is not quantized. Static shapes and no value read: runs on
fake tensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from bench.method import Method, MethodError, use_loss

IGNORE = -100


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of F.linear(hidden, weight, bias) against `labels`, `chunk` rows at
    a time (see the module docstring); hidden [N, H], labels [N]."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk: int, accum_dtype: torch.dtype):
        n = hidden.shape[0]
        dtype = loss_dtype(hidden.dtype)
        valid = labels != IGNORE
        target = torch.where(valid, labels, 0)
        lse = hidden.new_empty(n, dtype=dtype)
        picked = hidden.new_empty(n, dtype=dtype)
        for i in range(0, n, chunk):
            j = min(i + chunk, n)
            z = F.linear(hidden[i:j], weight, bias).to(dtype)  # the only c x V tensor (+ its source)
            picked[i:j] = z.gather(1, target[i:j, None]).squeeze(1)
            top = z.amax(1, keepdim=True)
            lse[i:j] = z.sub_(top).exp_().sum(1).log_().add_(top.squeeze(1))
            del z
        loss = torch.where(valid, lse - picked, 0).sum() / valid.sum()
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.chunk, ctx.accum_dtype = chunk, accum_dtype
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n, chunk = hidden.shape[0], ctx.chunk
        valid = labels != IGNORE
        target = torch.where(valid, labels, 0)
        scale = torch.where(valid, grad_loss.to(lse.dtype) / valid.sum(), 0)  # per row
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=ctx.accum_dtype, device=weight.device) if need_w else None
        db = torch.zeros(bias.shape, dtype=ctx.accum_dtype, device=bias.device) if need_b else None
        for i in range(0, n, chunk):
            j = min(i + chunk, n)
            h = hidden[i:j]
            z = F.linear(h, weight, bias).to(lse.dtype)
            z.sub_(lse[i:j, None]).exp_().mul_(scale[i:j, None])  # s softmax(z)
            z.scatter_add_(1, target[i:j, None], -scale[i:j, None])  # s (softmax(z) - onehot(y))
            g = z.to(hidden.dtype)  # the logits' gradient in the model's dtype, as the plain loss's
            if need_h:
                torch.mm(g, weight, out=dh[i:j])
            if need_w or need_b:
                if g.dtype != ctx.accum_dtype:  # sum the rounded gradient exactly: in accum_dtype
                    z.copy_(g)
                    g, h = z, h.to(ctx.accum_dtype)
                if need_w:
                    dw.addmm_(g.t(), h)
                if need_b:
                    db.add_(g.sum(0))
            del z, g
        dw = dw.to(weight.dtype) if need_w else None
        db = db.to(bias.dtype) if need_b else None
        return dh, dw, db, None, None, None


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision of the loss: float32 for half-precision logits (upcast as Hugging Face
    does), else the logits' own."""
    return torch.promote_types(dtype, torch.float32)


def head_input(model, input_ids: torch.Tensor):
    """Run `model` with its output embedding replaced by the identity; returns (hidden
    states entering the head, the head's weight, its bias)."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise MethodError(f"chunked_ce needs the model's output embedding to be a torch.nn.Linear, "
                          f"not {type(head).__name__}")
    seen = []

    def identity(hidden):
        seen.append((hidden, head.weight, head.bias))
        return hidden

    before = head.__dict__.get("forward")
    head.forward = identity
    try:
        out = model(input_ids=input_ids)
    finally:
        if before is None:
            del head.forward
        else:
            head.forward = before
    if len(seen) != 1 or getattr(out, "logits", None) is not seen[0][0]:
        raise MethodError(f"chunked_ce: {type(model).__name__} does not return its head's output as "
                          f"its logits (it changes them after the head, e.g. soft-capping or a "
                          f"logit scale, or calls the head {len(seen)} times); only such a model "
                          f"can have its loss computed from the head's input")
    return seen[0]


def bytes_per_token_per_vocab(dtype: torch.dtype) -> dict:
    """What the plain loss (`bench.method.logits_loss`) and chunked_ce hold of the logits, in
    bytes per token per vocabulary entry, for a model of `dtype` (e bytes an element; f for
    the loss precision): counted from the operators, and measured with the memory tracker in
    tests/methods/test_chunked_ce.py. Per token of the micro-batch for the plain loss; per
    token of one chunk for chunked_ce."""
    e = dtype.itemsize
    f = loss_dtype(dtype).itemsize
    return {
        # forward: the logits (e), upcast for a half-precision model (f; the model's logits
        # are freed then, lm_loss keeps no reference: e + f <= 2 f), then log_softmax's
        # output (f) beside the upcast copy (f)
        "baseline_forward_peak": 2 * f,
        # log_softmax's output, kept for backward
        "baseline_kept_for_backward": f,
        # backward: the kept log-probabilities, nll_loss's gradient and log_softmax's
        # gradient (f each); the gradient cast to the model's dtype (e) comes after
        "baseline_backward_peak": 3 * f,
        # nothing of the logits is kept (one number per token: its log-sum-exp, f bytes)
        "chunked_ce_kept_for_backward": 0,
        # one chunk's logits (e) and their upcast (f), in forward and in backward
        "chunked_ce_chunk": e + f if e != f else f,
    }


class ChunkedCE(Method):
    paper = ("Hsu et al., Liger Kernel: Efficient Triton Kernels for LLM Training (fused linear "
             "cross-entropy), arXiv 2410.10989, 2024; Wijmans et al., Cut Your Losses in Large-Vocabulary "
             "Language Models, ICLR 2025, arXiv 2411.09009")
    defaults = dict(chunk=1024, weight_grad_dtype="float32")
    ranges = {"chunk": "[1, inf)"}
    choices = {"weight_grad_dtype": ("float32", "param")}
    incompatible = frozenset({"roam"})  # ROAM traces its own copy of the plain loss
    # not under ZeRO: it uses the head's weight in backward beside the head's forward, which
    # DeepSpeed ZeRO-3's per-module gather and release (hooks on the head's output) never see
    shards = ("fsdp",)

    def transform_model(self, model):
        use_loss(model, self.loss)
        return model

    def loss(self, model, batch):
        hidden, weight, bias = head_input(model, batch["input_ids"])
        hidden = hidden.flatten(0, -2)
        labels = batch["labels"].flatten()
        accum = loss_dtype(weight.dtype) if self.hp["weight_grad_dtype"] == "float32" else weight.dtype
        self._describe(hidden, weight, accum)
        return ChunkedLinearCrossEntropy.apply(hidden, weight, bias, labels, int(self.hp["chunk"]), accum)

    def _describe(self, hidden, weight, accum):
        """The report: what the plain loss holds of the logits at its peak and what this
        holds instead, per token per vocabulary entry and in the run's bytes."""
        (n, width), vocab = hidden.shape, weight.shape[0]
        c = min(int(self.hp["chunk"]), n)
        per = {name: bytes_per_token_per_vocab(dtype) for name, dtype in
               (("float32", torch.float32), ("bfloat16", torch.bfloat16))}
        this = bytes_per_token_per_vocab(hidden.dtype)
        f = loss_dtype(hidden.dtype).itemsize
        extra = vocab * width * accum.itemsize if accum != weight.dtype else 0
        self.report = {
            "baseline": (
                "the plain loss makes the whole logits (the model's dtype), upcasts them to float32 "
                "(a bfloat16 model's logits are freed then), keeps log_softmax's float32 output for "
                "backward, and at its peak, in backward, holds three float32 N x V tensors: the kept "
                "log-probabilities, nll_loss's gradient and log_softmax's gradient. Bytes per token "
                "per vocabulary entry, float32 and bfloat16 models alike: forward peak 8, kept 4, "
                "backward peak 12 (a Hugging Face model given the labels computes the loss while its "
                "forward still holds its logits: a bfloat16 forward peak of 10)"),
            "chunked_ce": (
                "keeps the head's input (the plain loss keeps it too) and one log-sum-exp per token "
                f"({f} bytes), none of the logits; forward and backward hold one chunk's logits at "
                "a time: bytes per chunk token per vocabulary entry 4 for a float32 model (8 float64), "
                "6 for bfloat16 (the chunk and its float32 copy)"
                + (f"; plus the head's weight gradient summed in float32 during the loss's backward "
                   f"({extra:,} bytes here)" if extra else "")),
            "bytes_per_token_per_vocab": per,
            "tokens": n, "vocab": vocab, "chunk": c, "chunks": -(-n // c),
            "baseline_backward_peak_bytes": this["baseline_backward_peak"] * n * vocab,
            "chunked_ce_chunk_bytes": this["chunked_ce_chunk"] * c * vocab,
            "chunked_ce_kept_bytes": f * n,
            "weight_grad_buffer_bytes": extra,
        }


METHOD = ChunkedCE

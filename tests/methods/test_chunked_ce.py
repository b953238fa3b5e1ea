"""Chunked cross-entropy (methods/chunked_ce.py) against float64 autograd of the plain loss
(`bench.method.logits_loss`), in stacks, and its memory (the memory tracker, on a
large-vocabulary shape).

No peer: Apple's `cut-cross-entropy` 25.1.1 (the PyPI release) has no chunked path that runs
on a CPU. Its `cce` kernels are Triton (on a CPU they fail at launch, "0 active drivers");
its `torch_compile` path runs on a CPU (Inductor) but is a compiled F.linear + cross_entropy
over the whole logits, not chunked; and on Linux the package imports Triton whatever the
path. The reference is autograd of the plain loss."""
import types

import pytest
import torch

from bench import models
from bench.measure import runner
from bench.measure.tracker import MemoryTracker
from bench.method import Method, MethodError, Stack, load, lm_loss, logits_loss
from conftest import lm_batch
from methods import chunked_ce
from methods.chunked_ce import bytes_per_token_per_vocab

NAMES = ["gpt2-tiny", "bert-tiny", "llama-tiny"]


def batch(n=3, t=11, vocab=256, seed=1):
    """33 tokens, some unlabelled inside the sequence too (as BERT's masking leaves them)."""
    b = lm_batch(n, t, vocab, seed)
    b["labels"][1, 2:6] = -100
    return b


def model(name, dtype=torch.float64, spec=None):
    torch.manual_seed(0)
    m = models.build(name, dropout=0.0).to(dtype)
    bias = m.get_output_embeddings().bias
    if bias is not None:  # BERT's decoder bias starts at zero: make it count
        with torch.no_grad():
            bias.normal_(0, 0.5)
    method = load(spec) if spec else None
    return (method.transform_model(m) if method else m), method


@pytest.fixture
def calls(monkeypatch):
    """How many times the chunked loss ran (so a test cannot pass on the plain loss)."""
    count = []
    apply = chunked_ce.ChunkedLinearCrossEntropy.apply

    def counted(*args):
        count.append(args[0].shape[0])
        return apply(*args)

    monkeypatch.setattr(chunked_ce.ChunkedLinearCrossEntropy, "apply", counted)
    return count


@pytest.mark.parametrize("chunk", [1, 5, 33, 1000])  # 5 does not divide 33 tokens; 1000 > 33
@pytest.mark.parametrize("name", NAMES)
def test_loss_and_every_gradient_equal_float64_autograd(name, chunk, calls):
    b = batch()
    ref, _ = model(name)
    want = logits_loss(ref, b)
    want.backward()
    ours, method = model(name, spec=f"chunked_ce@chunk={chunk}")
    got = lm_loss(ours, b)
    assert type(got.grad_fn).__name__ == "ChunkedLinearCrossEntropyBackward" and calls == [33]
    got.backward()
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    head = ours.get_output_embeddings()
    assert head.weight.grad.abs().max() > 1e-3  # the head's gradient is not trivially zero
    for (key, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), key
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14, msg=key)
    report = method.report
    assert (report["tokens"], report["vocab"], report["chunk"]) == (33, 256, min(chunk, 33))
    assert report["chunks"] == -(-33 // chunk)


def test_tied_head_and_berts_decoder_bias_get_both_contributions():
    """GPT-2's head is its token embedding and BERT's decoder bias is cls.predictions.bias:
    one parameter each, whose gradient sums the head's and (for the embedding) the input's."""
    gpt2, _ = model("gpt2-tiny", spec="chunked_ce@chunk=5")
    assert gpt2.get_output_embeddings().weight is gpt2.transformer.wte.weight
    bert, _ = model("bert-tiny", spec="chunked_ce@chunk=5")
    assert bert.get_output_embeddings().bias is bert.cls.predictions.bias
    b = batch()
    lm_loss(bert, b).backward()
    ref, _ = model("bert-tiny")
    logits_loss(ref, b).backward()
    torch.testing.assert_close(bert.cls.predictions.bias.grad, ref.cls.predictions.bias.grad, rtol=1e-10, atol=1e-14)
    assert bert.cls.predictions.bias.grad.abs().max() > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_gradients_are_the_plain_losss_within_one_rounding(name):
    """bfloat16: the loss in float32 (upcast as the plain loss), the logits' gradient cast to
    bfloat16 as the plain loss casts it, the head's gradient summed over chunks in float32
    and rounded once (`weight_grad_dtype` float32); with "param" each chunk's sum rounds."""
    b = batch()
    ref, _ = model(name, torch.bfloat16)
    want = logits_loss(ref, b)
    want.backward()
    ours, _ = model(name, torch.bfloat16, "chunked_ce@chunk=5")
    got = lm_loss(ours, b)
    got.backward()
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for (key, p), q in zip(ours.named_parameters(), ref.parameters()):
        scale = float(q.grad.float().abs().max())
        torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=0, atol=2 ** -8 * scale, msg=key)
    rounded, _ = model(name, torch.bfloat16, "chunked_ce@chunk=5,weight_grad_dtype=param")
    lm_loss(rounded, b).backward()
    head = ours.get_output_embeddings().weight
    assert not torch.equal(rounded.get_output_embeddings().weight.grad, head.grad)  # the option acts


STACKS = [  # (with chunked_ce, the same without it)
    ("chunked_ce@chunk=5+checkpointing", "checkpointing", "gpt2-tiny", 1),
    ("checkpointing+chunked_ce@chunk=5", "checkpointing", "llama-tiny", 1),
    ("chunked_ce@chunk=5+grad_accum", "grad_accum", "gpt2-tiny", 4),
    ("checkpointing+chunked_ce@chunk=3+grad_accum", "checkpointing+grad_accum", "bert-tiny", 4),
    ("lora+chunked_ce@chunk=5", "lora", "llama-tiny", 1),
    ("lomo+chunked_ce@chunk=5", "lomo", "gpt2-tiny", 1),  # LOMO owns the step
    ("chunked_ce@chunk=5+adama", "adama", "llama-tiny", 4),  # AdamA owns it, over 4 micro-batches
]


@pytest.mark.parametrize("spec,plain,name,micro", STACKS)
def test_stacked_it_still_equals_the_stack_without_it_float64(spec, plain, name, micro, calls):
    b = lm_batch(4, 12, 256, seed=2)
    b["labels"][0, 3:7] = -100
    ref, ref_method = model(name, spec=plain)
    ours, method = model(name, spec=spec)
    want = ref_method.train_step(ref, ref_method.make_optimizer(ref), b)
    got = method.train_step(ours, method.make_optimizer(ours), b)
    assert calls == [48 // micro] * micro  # every micro-batch's loss was the chunked one
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    start, _ = model(name, spec=plain)
    moved = 0.0
    for (key, p), q, p0 in zip(ours.named_parameters(), ref.parameters(), start.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-13, msg=key)
        moved = max(moved, float((p - p0).detach().abs().max()))
    assert moved > 1e-4  # the step changed the weights
    if plain == "lora":
        assert not ours.get_output_embeddings().weight.requires_grad


def test_stack_rejects_two_losses_and_roam():
    class OtherLoss(Method):
        paper = "another loss"

        def loss(self, model, batch):
            return logits_loss(model, batch)

    with pytest.raises(MethodError, match="chunked_ce and test_chunked_ce both provide loss"):
        Stack([load("chunked_ce"), OtherLoss()])
    with pytest.raises(MethodError, match="cannot be stacked with roam"):
        load("roam+chunked_ce")


def test_a_stack_delegates_the_loss_to_its_member(calls):
    stack = load("checkpointing+chunked_ce@chunk=5")
    b = batch()
    m = stack.transform_model(model("llama-tiny")[0])
    got = stack.loss(m, b)
    assert calls == [33]
    torch.testing.assert_close(got, logits_loss(model("llama-tiny")[0], b), rtol=1e-13, atol=0)
    plain = load("checkpointing").loss(m, b)  # the default: the logits' loss, whatever the model holds
    assert calls == [33]
    torch.testing.assert_close(plain, got, rtol=1e-13, atol=0)


def test_refuses_a_model_it_cannot_read():
    m, method = model("llama-tiny", spec="chunked_ce")

    class Scaled(torch.nn.Module):  # changes the logits after the head (as soft-capping does)
        def __init__(self):
            super().__init__()
            self.inner = m

        def get_output_embeddings(self):
            return m.get_output_embeddings()

        def forward(self, input_ids):
            return types.SimpleNamespace(logits=self.inner(input_ids=input_ids).logits / 2)

    with pytest.raises(MethodError, match="does not return its head's output"):
        method.loss(Scaled(), batch())
    assert "forward" not in vars(m.get_output_embeddings())  # the head is restored
    m.lm_head = torch.nn.Sequential(m.lm_head)
    with pytest.raises(MethodError, match="torch.nn.Linear, not Sequential"):
        lm_loss(m, batch())


# -- memory --------------------------------------------------------------------------------

BIG = "llama-d64-l1-v8192"  # vocabulary 128 times the width


def loss_memory(spec, dtype, n=4, t=32):
    """Bytes the loss adds over the model (tracker, real tensors): forward peak, kept for
    backward (at the end of the forward), backward peak; each above the start."""
    m, method = model(BIG, dtype, spec)
    b = lm_batch(n, t, 8192)
    tracker = MemoryTracker()
    tracker.register_model(m)
    tracker.register(b.values(), "other")
    with tracker:
        start = tracker.current
        loss = lm_loss(m, b)
        forward, kept = tracker.peak - start, tracker.current - start
        tracker.reset_peak()
        loss.backward()
        backward = tracker.peak - start
    return forward, kept, backward, method


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_report_states_what_the_tracker_measures(dtype):
    """The report's bytes per token per vocabulary entry, against the tracker: the plain
    loss's forward peak, what it keeps and its backward peak above what chunked_ce keeps
    (the model's activations, the same in both, plus one log-sum-exp per token), and
    chunked_ce's forward transient of one chunk."""
    n, vocab, chunk = 128, 8192, 16
    nv = n * vocab
    per = bytes_per_token_per_vocab(dtype)
    f = 4  # the loss precision of float32 and bfloat16 models
    base_fwd, base_kept, base_bwd, _ = loss_memory("adamw", dtype)
    fwd, kept, bwd, method = loss_memory(f"chunked_ce@chunk={chunk}", dtype)
    model_kept = kept - f * n  # the model's own activations (and the loss scalar)
    scalars = 16  # nll_loss's total weight and the like: a few 0-d tensors
    assert abs(base_kept - model_kept - per["baseline_kept_for_backward"] * nv) <= scalars
    assert abs(base_fwd - model_kept - per["baseline_forward_peak"] * nv) <= scalars
    assert abs(base_bwd - model_kept - per["baseline_backward_peak"] * nv) <= scalars
    # chunked_ce keeps no logits, and its forward holds one chunk's (plus per-token vectors:
    # labels' mask and targets, 9 bytes, the picked logits, f, and per-chunk row vectors)
    assert per["chunked_ce_kept_for_backward"] == 0
    transient = fwd - kept
    chunk_bytes = per["chunked_ce_chunk"] * chunk * vocab
    assert chunk_bytes <= transient <= chunk_bytes + n * (9 + f) + 4 * chunk * f
    assert transient < nv * (2 if dtype == torch.bfloat16 else 4)  # never the whole logits
    report = method.report
    assert report["bytes_per_token_per_vocab"]["float32"] == bytes_per_token_per_vocab(torch.float32)
    assert report["bytes_per_token_per_vocab"]["bfloat16"] == bytes_per_token_per_vocab(torch.bfloat16)
    assert report["baseline_backward_peak_bytes"] == 12 * nv and report["chunked_ce_kept_bytes"] == f * n
    assert report["chunked_ce_chunk_bytes"] == chunk_bytes
    assert report["weight_grad_buffer_bytes"] == (8192 * 64 * 4 if dtype == torch.bfloat16 else 0)
    assert "backward peak 12" in report["baseline"]


def test_memory_job_peak_drops_by_the_logits_and_simulates_byte_for_byte(tiny_job):
    """A memory job on a shape whose vocabulary is 256 times its width. The plain loss's
    peak holds three float32 N x V tensors (12 N V bytes) beside the persistent state and
    the model's activations. chunked_ce's peak is in its loss's backward or in the
    optimizer step, and holds beyond the same state and activations at most every gradient
    and AdamW's one parameter-sized temporary (2 P 4 bytes), one chunk (c V 4), the hidden
    states' gradient (N H 4) and the log-sum-exps (N 4): below one N x V float32 tensor on
    this shape, so the peak drops by more than two whole float32 logits. The simulated tier
    equals the tracked one."""
    name, n, t, chunk = "llama-d64-l1-v16384", 4, 128, 64
    tokens, vocab, width = n * t, models.vocab_size(name), models.shape(name)[0]
    job = dict(model=name, batch_size=n, seq_len=t)
    base = runner.run(tiny_job(method="adamw", **job))
    ours = runner.run(tiny_job(method=f"chunked_ce@chunk={chunk}", **job))
    fake = runner.run(tiny_job(method=f"chunked_ce@chunk={chunk}", simulate=True, **job))
    assert base["status"] == ours["status"] == fake["status"] == "ok", (ours.get("message"), fake.get("message"))
    logits = 4 * tokens * vocab
    base_mem, mem = base["memory"], ours["memory"]
    assert base_mem["activation_bytes"] + base_mem["other_bytes"] >= 3 * logits  # the plain loss's peak
    beyond = 2 * 4 * base["n_params"] + 4 * chunk * vocab + 4 * tokens * width + 4 * tokens
    assert beyond < logits  # the premise, from the shape
    drop = base_mem["peak_bytes"] - mem["peak_bytes"]
    assert drop >= 3 * logits - beyond > 2 * logits
    assert mem["param_bytes"] == base_mem["param_bytes"] and mem["optimizer_bytes"] == base_mem["optimizer_bytes"]
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "other_bytes", "peak_bytes"):
        assert fake["memory"][key] == mem[key], key
    assert fake["method_report"] == ours["method_report"]
    assert ours["loss"] == pytest.approx(base["loss"], rel=1e-5)

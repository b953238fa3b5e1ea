"""Activation checkpointing's policies (methods/checkpointing.py): `full` as it always was;
`selective` computes what no checkpointing computes, keeps per block exactly the outputs of
its matmuls and attention (found here from the ops that run), and its memory lies between."""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bench import models
from bench.job import Job
from bench.measure import runner
from bench.measure.tracker import MemoryTracker
from bench.method import MethodError, lm_loss, load
from conftest import lm_batch

MODELS = ["gpt2-tiny", "bert-tiny", "llama-tiny"]
SELECTIVE = "checkpointing@policy=selective"


def build(name, spec=None, attn="sdpa", dropout=None, dtype=torch.float32):
    torch.manual_seed(0)
    model = models.build(name, attn, dropout).to(dtype)
    if spec:
        model = load(spec).transform_model(model)
    return model.train()


def blocks_of(model):
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


# -- the option -------------------------------------------------------------------------------------

def test_the_default_is_full_checkpointing_as_before():
    method = load("checkpointing")
    assert method.name == "checkpointing" and method.hp["policy"] == "full"
    model = method.transform_model(build("gpt2-tiny"))
    for block in blocks_of(model):  # torch's checkpoint, non-reentrant, nothing else
        fn = block._gradient_checkpointing_func
        assert fn.func is torch.utils.checkpoint.checkpoint and fn.keywords == {"use_reentrant": False}
    selective = load(SELECTIVE)
    assert selective.hp["policy"] == "selective"  # results name it as the job does: SELECTIVE
    with pytest.raises(MethodError, match="option 'policy' must be one of \"full\", \"selective\""):
        load("checkpointing@policy=some")


# -- the same numbers ---------------------------------------------------------------------------------

def loss_and_grads(name, spec, attn, dtype):
    model = build(name, spec, attn, dtype=dtype)  # the family's own dropout: recomputed with its RNG state
    torch.manual_seed(1)
    loss = lm_loss(model, lm_batch(4, 32))
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", MODELS)
def test_selective_gives_the_loss_and_gradients_of_no_checkpointing(name, attn):
    plain_loss, plain = loss_and_grads(name, None, attn, torch.float32)
    loss, grads = loss_and_grads(name, SELECTIVE, attn, torch.float32)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(g, p) for g, p in zip(grads, plain))
    # in float64 a gradient summed from two uses (a tied embedding) may sum in another order
    plain_loss, plain = loss_and_grads(name, None, attn, torch.float64)
    loss, grads = loss_and_grads(name, SELECTIVE, attn, torch.float64)
    assert torch.equal(loss, plain_loss)
    for g, p in zip(grads, plain):
        torch.testing.assert_close(g, p, rtol=1e-12, atol=1e-15)


# -- what a block keeps -------------------------------------------------------------------------------

def is_matmul_or_attention(name: str) -> bool:
    return name in ("mm", "addmm", "bmm", "linear") or "attention" in name


class NewStorages(TorchDispatchMode):
    """Every storage an op makes (not one it only views), by the block running then:
    `made[block]` = [(storage key, op name, bytes, weak reference)] (a key is an address:
    a storage made later may have a freed one's)."""

    def __init__(self):
        super().__init__()
        self.block = None
        self.made: dict = {}
        self._seen: dict = {}

    def _new(self, storage) -> bool:
        ref = self._seen.get(storage._cdata)
        if ref is not None and ref() is not None:
            return False
        self._seen[storage._cdata] = weakref.ref(storage)
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs))[0]:  # made before, or outside the mode
            if isinstance(t, torch.Tensor):
                self._new(t.untyped_storage())
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and self._new(t.untyped_storage()) and self.block is not None:
                s = t.untyped_storage()
                self.made.setdefault(self.block, []).append(
                    (s._cdata, func._overloadpacket.__name__, s.nbytes(), weakref.ref(s)))
        return out


def forward_by_block(model):
    """Run a forward; per block, (what it made that is alive after the forward, but its
    output) and (the outputs of its matmul and attention ops), each as sorted (op, bytes)."""
    mode, outputs = NewStorages(), {}
    for i, block in enumerate(blocks_of(model)):
        block.register_forward_pre_hook(lambda m, a, i=i: setattr(mode, "block", i))

        def done(m, a, out, i=i):
            mode.block = None
            outputs[i] = {t.untyped_storage()._cdata for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
        block.register_forward_hook(done)
    with mode:
        loss = lm_loss(model, lm_batch(4, 32))
    kept, computed = {}, {}
    for i, made in mode.made.items():
        kept[i] = sorted((op, n) for key, op, n, ref in made if ref() is not None and key not in outputs[i])
        computed[i] = sorted((op, n) for _, op, n, _ in made if is_matmul_or_attention(op))
    return loss, kept, computed


@pytest.mark.parametrize("name,attn", [(m, "sdpa") for m in MODELS] + [("gpt2-tiny", "eager")])
def test_selective_keeps_exactly_each_blocks_matmul_and_attention_outputs(name, attn):
    _, _, reference = forward_by_block(build(name, None, attn, dropout=0.0))  # no checkpointing
    _, kept, _ = forward_by_block(build(name, SELECTIVE, attn, dropout=0.0))
    _, kept_full, _ = forward_by_block(build(name, "checkpointing", attn, dropout=0.0))
    n_blocks = len(blocks_of(build(name)))
    assert sorted(reference) == sorted(kept) == list(range(n_blocks))
    for i in range(n_blocks):
        assert kept[i] == reference[i], i  # count and bytes of every kept storage
        assert kept_full.get(i, []) == []  # full keeps nothing the block made
    ops = {op for op, _ in reference[0]}
    assert ops & {"mm", "addmm"} and any("attention" in op or op == "bmm" for op in ops)


@pytest.mark.parametrize("name", MODELS)
def test_the_tracker_counts_what_selective_keeps_as_activations(name):
    """After the forward, selective holds the matmul and attention outputs beside what full
    checkpointing holds, and the memory tracker calls them activations."""
    _, _, reference = forward_by_block(build(name, None, dropout=0.0))
    kept_bytes = sum(n for ops in reference.values() for _, n in ops)
    splits = {}
    for spec in ("checkpointing", SELECTIVE):
        model = build(name, spec, dropout=0.0)
        tracker = MemoryTracker()
        tracker.register_model(model)
        with tracker:
            loss = lm_loss(model, lm_batch(4, 32))
            splits[spec] = tracker.live_split()
            loss.backward()
        del loss
    full, selective = splits["checkpointing"], splits[SELECTIVE]
    assert selective.activation - full.activation == kept_bytes
    assert (selective.other, selective.param, selective.grad) == (full.other, full.param, full.grad)


# -- memory -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_selective_peak_lies_between_full_and_none(name):
    records = {}
    for spec in ("adamw", "checkpointing", SELECTIVE):
        records[spec] = runner.run(Job(kind="memory", method=spec, model=name, batch_size=16, seq_len=64,
                                       dropout=0.0))
        assert records[spec]["status"] == "ok", records[spec].get("message")
    none, full, sel = (records[s]["memory"] for s in ("adamw", "checkpointing", SELECTIVE))
    assert full["peak_bytes"] < sel["peak_bytes"] < none["peak_bytes"]
    assert full["activation_bytes"] < sel["activation_bytes"] < none["activation_bytes"]
    assert records[SELECTIVE]["loss"] == records["adamw"]["loss"]


@pytest.mark.parametrize("name", MODELS)
def test_selective_simulates_as_it_runs(tiny_job, name):
    real = runner.run(tiny_job(model=name, method=SELECTIVE))
    fake = runner.run(tiny_job(model=name, method=SELECTIVE, simulate=True))
    assert real["status"] == fake["status"] == "ok", (real.get("message"), fake.get("message"))
    r, f = real["memory"], fake["memory"]
    for c in ("param", "grad", "optimizer", "other"):
        assert f[f"{c}_bytes"] == r[f"{c}_bytes"], c
    if name == "bert-tiny":
        assert f["activation_bytes"] == r["activation_bytes"] and f["peak_bytes"] == r["peak_bytes"]
    else:
        # as for full checkpointing (tests/methods/test_simulated.py): on fake tensors Hugging
        # Face materialises the causal mask (batch x seq x seq booleans), which checkpointing
        # keeps for the recomputation; the simulated peak is higher by whole masks, nothing else
        mask = 4 * 32 * 32
        diff = f["peak_bytes"] - r["peak_bytes"]
        assert diff == f["activation_bytes"] - r["activation_bytes"]
        assert diff % mask == 0 and 0 <= diff <= 8 * mask

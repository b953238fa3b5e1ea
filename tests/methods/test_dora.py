"""DoRA (methods/dora.py) against the paper's formula, Hugging Face peft and its own byte formulas."""
import weakref

import pytest
import torch

from bench import models
from bench.job import CATEGORIES
from bench.measure import runner
from bench.method import MethodError, load
from conftest import lm_batch
from methods.dora import DoRALinear

peft = pytest.importorskip("peft")

MODELS = ["gpt2-tiny", "bert-tiny", "llama-tiny"]


def base_model(name, dtype=torch.float64):
    torch.manual_seed(0)
    return models.build(name, dropout=0.0).to(dtype)


def batch(name, n=2, t=16):
    return lm_batch(n, t, models.vocab_size(name), seed=1)


def layers(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, DoRALinear)]


def loss_of(model, b):
    logits = model(input_ids=b["input_ids"]).logits
    return logits, torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)


@pytest.mark.parametrize("name", MODELS)
def test_init_magnitude_is_the_row_norm_and_the_model_is_the_base(name):
    b = batch(name)
    want = base_model(name)(input_ids=b["input_ids"]).logits
    method = load("dora")
    dora = method.transform_model(base_model(name))
    r = method.hp["rank"]
    expected = 0
    for _, module in layers(dora):
        w = module.base_layer.weight
        w = w.T if module.fan_in_fan_out else w  # Conv1D: (d_in, d_out)
        d_out, d_in = w.shape
        expected += r * (d_in + d_out) + d_out
        torch.testing.assert_close(module.lora_magnitude_vector.weight, w.norm(dim=1), rtol=0, atol=0)
        assert module.lora_B.weight.eq(0).all() and not w.requires_grad
    trainable = [n for n, p in dora.named_parameters() if p.requires_grad]
    assert all(n.rsplit(".", 2)[-2] in ("lora_A", "lora_B", "lora_magnitude_vector") for n in trainable)
    assert len(trainable) == 3 * len(layers(dora))
    assert sum(p.numel() for p in dora.parameters() if p.requires_grad) == expected == method.report["trainable_params"]
    # m / ||W + s B A|| is exactly 1 while B = 0: the base model's outputs, bit for bit
    torch.testing.assert_close(dora(input_ids=b["input_ids"]).logits, want, rtol=0, atol=0)


def randomize(module, g):
    with torch.no_grad():
        module.lora_A.weight.copy_(torch.randn(module.lora_A.weight.shape, generator=g, dtype=torch.float64) * 0.1)
        module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=g, dtype=torch.float64) * 0.1)
        m = module.lora_magnitude_vector.weight
        m.mul_(1 + 0.1 * torch.randn(m.shape, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("conv1d", [False, True])
def test_layer_is_the_papers_formula_with_the_norm_detached(conv1d):
    """Eq. 5 with Section 4.3's constant norm, written independently: y = m (W + s B A) x / ||W + s B A||_c + b."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(3)
    base = (Conv1D(24, 12) if conv1d else torch.nn.Linear(12, 24)).double().requires_grad_(False)
    layer = DoRALinear(base, rank=4, alpha=6.0, dropout=0.0)
    randomize(layer, torch.Generator().manual_seed(4))
    x = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(3, 5, 24, dtype=torch.float64)
    layer(x).backward(dy)

    W = base.weight.T if conv1d else base.weight
    A, B, m = (p.detach().clone().requires_grad_() for p in
               (layer.lora_A.weight, layer.lora_B.weight, layer.lora_magnitude_vector.weight))
    x2 = x.detach().clone().requires_grad_()
    V = W + 1.5 * B @ A
    y = (x2 @ V.T) * (m / V.norm(dim=1).detach()) + base.bias
    y.backward(dy)
    torch.testing.assert_close(layer(x).detach(), y.detach(), rtol=1e-12, atol=1e-12)
    for mine, ref in ((layer.lora_A.weight, A), (layer.lora_B.weight, B), (layer.lora_magnitude_vector.weight, m),
                      (x, x2)):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-10, atol=1e-12)
    assert base.weight.grad is None and base.bias.grad is None


def peft_pair(name, dropout=0.0, targets="all-linear"):
    """Our DoRA model and peft's on the same base weights, with the same random A, B, m."""
    hp = {"rank": 4, "alpha": 8.0, "dropout": dropout, "targets": targets}
    ours = load("dora", hp).transform_model(base_model(name))
    theirs = load("dora_peft", hp).transform_model(base_model(name))
    g = torch.Generator().manual_seed(2)
    for full, module in layers(ours):
        layer = theirs.base_model.model.get_submodule(full)
        m = layer.lora_magnitude_vector["default"].weight
        torch.testing.assert_close(module.lora_magnitude_vector.weight, m, rtol=0, atol=0)  # the same init
        randomize(module, g)
        with torch.no_grad():
            layer.lora_A["default"].weight.copy_(module.lora_A.weight)
            layer.lora_B["default"].weight.copy_(module.lora_B.weight)
            m.copy_(module.lora_magnitude_vector.weight)
        assert layer.scaling["default"] == module.scaling
        assert layer.lora_magnitude_vector["default"].fan_in_fan_out == module.fan_in_fan_out
    return ours, theirs


@pytest.mark.parametrize("name,dropout", [("gpt2-tiny", 0.0), ("bert-tiny", 0.0), ("llama-tiny", 0.0),
                                          ("gpt2-tiny", 0.1), ("llama-tiny", 0.1)])
def test_equals_peft_outputs_and_adapter_gradients_fp64(name, dropout):
    ours, theirs = peft_pair(name, dropout)
    b = batch(name)
    outs = []
    for model in (ours, theirs):
        torch.manual_seed(7)  # the same dropout masks (drawn in the same order)
        logits, loss = loss_of(model, b)
        loss.backward()
        outs.append(logits.detach())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    mine = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    peers = {n.replace(".default", "").replace("base_model.model.", ""): p.grad
             for n, p in theirs.named_parameters() if p.requires_grad}
    assert list(mine) == list(peers) and len(mine) == 3 * len(layers(ours))  # same parameters, same order
    for key in mine:
        assert mine[key] is not None and mine[key].abs().sum() > 0, key
        torch.testing.assert_close(mine[key], peers[key], rtol=1e-10, atol=1e-12)
    for model in (ours, theirs):  # frozen base: no gradient anywhere else
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert not torch.allclose(outs[0], base_model(name)(input_ids=b["input_ids"]).logits)  # it can fail


def saved(fn):
    """(bytes alive after fn() returns, bytes packed while it ran) of what autograd saved,
    each storage once, parameters left out. Packed tensors are kept detached, so that a
    graph dropped by a detach is freed at once (a saved output kept as it is would keep its
    own graph alive in a reference cycle)."""
    params = set()
    packed, latest = [], {}  # [(bytes, weakref to the storage)]; storage key -> its index

    def pack(t):
        storage = t.untyped_storage()
        key = storage._cdata
        seen = latest.get(key)
        # a key seen before names the same storage only while that one lives (addresses are reused)
        if key not in params and (seen is None or packed[seen][1]() is None):
            latest[key] = len(packed)
            packed.append((storage.nbytes(), weakref.ref(storage)))
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(params)
    kept = sum(n for n, ref in packed if ref() is not None)
    del out
    return kept, sum(n for n, _ in packed)


@pytest.mark.parametrize("kind,x_grad,dropout", [("linear", True, 0.0), ("linear-no-bias", False, 0.0),
                                                 ("conv1d", True, 0.0), ("conv1d", False, 0.0),
                                                 ("linear", True, 0.25)])
def test_saved_bytes_equal_the_stated_formula(kind, x_grad, dropout):
    """The module docstring: beyond LoRA's x and A x, b and l (N d_out each), n and k, and
    k - 1 where x requires grad, alive until backward; the identity, A(I) and (Conv1D)
    W + s B A packed in forward and freed with it. CPU dropout adds its mask (x's dtype)."""
    from transformers.pytorch_utils import Conv1D

    d_in, d_out, r, n_tok, e = 16, 24, 4, 2 * 5, 8
    torch.manual_seed(0)
    base = {"linear": torch.nn.Linear(d_in, d_out), "linear-no-bias": torch.nn.Linear(d_in, d_out, bias=False),
            "conv1d": Conv1D(d_out, d_in)}[kind].double().requires_grad_(False)
    layer = DoRALinear(base, rank=r, alpha=8.0, dropout=dropout).train()
    x = torch.randn(2, 5, d_in, dtype=torch.float64, requires_grad=x_grad)

    def run(params):
        params.update(p.untyped_storage()._cdata for p in layer.parameters())
        return layer(x)

    kept, packed = saved(run)
    mask = n_tok * d_in if dropout and x_grad else 0
    # A's input (x, or x_d when p > 0), A's output, b, l, n, k, and k - 1 where x requires grad
    want_kept = e * (n_tok * d_in + mask + n_tok * r + 2 * n_tok * d_out + 2 * d_out + x_grad * d_out)
    assert kept == want_kept
    transient = d_in * d_in + d_in * r + (d_out * d_in if kind == "conv1d" else 0)
    assert packed == want_kept + e * transient


def test_targets_by_name_and_errors():
    ours, theirs = peft_pair("llama-tiny", targets="q_proj|v_proj")
    b = batch("llama-tiny")
    torch.testing.assert_close(ours(input_ids=b["input_ids"]).logits, theirs(input_ids=b["input_ids"]).logits,
                               rtol=1e-12, atol=1e-12)
    assert sum(p.numel() for p in ours.parameters() if p.requires_grad) == \
        sum(p.numel() for p in theirs.parameters() if p.requires_grad) == 2 * 2 * (4 * (128 + 128) + 128)
    with pytest.raises(MethodError, match="dora: targets c_attn select no linear layer"):
        load("dora@targets=c_attn").transform_model(base_model("llama-tiny"))
    for bad in ({"rank": 0}, {"alpha": 0.0}, {"dropout": 1.0}):
        with pytest.raises(MethodError, match=next(iter(bad))):
            load("dora_peft", bad)


@pytest.mark.parametrize("name", MODELS)
def test_dora_and_peft_jobs_equal_bytes_by_category(tiny_job, name):
    ours = runner.run(tiny_job(model=name, method="dora"))
    theirs = runner.run(tiny_job(model=name, method="dora_peft"))
    lora = runner.run(tiny_job(model=name, method="lora"))
    assert ours["status"] == theirs["status"] == lora["status"] == "ok", (ours.get("message"), theirs.get("message"))
    for c in CATEGORIES:
        assert ours["memory"][f"{c}_bytes"] == theirs["memory"][f"{c}_bytes"], c
    assert ours["memory"]["peak_bytes"] == theirs["memory"]["peak_bytes"]
    assert ours["loss"] == theirs["loss"]  # same seed: peft draws the same A
    assert ours["n_params"] == theirs["n_params"] and ours["trainable_params"] == theirs["trainable_params"]
    n = ours["method_report"]["layers"]
    d_out = ours["trainable_params"] - lora["trainable_params"]  # one magnitude per output feature
    assert 0 < d_out < lora["trainable_params"] / 4
    # AdamW's two float32 moments per trainable parameter (+ a 4-byte step per tensor: A, B, m)
    assert ours["memory"]["optimizer_bytes"] == 8 * ours["trainable_params"] + 4 * 3 * n
    assert ours["memory"]["param_bytes"] == lora["memory"]["param_bytes"] + 4 * d_out
    assert ours["memory"]["activation_bytes"] > 1.5 * lora["memory"]["activation_bytes"]


def test_stack_with_checkpointing_runs(tiny_job):
    alone = runner.run(tiny_job(method="dora"))
    record = runner.run(tiny_job(method="dora+checkpointing"))
    assert record["status"] == "ok", record.get("message")
    assert record["trainable_params"] == alone["trainable_params"]
    assert record["memory"]["activation_bytes"] < alone["memory"]["activation_bytes"]

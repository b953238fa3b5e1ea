"""Approx-BP's memory-sharing norms: gradients against autograd on the layers they replace
(float64, gradcheck), the zero-weight guards, whole tiny models, and the bytes they save
(the saved output is the storage the next Linear keeps: counted once)."""
import copy

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from bench import models
from bench.measure import runner
from bench.method import Method, lm_loss
from methods.approx_bp import norms as N
from conftest import lm_batch

F64 = torch.float64


class RefRMSNorm(nn.Module):
    """RMSNorm written out for autograd, in the input's precision (the float64 reference)."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.variance_epsilon

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def grads(module, x, dy):
    module.zero_grad()
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad.clone() for p in module.parameters()]


def layer_norm(h=32, weight=None, affine=True, seed=0):
    torch.manual_seed(seed)
    ln = nn.LayerNorm(h, eps=1e-5, elementwise_affine=affine).to(F64)
    if affine:
        with torch.no_grad():
            ln.weight.copy_(torch.randn(h, dtype=F64) if weight is None else weight)
            ln.bias.normal_()
    return ln, N.MSLayerNorm.from_layer_norm(copy.deepcopy(ln))


def rms_norm(h=32, weight=None, seed=0):
    torch.manual_seed(seed)
    norm = LlamaRMSNorm(h, eps=1e-6).to(F64)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(h, dtype=F64) if weight is None else weight)
    return RefRMSNorm(norm), N.MSRMSNorm.from_rms_norm(copy.deepcopy(norm))


def inputs(shape=(3, 7, 32), seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=F64) * 2 + 0.5
    return x, torch.randn(shape, generator=g, dtype=F64)


# -- layers against autograd ------------------------------------------------------------------


@pytest.mark.parametrize("affine", [True, False])
def test_ms_layernorm_float64_equals_layernorm(affine):
    ln, ms = layer_norm(affine=affine)
    x, dy = inputs()
    got, ref = grads(ms, x, dy), grads(ln, x, dy)
    assert len(got) == len(ref) == (4 if affine else 2)
    assert torch.equal(got[0], ref[0])  # the same forward kernel, bit for bit
    for g, r in zip(got[1:], ref[1:]):  # dx, dw, db
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_ms_rmsnorm_float64_equals_rmsnorm():
    ref, ms = rms_norm()
    x, dy = inputs()
    got, want = grads(ms, x, dy), grads(ref, x, dy)
    torch.testing.assert_close(got[0], want[0], rtol=1e-14, atol=0)
    for g, r in zip(got[1:], want[1:]):  # dx, dw
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_gradcheck():
    x, _ = inputs((2, 3, 16))
    w = torch.randn(16, dtype=F64, requires_grad=True)
    b = torch.randn(16, dtype=F64, requires_grad=True)
    x.requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w, b: N.MSLayerNormFunction.apply(x, w, b, (16,), 1e-5), (x, w, b))
    assert torch.autograd.gradcheck(lambda x: N.MSLayerNormFunction.apply(x, None, None, (16,), 1e-5), (x,))
    for k in (0, 1, 3):
        assert torch.autograd.gradcheck(lambda x, w: N.MSRMSNormFunction.apply(x, w, 1e-6, k), (x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ms_rmsnorm_forward_is_hugging_faces_bit_for_bit(dtype):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(64).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    ms = N.MSRMSNorm.from_rms_norm(norm)
    x = torch.randn(4, 9, 64, dtype=dtype)
    assert torch.equal(ms(x), norm(x))
    got, ref = grads(ms, x, torch.ones_like(x)), grads(norm, x, torch.ones_like(x))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    for g, r in zip(got[1:], ref[1:]):
        assert g.dtype == r.dtype == dtype
        torch.testing.assert_close(g.float(), r.float(), **tol)


def test_modules_keep_the_parameter_objects():
    ln = nn.LayerNorm(8)
    ms = N.MSLayerNorm.from_layer_norm(ln)
    assert ms.weight is ln.weight and ms.bias is ln.bias
    rms = LlamaRMSNorm(8)
    msr = N.MSRMSNorm.from_rms_norm(rms)
    assert msr.weight is rms.weight and list(msr.parameters()) == [rms.weight]


# -- zero weights ---------------------------------------------------------------------------


def test_ms_layernorm_one_zero_weight_is_exact():
    w = torch.randn(32, dtype=F64, generator=torch.Generator().manual_seed(3))
    w[5] = 0.0
    ln, ms = layer_norm(weight=w)
    x, dy = inputs()
    got, ref = grads(ms, x, dy), grads(ln, x, dy)
    for g, r in zip(got[1:], ref[1:]):  # x_hat of column 5 from the rows' zero mean
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    assert ref[2][5].abs() > 1e-3  # dw_5 is not trivially 0


def test_ms_rmsnorm_smallest_weight_column_is_exact():
    w = torch.randn(32, dtype=F64, generator=torch.Generator().manual_seed(3))
    w[7] = 0.0
    ref, ms = rms_norm(weight=w)
    x, dy = inputs()
    got, want = grads(ms, x, dy), grads(ref, x, dy)
    for g, r in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)
    ms.exact_columns = 0  # without the kept column: column 7 is lost, the rest stays exact
    got = grads(ms, x, dy)
    assert (got[1][..., 7] - want[1][..., 7]).abs().max() > 1e-3
    keep = torch.arange(32) != 7
    torch.testing.assert_close(got[2][keep], want[2][keep], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("make", [layer_norm, rms_norm])
def test_several_zero_or_tiny_weights_stay_finite(make):
    w = torch.randn(32, dtype=F64, generator=torch.Generator().manual_seed(4))
    w[[2, 9, 20]] = 0.0
    w[11] = 1e-300  # divides a rounding error of y into ~1e284 without the clamp
    ref, ms = make(weight=w)
    x, dy = inputs()
    got, want = grads(ms, x, dy), grads(ref, x, dy)
    assert all(torch.isfinite(t).all() for t in got)
    fine = torch.ones(32, dtype=torch.bool)
    fine[[2, 9, 11, 20]] = False
    # every column whose w is well away from 0 keeps an exact dw
    torch.testing.assert_close(got[2][fine], want[2][fine], rtol=1e-8, atol=1e-8)


# -- whole models ---------------------------------------------------------------------------


def build(name, dtype=F64):
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = models.build(name, dropout=0.0).to(dtype)
    return model


def use_reference_rmsnorm(model):
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is LlamaRMSNorm:
                setattr(parent, name, RefRMSNorm(child))
    return model


def loss_and_grads(model, batch):
    model.zero_grad()
    loss = lm_loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name, count", [("gpt2-tiny", {"LayerNorm": 5}), ("bert-tiny", {"LayerNorm": 6}),
                                         ("llama-tiny", {"LlamaRMSNorm": 5})])
def test_swapped_tiny_model_float64_same_loss_and_gradients(name, count):
    base = build(name)
    if name.startswith("llama"):
        use_reference_rmsnorm(base)  # Hugging Face's RMSNorm rounds to float32 inside
    swapped = copy.deepcopy(base) if not name.startswith("llama") else build(name)
    report = N.swap_norms(swapped)
    assert report == count
    assert N.swap_norms(swapped) == count  # swapping again changes nothing
    batch = lm_batch(2, 16)
    loss_ref, grads_ref = loss_and_grads(base, batch)
    loss, grads_ms = loss_and_grads(swapped, batch)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-13, atol=0)
    assert grads_ms.keys() == grads_ref.keys() and len(grads_ms) == len(list(base.parameters()))
    for key in grads_ref:
        torch.testing.assert_close(grads_ms[key], grads_ref[key], rtol=1e-9, atol=1e-12, msg=key)


def test_swapped_llama_float32_loss_is_bit_identical():
    base = build("llama-tiny", torch.float32)
    swapped = copy.deepcopy(base)
    N.swap_norms(swapped)
    batch = lm_batch(2, 16)
    loss_ref, grads_ref = loss_and_grads(base, batch)
    loss, grads_ms = loss_and_grads(swapped, batch)
    assert torch.equal(loss, loss_ref)
    for key in grads_ref:
        torch.testing.assert_close(grads_ms[key], grads_ref[key], rtol=1e-4, atol=1e-6, msg=key)


def test_other_norms_are_reported_not_swapped():
    model = nn.Sequential(nn.LayerNorm(4), nn.GroupNorm(2, 4), nn.RMSNorm(4))
    assert N.swap_norms(model) == {"LayerNorm": 1, "not_swapped": {"GroupNorm": 1, "RMSNorm": 1}}
    assert type(model[0]) is N.MSLayerNorm and type(model[2]) is nn.RMSNorm


# -- memory -----------------------------------------------------------------------------------


def saved_storages(model, batch):
    """Per storage saved for backward during the forward (parameters left out): its bytes and
    how many times it was saved."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen = {}

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params:
            n, count = seen.get(key, (t.untyped_storage().nbytes(), 0))
            seen[key] = (n, count + 1)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model, batch)
    return seen, loss


# bytes per token and norm that a norm stops saving (H = 128 in every tiny model):
#   LayerNorm: x and the mean; RMSNorm: x in float32 and x_hat (float32: x itself too),
#   less the kept x_hat column (and its index, 8 bytes per norm)
SAVED_PER_TOKEN = {
    ("gpt2-tiny", torch.float32): 5 * (128 * 4 + 4), ("gpt2-tiny", torch.bfloat16): 5 * (128 * 2 + 2),
    ("bert-tiny", torch.float32): 6 * (128 * 4 + 4), ("bert-tiny", torch.bfloat16): 6 * (128 * 2 + 2),
    ("llama-tiny", torch.float32): 5 * (2 * 128 * 4 - 4), ("llama-tiny", torch.bfloat16): 5 * (128 * (4 + 2) - 2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "llama-tiny"])
def test_saved_output_is_the_next_layers_storage(name, dtype):
    """Each swapped norm's output storage is saved by the norm AND by the op after it (so
    it costs nothing extra), and the saved bytes drop by exactly the norm's own input."""
    model = build(name, dtype)
    batch = lm_batch(4, 32)
    before, loss_before = saved_storages(model, batch)
    N.swap_norms(model)
    outputs = []
    hooks = [m.register_forward_hook(lambda m, i, o: outputs.append(o.untyped_storage()._cdata))
             for m in model.modules() if isinstance(m, (N.MSLayerNorm, N.MSRMSNorm))]
    after, loss_after = saved_storages(model, batch)
    for h in hooks:
        h.remove()
    assert torch.equal(loss_after, loss_before)
    assert len(outputs) == len(hooks) > 0
    assert all(after[key][1] >= 2 for key in outputs)  # the norm's save and its consumer's
    dropped = sum(n for n, _ in before.values()) - sum(n for n, _ in after.values())
    n_norms = len(hooks)
    assert dropped == 4 * 32 * SAVED_PER_TOKEN[name, dtype] - 8 * n_norms * name.startswith("llama")


class MSNorms(Method):
    """The norms alone as a method (Approx-BP proper also swaps the activations)."""
    paper = "Yang, Shi, Wang, Zhen, Shi, Xu, ICML 2024"

    def transform_model(self, model):
        self.report = N.swap_norms(model)
        return model


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_tracked_activation_bytes_drop_and_simulation_matches(tiny_job, name):
    base = runner.run(tiny_job(batch_size=16, seq_len=64, model=name))
    real = runner.run(tiny_job(batch_size=16, seq_len=64, model=name), method=MSNorms())
    fake = runner.run(tiny_job(batch_size=16, seq_len=64, model=name, simulate=True), method=MSNorms())
    assert base["status"] == real["status"] == fake["status"] == "ok", (real["message"], fake["message"])
    for c in ("param", "grad", "optimizer", "activation", "other", "peak"):
        assert fake["memory"][f"{c}_bytes"] == real["memory"][f"{c}_bytes"], c
    assert real["loss"] == pytest.approx(base["loss"], rel=1e-6)  # float32 rounding order
    drop = base["memory"]["activation_bytes"] - real["memory"]["activation_bytes"]
    assert drop > 0 and base["memory"]["peak_bytes"] - real["memory"]["peak_bytes"] > 0
    assert real["method_report"] == ({"LayerNorm": 5} if name.startswith("gpt2") else {"LlamaRMSNorm": 5})

"""Mesa-style 8-bit saved activations: the quantizer's half-step bound, a Linear's gradient
error within its derived bound, what is kept unquantized (parameters, integers), sharing,
whole tiny models (tracked bytes, simulated == tracked) and stacking."""
import copy

import pytest
import torch
from torch import nn

from bench import models
from bench.measure import runner
from bench.measure.tracker import MemoryTracker, cuda_kernels
from bench.method import lm_loss, load
from methods import mesa8bit as M
from conftest import lm_batch

F64 = torch.float64


def rough(shape, seed=0, dtype=F64, constant=64):
    """Values whose range varies from row to row; the first `constant` are equal."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=dtype)
    x = x * torch.exp(torch.randn(shape[:-1] + (1,), generator=g, dtype=dtype) * 2)
    x.view(-1)[:constant] = 0.25
    return x


# -- the quantizer ----------------------------------------------------------------------------


@pytest.mark.parametrize("numel, group", [(64 * 50, 64), (1000, 64), (999, 128), (7, 64)])
def test_round_trip_within_half_a_step(numel, group):
    x = rough((numel,), constant=group)  # the first group constant
    codes, lo, hi = M.quantize(x, group)
    groups = -(-numel // group)
    assert codes.dtype == torch.uint8 and codes.shape == (groups, group)
    assert lo.dtype == hi.dtype == F64 and lo.shape == hi.shape == (groups,)
    y = M.dequantize(codes, lo, hi, x.shape, x.dtype)
    step = M.step_per_element(x, group)
    err = (y - x).abs()
    assert (err <= step / 2 * (1 + 1e-12) + 1e-300).all()
    if numel > group:
        assert torch.equal(y[:group], x[:group])  # a constant group comes back exactly
        assert err.max() > 0.2 * (step / 2).max()  # not trivially exact
    # the extremes of every group are kept exactly (codes 0 and 255)
    full = torch.nn.functional.pad(x, (0, groups * group - numel)).view(groups, group)
    assert torch.equal(full.amin(1), lo) and torch.equal(full.amax(1), hi)


@pytest.mark.parametrize("chunk", [64, 640])  # 48 groups: in 16 pieces of 3; in pieces of 10
def test_quantizing_in_chunks_equals_one_chunk(monkeypatch, chunk):
    x = rough((64 * 48,), constant=64).to(torch.float32)
    whole = M.quantize(x, 64)
    back = M.dequantize(*whole, x.shape, x.dtype)
    monkeypatch.setattr(M, "CHUNK_ELEMENTS", chunk)
    assert M._chunk_groups(48, 64) == (3 if chunk == 64 else 10)
    chunked = M.quantize(x, 64)
    assert all(torch.equal(a, b) for a, b in zip(chunked, whole))
    assert torch.equal(M.dequantize(*chunked, x.shape, x.dtype), back)


def test_bfloat16_ranges_are_exact_and_codes_in_range():
    x = rough((4096,), dtype=torch.float32).bfloat16()
    codes, lo, hi = M.quantize(x, 64)
    assert lo.dtype == hi.dtype == torch.bfloat16
    y = M.dequantize(codes, lo, hi, x.shape, x.dtype)
    step = M.step_per_element(x, 64).float()
    # half a step, plus the rounding of the result to bfloat16
    assert ((y.float() - x.float()).abs() <= step / 2 + x.float().abs() * 2**-8 + 1e-30).all()


# -- gradients ---------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self, n_in=96, n_out=24):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(n_in, n_out).to(F64)

    def forward(self, x):
        return self.fc(x)


def run(model, x, dy):
    model.zero_grad()
    x = x.detach().clone().requires_grad_()
    model(x).backward(dy)
    return x.grad, model.fc.weight.grad.clone(), model.fc.bias.grad.clone()


@pytest.mark.parametrize("shape", [(50, 96), (5, 10, 96)])
def test_linear_weight_gradient_within_the_quantization_bound(shape):
    x = rough(shape)
    dy = torch.randn(shape[:-1] + (24,), generator=torch.Generator().manual_seed(1), dtype=F64)
    ref = run(Net(), x, dy)
    method = M.Mesa8bit()
    net = method.transform_model(Net())
    got = run(net, x, dy)
    assert method.report["quantized"] == 1 and method.report["kept_parameter_or_buffer"] >= 1
    torch.testing.assert_close(got[0], ref[0], rtol=1e-14, atol=0)  # dx = dy W: W is kept exactly
    torch.testing.assert_close(got[2], ref[2], rtol=1e-14, atol=0)  # db needs no activation
    # dW~ - dW = dy^T (x~ - x), |x~ - x| <= s/2  =>  |dW~ - dW| <= |dy|^T (s/2)
    bound = dy.reshape(-1, 24).abs().T @ (M.step_per_element(x, 64).reshape(-1, 96) / 2)
    err = (got[1] - ref[1]).abs()
    assert (err <= bound * (1 + 1e-9) + 1e-15).all()
    assert err.max() > 0 and (err / bound.clamp(min=1e-300)).max() > 0.05  # the bound is not vacuous


def test_transposed_view_is_quantized_in_memory_order():
    """A saved transposed view (matmul's k^T) comes back as that view, within the bound."""
    a = rough((40, 64), seed=2).requires_grad_()
    b = rough((30, 64), seed=3)

    def f(a):
        return a @ b.t()  # matmul saves a (for d b, unused) and b^T (for d a)

    b.requires_grad_()
    dy = torch.randn(40, 30, dtype=F64, generator=torch.Generator().manual_seed(4))
    hooks = M.SavedActivationQuantizer(nn.Module(), 64, 1)
    with torch.autograd.graph.saved_tensors_hooks(hooks.pack, M._unpack):
        out = f(a)
    out.backward(dy)
    assert hooks.report["quantized"] == 2
    # d a = dy b~ ; b's groups are its rows (its memory), whatever view was saved
    bound = dy.abs() @ (M.step_per_element(b.detach(), 64) / 2)
    exact = dy @ b.detach()
    err = (a.grad - exact).abs()
    assert (err <= bound * (1 + 1e-9) + 1e-15).all() and err.max() > 0


def test_integer_indices_and_parameters_are_kept():
    """Embedding -> Linear: the embedding's gradient needs the indices and the Linear's
    weight only (dE = scatter(dy W)), so it is exact iff neither was quantized."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 96), nn.Linear(96, 32)).to(F64)
    ids = torch.randint(0, 64, (8, 70))
    dy = torch.randn(8, 70, 32, dtype=F64)
    model(ids).backward(dy)
    ref = [p.grad.clone() for p in model.parameters()]
    method = M.Mesa8bit()
    q = method.transform_model(copy.deepcopy(model))
    q.zero_grad()
    q(ids).backward(dy)
    assert method.report["kept_integer_or_bool"] >= 1 and method.report["quantized"] == 1
    torch.testing.assert_close(q[0].weight.grad, ref[0], rtol=1e-14, atol=0)
    torch.testing.assert_close(q[1].bias.grad, ref[2], rtol=1e-14, atol=0)
    assert not torch.equal(q[1].weight.grad, ref[1])  # its input was quantized


def test_one_input_saved_by_three_linears_is_quantized_once():
    torch.manual_seed(0)
    qkv = nn.ModuleList(nn.Linear(128, 128) for _ in range(3))
    model = nn.Module()
    model.qkv = qkv
    model.forward = lambda x: sum(layer(x) for layer in qkv)
    method = M.Mesa8bit()
    method.transform_model(model)
    x = torch.randn(4, 32, 128)
    tracker = MemoryTracker()
    tracker.register_model(model)
    tracker.register([x], "other")
    with tracker:
        out = model(x)
        saved = tracker.live_split().activation
    assert method.report["quantized"] == 1 and method.report["shared"] == 2
    assert saved == x.numel() + 2 * 4 * (x.numel() // 64)  # codes + (lo, hi) per group, once
    del out


# -- whole models ---------------------------------------------------------------------------


def forward_activation_bytes(model, batch):
    tracker = MemoryTracker()
    tracker.register_model(model)
    tracker.register(batch.values(), "other")
    with tracker, cuda_kernels():
        loss = lm_loss(model, batch)
        return tracker.live_split().activation, loss.detach()


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "llama-tiny"])
def test_saved_activation_bytes_drop_to_about_a_quarter(name):
    torch.manual_seed(0)
    model = models.build(name, dropout=0.0)
    batch = lm_batch(4, 32)
    before, loss_before = forward_activation_bytes(model, batch)
    method = M.Mesa8bit()
    method.transform_model(model)
    after, loss_after = forward_activation_bytes(model, batch)
    report = method.report
    assert torch.equal(loss_after, loss_before)  # the forward is unchanged
    # codes: 1 byte per element; (lo, hi): 8 bytes per 64 elements
    assert report["packed_bytes"] == pytest.approx(report["quantized_bytes"] * (1 + 8 / 64) / 4, rel=1e-3)
    # tiny saved tensors (per-row statistics, seq 32 attention statistics) stay float32
    assert 0.25 < after / before < 0.33
    if name != "gpt2-tiny":  # GPT-2 saves views of its fused qkv output: storages differ from views
        assert after == before - report["quantized_bytes"] + report["packed_bytes"]


def test_tiny_model_gradients_stay_close():
    torch.manual_seed(0)
    model = models.build("llama-tiny").to(F64)
    quantized = M.Mesa8bit().transform_model(copy.deepcopy(model))
    batch = lm_batch(4, 32)
    lm_loss(model, batch).backward()
    lm_loss(quantized, batch).backward()
    for (name, p), q in zip(model.named_parameters(), quantized.parameters()):
        rel = (q.grad - p.grad).norm() / p.grad.norm()
        assert 0 < rel < 0.05, name  # 8-bit activations: close, not exact


@pytest.mark.parametrize("spec, model", [("mesa8bit", "bert-tiny"), ("mesa8bit", "llama-tiny"),
                                         ("checkpointing+mesa8bit", "bert-tiny"),
                                         # opt-in (`heavy`): a stack that also accumulates
                                         pytest.param("adama+mesa8bit", "gpt2-tiny", marks=pytest.mark.heavy)])
def test_simulated_equals_tracked(tiny_job, spec, model):
    real = runner.run(tiny_job(model=model, method=spec))
    fake = runner.run(tiny_job(model=model, method=spec, simulate=True))
    assert real["status"] == fake["status"] == "ok", (real["message"], fake["message"])
    for c in ("param", "grad", "optimizer", "activation", "other", "peak"):
        assert fake["memory"][f"{c}_bytes"] == real["memory"][f"{c}_bytes"], c
    report = real["method_report"]
    report = report.get("mesa8bit", report)
    assert report == (fake["method_report"].get("mesa8bit", fake["method_report"]))
    assert report["quantized"] > 0


def test_transform_twice_hooks_once_and_an_error_leaves_no_hooks():
    method = load("mesa8bit")
    model = nn.Linear(4, 4)
    assert method.transform_model(method.transform_model(model)) is model
    assert len(model._forward_pre_hooks) == len(model._forward_hooks) == 1
    with pytest.raises(RuntimeError):
        model(torch.zeros(3, 5))  # wrong width
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    model(torch.zeros(3, 4)).sum().backward()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_a_deep_copy_keeps_its_own_parameters():
    net = M.Mesa8bit().transform_model(Net())
    twin = copy.deepcopy(net)
    x = rough((50, 96))
    dy = torch.ones(50, 24, dtype=F64)
    got = run(twin, x, dy)
    torch.testing.assert_close(got[0], dy @ twin.fc.weight.detach(), rtol=1e-14, atol=0)  # W kept
    assert not torch.equal(got[1], dy.T @ x)  # its input quantized

"""Adafactor (methods/adafactor.py): torch.optim.Adafactor's update, which reads no tensor
value, against torch's own optimizer, the paper's formula in float64, fake tensors and the
state formula."""
import math

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from bench import models
from bench.job import Job
from bench.measure import runner
from bench.method import load, lm_loss
from conftest import lm_batch
from methods.adafactor import ValueFreeAdafactor, state_elements

SHAPES = [(12, 20), (20, 12), (3, 4, 5), (7,)]


def tensors(dtype, steps=6, seed=1):
    gen = torch.Generator().manual_seed(seed)
    w0 = [torch.randn(s, generator=gen, dtype=dtype) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) * (1 + t) for s in SHAPES] for t in range(steps)]
    return w0, grads


def run(optimizer_cls, w0, grads, **kw):
    params = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = optimizer_cls(params, **kw)
    out = []
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
        out.append([p.detach().clone() for p in params])
    return out


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-13), (torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("kw", [{}, {"weight_decay": 0.1, "lr": 0.05}, {"eps": (1e-6, 1e-2), "d": 2.0}])
def test_update_equals_torch_adafactor(dtype, rtol, kw):
    w0, grads = tensors(dtype)
    ours = run(ValueFreeAdafactor, w0, grads, **kw)
    theirs = run(torch.optim.Adafactor, w0, grads, **kw)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        for x, y in zip(a, b):
            # bfloat16: torch adds the update with a Python-float step size, ours scales
            # the bfloat16 update first: a rounding or two apart
            atol = rtol if dtype == torch.bfloat16 else rtol * 1e-2
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=f"step {step}")
    assert max((x - w).abs().max() for x, w in zip(ours[-1], w0)) > 1e-2


def paper(w0, grads, rho_max=1e-2, decay=-0.8, eps1=1e-30, eps2=1e-3, d=1.0):
    """Shazeer & Stern, Algorithms 4 (matrices, factored over the last two dimensions) and
    2 (vectors) with relative step size, parameter scaling and update clipping, float64,
    eps1 added to G^2, row and column *sums*."""
    w, r, c, v = w0.clone(), 0.0, 0.0, 0.0
    out = []
    for t, g in enumerate(grads, start=1):
        beta2 = 1 - t ** decay
        rho = min(rho_max, 1 / math.sqrt(t))
        alpha = max(eps2, float(w.norm() / math.sqrt(w.numel()))) * rho
        sq = g * g + eps1
        if w.dim() >= 2:
            r = beta2 * r + (1 - beta2) * sq.sum(dim=-1, keepdim=True)
            c = beta2 * c + (1 - beta2) * sq.sum(dim=-2, keepdim=True)
            v_hat = r * c / r.sum(dim=-2, keepdim=True)
        else:
            v_hat = v = beta2 * v + (1 - beta2) * sq
        u = g / v_hat.sqrt()
        u = u / max(1.0, float(u.norm() / math.sqrt(u.numel())) / d)
        w = w - alpha * u
        out.append(w)
    return out


def test_update_equals_the_papers_formula_fp64():
    w0, grads = tensors(torch.float64, steps=8)
    ours = run(ValueFreeAdafactor, w0, grads, eps=(1e-30, 1e-3))
    for i in range(len(SHAPES)):
        ref = paper(w0[i], [g[i] for g in grads])
        for step in range(len(grads)):
            torch.testing.assert_close(ours[step][i], ref[step], rtol=1e-12, atol=1e-15,
                                       msg=f"shape {SHAPES[i]} step {step}")


def test_torch_adafactor_needs_values_ours_does_not():
    """What breaks on fake tensors: torch's step reads RMS(W) with .item()."""
    with FakeTensorMode():
        for cls, fails in ((torch.optim.Adafactor, True), (ValueFreeAdafactor, False)):
            params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
            opt = cls(params)
            for p in params:
                p.grad = torch.randn(p.shape)
            if fails:
                with pytest.raises(DataDependentOutputException):
                    opt.step()
            else:
                opt.step()
                opt.step()
                assert [tuple(opt.state[p]["row_var"].shape) for p in params[:3]] == [
                    (12, 1), (20, 1), (3, 4, 1)]


def test_state_layout_matches_torch():
    w0, grads = tensors(torch.float32, steps=1)
    params = [torch.nn.Parameter(w) for w in w0]
    ours, theirs = ValueFreeAdafactor(params), torch.optim.Adafactor([torch.nn.Parameter(w) for w in w0])
    for opt, ps in ((ours, params), (theirs, theirs.param_groups[0]["params"])):
        for p, g in zip(ps, grads[0]):
            p.grad = g
        opt.step()
    for p, q in zip(params, theirs.param_groups[0]["params"]):
        a, b = ours.state[p], theirs.state[q]
        assert set(a) == set(b)
        assert a["step"] == 1 and torch.is_tensor(b["step"])  # ours: a Python int
        for key in set(a) - {"step"}:
            torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=0)


def test_state_formula():
    assert state_elements((12, 20)) == 32
    assert state_elements((3, 4, 5)) == 3 * 9
    assert state_elements((7,)) == 7


@pytest.mark.parametrize("model", ["gpt2-tiny", "bert-tiny"])
def test_optimizer_bytes_equal_the_formula(model):
    job = Job(kind="memory", method="adafactor", model=model, batch_size=4, seq_len=32)
    record = runner.run(job)
    assert record["status"] == "ok", record.get("message")
    torch.manual_seed(0)
    params = list(models.build(model).parameters())
    assert record["memory"]["optimizer_bytes"] == 4 * sum(state_elements(p.shape) for p in params)
    fake = runner.run(Job(**{**job.__dict__, "simulate": True}))
    assert fake["status"] == "ok", fake.get("message")
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "peak_bytes"):
        assert fake["memory"][key] == record["memory"][key], key


def test_bfloat16_learns():
    torch.manual_seed(0)
    model = models.build("llama-tiny").to(torch.bfloat16)
    method = load("adafactor")
    opt = method.make_optimizer(model)
    batch = lm_batch(4, 16)
    first = float(lm_loss(model, batch).detach())
    for _ in range(5):
        method.train_step(model, opt, batch)
    assert float(lm_loss(model, batch).detach()) < first - 0.05
    assert all(v.dtype == torch.bfloat16 for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))

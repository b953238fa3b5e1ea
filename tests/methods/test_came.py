"""CAME (methods/came.py, came_pytorch.py) against independent references: the paper's
Algorithm 1 in float64, the authors' package (came-pytorch 0.1.3), and the state formula."""
import math
import sys

import pytest
import torch

from bench import models
from bench.job import Job
from bench.measure import runner
from bench.method import MethodError, load, lm_loss
from conftest import lm_batch
from methods.came import CAMEOptimizer, state_elements


def build(name="llama-tiny", dtype=torch.float32):
    torch.manual_seed(0)
    return models.build(name, dropout=0.0).to(dtype)


# -- the update against Algorithm 1, float64 ------------------------------------------------

def rms(x):
    return x.norm() / math.sqrt(x.numel())


def algorithm_1(w0, grads, lr, betas, eps, d, wd):
    """The paper's Algorithm 1 as written (sums over rows and columns, eps1 inside the
    factored statistics) for a matrix; vectors as the package (no factoring, no confidence)."""
    b1, b2, b3 = betas
    e1, e2 = eps
    w, m = w0.clone(), torch.zeros_like(w0)
    if w0.dim() == 2:
        r = torch.zeros(w0.shape[0], dtype=w0.dtype)
        c = torch.zeros(w0.shape[1], dtype=w0.dtype)
        big_r, big_c = r.clone(), c.clone()
    else:
        v = torch.zeros_like(w0)
    out = []
    for g in grads:
        if w0.dim() == 2:
            r = b2 * r + (1 - b2) * (g * g + e1).sum(dim=1)
            c = b2 * c + (1 - b2) * (g * g + e1).sum(dim=0)
            v_hat = torch.outer(r, c) / r.sum()
        else:
            v_hat = v = b2 * v + (1 - b2) * (g * g + e1)
        u = g / v_hat.sqrt()
        u = u / max(1.0, float(rms(u)) / d)
        m = b1 * m + (1 - b1) * u
        w = w - lr * wd * w
        if w0.dim() == 2:
            instability = (u - m) ** 2 + e2
            big_r = b3 * big_r + (1 - b3) * instability.sum(dim=1)
            big_c = b3 * big_c + (1 - b3) * instability.sum(dim=0)
            s = torch.outer(big_r, big_c) / big_r.sum()
            w = w - lr * m / s.sqrt()
        else:
            w = w - lr * m
        out.append(w)
    return out


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(12, 20), (20, 12), (7,)])
def test_update_equals_fp64_algorithm_1(shape, wd):
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape, generator=gen, dtype=torch.float64) * (1 + s) for s in range(6)]
    w0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    hp = dict(lr=1e-2, betas=(0.9, 0.999, 0.9999), eps=(1e-30, 1e-16), d=1.0, wd=wd)
    w = torch.nn.Parameter(w0.clone())
    opt = CAMEOptimizer([w], lr=hp["lr"], betas=hp["betas"], eps=hp["eps"], clip_threshold=hp["d"],
                        weight_decay=wd)
    ref = algorithm_1(w0, grads, **hp)
    for step, g in enumerate(grads):
        w.grad = g.clone()
        opt.step()
        torch.testing.assert_close(w.detach(), ref[step], rtol=1e-12, atol=1e-14, msg=f"step {step}")
    assert (w.detach() - w0).abs().max() > 1e-3  # it moved far beyond the tolerance


def test_confidence_term_changes_the_update():
    # guards the test above: without the confidence term (W <- W - lr m_t, what the
    # package does for vectors) a matrix moves differently
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(12, 20, generator=gen, dtype=torch.float64) for _ in range(3)]
    w = torch.nn.Parameter(torch.zeros(12, 20, dtype=torch.float64))
    opt = CAMEOptimizer([w], lr=1e-2)
    for g in grads:
        w.grad = g.clone()
        opt.step()
    b1, m, plain = 0.9, torch.zeros(12, 20, dtype=torch.float64), torch.zeros(12, 20, dtype=torch.float64)
    r = c = 0.0
    for g in grads:  # Adafactor with momentum: the same u^_t and m_t, no 1 / sqrt(S_t)
        r = 0.999 * r + 0.001 * (g * g + 1e-30).sum(dim=1)
        c = 0.999 * c + 0.001 * (g * g + 1e-30).sum(dim=0)
        u = g / (torch.outer(r, c) / r.sum()).sqrt()
        u = u / max(1.0, float(rms(u)))
        m = b1 * m + (1 - b1) * u
        plain = plain - 1e-2 * m
    assert (w.detach() - plain).abs().max() > 1e-3


# -- against the authors' package -------------------------------------------------------------

@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_trajectory_equals_came_pytorch(wd):
    """Same model, same batches, float32, free-running: ours against came_pytorch.CAME with
    the same hyperparameters, 5 steps."""
    pytest.importorskip("came_pytorch")
    hp = {"lr": 1e-3, "weight_decay": wd}
    ours, theirs, start = build(), build(), build()
    a, b = load("came", hp), load("came_pytorch", hp)
    opt_a, opt_b = a.make_optimizer(ours), b.make_optimizer(theirs)
    for s in range(5):
        a.train_step(ours, opt_a, lm_batch(4, 16, seed=s))
        b.train_step(theirs, opt_b, lm_batch(4, 16, seed=s))
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"step {s} {name}: {m}")
    moved = max((p - q).abs().max() for p, q in zip(ours.parameters(), start.parameters()))
    assert moved > 3e-3
    for p in ours.parameters():  # the same state, key by key (ours has no RMS)
        sa, sb = opt_a.state[p], opt_b.state[dict(zip(map(id, ours.parameters()), theirs.parameters()))[id(p)]]
        for key, value in sa.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(value, sb[key], rtol=1e-4, atol=1e-5)  # u, m are O(1)


def test_came_pytorch_missing_is_a_method_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "came_pytorch", None)
    with pytest.raises(MethodError, match="pip install came-pytorch==0.1.3"):
        load("came_pytorch").make_optimizer(build())


# -- memory -----------------------------------------------------------------------------------

def test_state_formula():
    assert state_elements((12, 20)) == 240 + 2 * (12 + 20)
    assert state_elements((7,)) == 14
    assert state_elements((2, 3, 4)) == 24 + 2 * (6 + 8)  # factored over the last two


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
def test_optimizer_bytes_equal_the_formula(model):
    job = Job(kind="memory", method="came", model=model, batch_size=4, seq_len=32)
    record = runner.run(job)
    assert record["status"] == "ok", record.get("message")
    params = list(build(model).parameters())
    elements = sum(state_elements(p.shape) for p in params)
    assert record["memory"]["optimizer_bytes"] == 4 * elements  # float32
    assert elements < 0.53 * 2 * sum(p.numel() for p in params)  # vs AdamW's 2 per parameter
    fake = runner.run(Job(**{**job.__dict__, "simulate": True}))
    assert fake["status"] == "ok", fake.get("message")
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "peak_bytes"):
        assert fake["memory"][key] == record["memory"][key], key
    if model == "gpt2-tiny":
        pytest.importorskip("came_pytorch")
        peer = runner.run(Job(**{**job.__dict__, "method": "came_pytorch"}))
        # the package's extra: one 0-d float32 `RMS` per parameter tensor
        assert peer["memory"]["optimizer_bytes"] == 4 * (elements + len(params))


def test_bfloat16_keeps_state_in_bfloat16_and_learns():
    model = build(dtype=torch.bfloat16)
    method = load("came", {"lr": 1e-3})
    opt = method.make_optimizer(model)
    batch = lm_batch(4, 16, seed=0)
    first = float(lm_loss(model, batch).detach())
    for _ in range(5):
        method.train_step(model, opt, batch)
    assert all(v.dtype == torch.bfloat16 for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))
    assert float(lm_loss(model, batch).detach()) < first - 0.05


def test_paper_defaults():
    hp = load("came").hp
    assert (hp["lr"], tuple(hp["betas"]), tuple(hp["eps"]), hp["weight_decay"], hp["clip_threshold"]) == (
        2e-4, (0.9, 0.999, 0.9999), (1e-30, 1e-16), 0.01, 1.0)
    with pytest.raises(MethodError, match="option 'betas' takes a tuple like"):
        load("came", {"betas": [0.9, 0.999]})  # caught when the config is read
    with pytest.raises(MethodError, match=r"'betas' must have every element in \[0, 1\)"):
        load("came", {"betas": [0.9, 0.999, 1.5]})
    with pytest.raises(MethodError, match=r"'eps' must have every element in \[0, inf\)"):
        load("came_pytorch", {"eps": [1e-30, -1.0]})

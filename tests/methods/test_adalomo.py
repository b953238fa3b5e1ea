"""AdaLomo (methods/adalomo.py) against a float64 re-derivation of the paper's update run
after a normal backward, against the authors' `lomo-optim` package, and its memory."""
import math

import pytest
import torch

from bench import models
from bench.measure import runner
from bench.measure.tracker import MemoryTracker
from bench.method import MethodError, load, lm_loss
from conftest import lm_batch


def gpt2(dtype=torch.float64):
    torch.manual_seed(0)
    return models.build("gpt2-tiny", dropout=0.0).to(dtype)


BATCHES = [lm_batch(4, 16, seed=s) for s in range(3)]


def assert_same_weights(ours, ref, lr, steps, rtol, atol):
    """Equal weights, except where the gradient is zero in exact arithmetic: GPT-2's key
    bias (softmax ignores a shift shared by all keys). Its gradient is rounding noise
    (~1e-19 in float64) that AdaLomo, like Adam, normalises to an O(1) update, so a
    last-bit difference in the weights changes its direction; there the weights must
    only agree within the steps' size, lr max(eps2, RMS(theta)) <= lr each."""
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        if name.endswith("attn.c_attn.bias"):
            width = p.shape[0] // 3  # query | key | value
            key = slice(width, 2 * width)
            torch.testing.assert_close(p[:width], q[:width], rtol=rtol, atol=atol)
            torch.testing.assert_close(p[2 * width:], q[2 * width:], rtol=rtol, atol=atol)
            assert (p[key] - q[key]).abs().max() <= 2 * lr * steps
        else:
            torch.testing.assert_close(p, q, rtol=rtol, atol=atol)


def reference(model, batches, lr, weight_decay=0.0, eps1=1e-30, eps2=1e-3, d=1.0):
    """Algorithm 1 of the paper, written with sums (1_m, 1_n) as the paper does, after a
    full backward; float64 throughout."""
    state = {}
    for t, b in enumerate(batches, start=1):
        model.zero_grad(set_to_none=True)
        lm_loss(model, b).backward()
        beta = 1 - t ** -0.8
        with torch.no_grad():
            for p in model.parameters():
                g = p.grad
                sq = g * g + eps1
                if g.dim() == 2:
                    r_new, c_new = sq.sum(dim=1), sq.sum(dim=0)  # (g^2 + eps1) 1_m, 1_n^T (...)
                    r, c = state.get(p, (torch.zeros_like(r_new), torch.zeros_like(c_new)))
                    r, c = beta * r + (1 - beta) * r_new, beta * c + (1 - beta) * c_new
                    state[p] = (r, c)
                    v = torch.outer(r, c) / r.sum()  # r c^T / (1_n^T r)
                else:
                    v = beta * state.get(p, torch.zeros_like(sq)) + (1 - beta) * sq
                    state[p] = v
                u = g / v.sqrt()
                rms = lambda x: math.sqrt(float((x * x).mean()))
                u = u / max(1.0, rms(u) / d)
                alpha = lr * max(eps2, rms(p))
                p.mul_(1 - alpha * weight_decay).sub_(alpha * u)
    model.zero_grad(set_to_none=True)
    return model


def adalomo_trained(model, batches, **hp):
    method = load("adalomo", hp)
    opt = method.make_optimizer(model)
    for b in batches:
        method.train_step(model, opt, b)
    return model, opt


@pytest.mark.parametrize("hp", [dict(lr=1e-2), dict(lr=1e-2, weight_decay=0.1)])
def test_fused_equals_the_papers_update_after_a_full_backward_float64(hp):
    ours, _ = adalomo_trained(gpt2(), BATCHES, **hp)
    ref = reference(gpt2(), BATCHES, **hp)
    assert_same_weights(ours, ref, hp["lr"], len(BATCHES), rtol=1e-9, atol=1e-12)
    moved = max(float((q - p0).detach().abs().max())
                for q, p0 in zip(ref.parameters(), gpt2().parameters()))
    assert moved > 1e-4


def test_update_normalisation_caps_each_parameters_update():
    """On step 1 (beta_1 = 0) the update of a vector is g / sqrt(g^2 + eps1) = sign(g),
    RMS 1: every element of a norm's weight or bias, or an MLP bias, moves by exactly
    lr max(eps2, RMS(theta)). (Not the attention bias: its key part has no gradient.)"""
    model = gpt2()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ours, _ = adalomo_trained(model, BATCHES[:1], lr=1e-2)
    for n, p in ours.named_parameters():
        if p.dim() == 1 and "c_attn" not in n:
            p0 = start[n]
            step = 1e-2 * max(1e-3, float(p0.norm() / math.sqrt(p0.numel())))
            moved = (p - p0).abs()
            torch.testing.assert_close(moved, torch.full_like(moved, step), rtol=1e-6, atol=1e-12)


def test_matches_the_authors_lomo_optim(monkeypatch):
    lomo_optim = pytest.importorskip("lomo_optim")
    # lomo-optim allocates AdaLomo's state with `.cuda()`; on a CPU-only machine that
    # raises, so here (and only here) `.cuda()` leaves a tensor where it is.
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    ours, _ = adalomo_trained(gpt2(torch.float32), BATCHES, lr=1e-2, weight_decay=0.1)
    theirs = gpt2(torch.float32)
    opt = lomo_optim.AdaLomo(theirs, lr=1e-2, weight_decay=0.1)  # its loss scale 2^10 included
    for b in BATCHES:
        opt.fused_backward(lm_loss(theirs, b), 1e-2)
    assert_same_weights(ours, theirs, 1e-2, len(BATCHES), rtol=1e-5, atol=1e-6)


def test_state_bytes_are_the_factored_formula(tiny_job):
    """4 (n + m) bytes per n x m weight, 4 n per vector: float32 row/column statistics."""
    record = runner.run(tiny_job(method="adalomo"))
    assert record["status"] == "ok", record.get("message")
    model = gpt2(torch.float32)
    expected = sum(4 * (p.shape[0] + p.shape[1]) if p.dim() == 2 else 4 * p.numel()
                   for p in model.parameters())
    assert record["memory"]["optimizer_bytes"] == expected
    assert expected < 0.1 * sum(p.numel() for p in model.parameters())  # << AdamW's 8 / param


def test_one_gradient_alive_at_a_time():
    model = gpt2(torch.float32)
    method = load("adalomo")
    b = lm_batch(8, 16)
    tracker = MemoryTracker()
    tracker.register_model(model)
    tracker.register(b.values(), "other")
    seen = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(tracker.live_split().grad))
    with tracker:
        opt = method.make_optimizer(model)
        method.train_step(model, opt, b)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert 0 < max(seen) <= largest
    assert all(p.grad is None for p in model.parameters())


def test_micro_batches_are_refused():
    from methods.adalomo import AdaLomo

    assert AdaLomo.max_micro_batches == 1
    with pytest.raises(MethodError, match="adalomo: micro_batches=4 is not supported"):
        load("adalomo", {"micro_batches": 4})
    with pytest.raises(MethodError, match=r"'decay_rate' must be in \(-inf, 0\), not 0.5"):
        load("adalomo", {"decay_rate": 0.5})


def test_it_learns(tiny_job):
    conv = runner.run(tiny_job(kind="convergence", method="adalomo", steps=20, hparams={"lr": 1e-2}))
    losses = [c["loss"] for c in conv["curve"]]
    assert conv["status"] == "ok" and losses[-1] < losses[0] - 0.3

"""LOMO (methods/lomo.py) against SGD run after a normal backward (float64), against the
authors' `lomo-optim` package, and its memory: no state, one gradient alive at a time."""
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


def sgd_after_backward(model, batches, lr, weight_decay=0.0, clip_norm=None, clip_value=None):
    """The reference: a full backward first (every gradient alive), then the update."""
    for b in batches:
        model.zero_grad(set_to_none=True)
        lm_loss(model, b).backward()
        with torch.no_grad():
            grads = {p: p.grad.clone() for p in model.parameters()}
            if clip_value is not None:
                grads = {p: g.clamp(-clip_value, clip_value) for p, g in grads.items()}
            if clip_norm is not None:
                # the norm is of the raw gradients (LOMO's first pass sees no value clip)
                total = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters()))
                coef = min(1.0, clip_norm / (float(total) + 1e-6))
                grads = {p: g * coef for p, g in grads.items()}
            for p, g in grads.items():
                p.mul_(1 - lr * weight_decay).sub_(lr * g)
    model.zero_grad(set_to_none=True)
    return model


def lomo_trained(model, batches, **hp):
    method = load("lomo", hp)
    opt = method.make_optimizer(model)
    for b in batches:
        method.train_step(model, opt, b)
    return model


BATCHES = [lm_batch(4, 16, seed=s) for s in range(3)]


@pytest.mark.parametrize("hp", [
    dict(lr=0.05),
    dict(lr=0.05, weight_decay=0.1),
    dict(lr=0.05, clip_grad_value=1e-3),
    dict(lr=0.05, clip_grad_norm=0.5),  # the gradients' norm is above 0.5: clipping acts
])
def test_fused_equals_sgd_after_a_full_backward_float64(hp):
    ours = lomo_trained(gpt2(), BATCHES, **hp)
    ref = sgd_after_backward(gpt2(), BATCHES, hp["lr"], hp.get("weight_decay", 0.0),
                             hp.get("clip_grad_norm"), hp.get("clip_grad_value"))
    start = gpt2()
    moved = 0.0
    for p, q, p0 in zip(ours.parameters(), ref.parameters(), start.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-13)
        moved = max(moved, float((q - p0).detach().abs().max()))
    assert moved > 1e-4  # the steps changed the weights


def test_clip_grad_norm_really_clips():
    torch.manual_seed(0)
    clipped = lomo_trained(gpt2(), BATCHES[:1], lr=0.05, clip_grad_norm=0.5)
    free = lomo_trained(gpt2(), BATCHES[:1], lr=0.05)
    start = gpt2()
    d_clip = torch.sqrt(sum(((p - p0) ** 2).sum() for p, p0 in zip(clipped.parameters(), start.parameters())))
    d_free = torch.sqrt(sum(((p - p0) ** 2).sum() for p, p0 in zip(free.parameters(), start.parameters())))
    torch.testing.assert_close(d_clip, torch.tensor(0.05 * 0.5, dtype=torch.float64), rtol=1e-5, atol=0)
    assert d_free > 2 * d_clip


def test_bfloat16_parameters_update_in_float32():
    """As lomo-optim: the bf16 weight is upcast, updated in float32 and rounded once."""
    ours = lomo_trained(gpt2(torch.bfloat16), BATCHES[:1], lr=0.05)
    ref = gpt2(torch.bfloat16)
    lm_loss(ref, BATCHES[0]).backward()
    with torch.no_grad():
        for p, q in zip(ours.parameters(), ref.parameters()):
            expected = q.float().add(q.grad.float(), alpha=-0.05).bfloat16()
            assert torch.equal(p, expected)


def test_matches_the_authors_lomo_optim():
    lomo_optim = pytest.importorskip("lomo_optim")
    ours = lomo_trained(gpt2(torch.float32), BATCHES, lr=0.05, weight_decay=0.1, clip_grad_norm=0.5)
    theirs = gpt2(torch.float32)
    opt = lomo_optim.Lomo(theirs, lr=0.05, clip_grad_norm=0.5, weight_decay=0.1)
    for b in BATCHES:
        opt.grad_norm(lm_loss(theirs, b))  # their first backward: the global norm
        opt.fused_backward(lm_loss(theirs, b), 0.05)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def live_grad_bytes(method_name, model, **hp):
    """Largest number of gradient bytes alive at any parameter's gradient hook."""
    method = load(method_name, hp)
    b = lm_batch(8, 16)
    tracker = MemoryTracker()
    tracker.register_model(model)
    tracker.register(b.values(), "other")
    seen = []
    for p in model.parameters():  # registered after the tracker's, before the method's
        p.register_post_accumulate_grad_hook(lambda p: seen.append(tracker.live_split().grad))
    with tracker:
        opt = method.make_optimizer(model)
        method.train_step(model, opt, b)
    assert all(p.grad is None for p in model.parameters())
    return max(seen)


@pytest.mark.parametrize("hp", [{}, {"clip_grad_norm": 1.0}])
def test_one_gradient_alive_at_a_time(hp):
    model = gpt2(torch.float32)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert live_grad_bytes("lomo", model, **hp) <= largest
    assert live_grad_bytes("adamw", gpt2(torch.float32)) == total  # the reference keeps all


def test_no_optimizer_state_and_no_gradient_at_the_peak(tiny_job):
    record = runner.run(tiny_job(method="lomo"))
    assert record["status"] == "ok", record.get("message")
    mem = record["memory"]
    assert mem["optimizer_bytes"] == 0 and mem["grad_bytes"] <= 256 * 128 * 4
    adamw = runner.run(tiny_job(method="adamw"))["memory"]
    assert mem["peak_bytes"] < adamw["peak_bytes"]


def test_micro_batches_are_refused(tiny_job):
    from methods.lomo import Lomo

    assert Lomo.max_micro_batches == 1
    with pytest.raises(MethodError, match="micro_batches=2 is not supported.*micro_batches=1"):
        load("lomo", {"micro_batches": 2})
    with pytest.raises(MethodError, match=r"'clip_grad_norm' must be in \(0, inf\), not 0"):
        load("lomo", {"clip_grad_norm": 0.0})
    assert load("lomo", {"clip_grad_norm": None}).hp["clip_grad_norm"] is None  # off
    record = runner.run(tiny_job(method="lomo", hparams={"micro_batches": 2}))
    assert record["status"] == "error" and "micro_batches=2 is not supported" in record["message"]


def test_it_learns(tiny_job):
    conv = runner.run(tiny_job(kind="convergence", method="lomo", steps=20, hparams={"lr": 0.3}))
    losses = [c["loss"] for c in conv["curve"]]
    assert conv["status"] == "ok" and losses[-1] < losses[0] - 0.05  # SGD: slow, but down

"""MicroAdam against independent references: its quantiser's error bound, Adam over a
window of gradients written here in float64, the sparsity of its update, the error
feedback, and its state bytes against the memory formula (real and fake tensors)."""
import math

import pytest
import torch

from bench import models
from bench.measure import runner
from bench.method import MethodError, load
from bench.job import Job
from conftest import memory_pair, pair_group
from methods.microadam import (INDEX_LIMIT, MicroAdamOptimizer, dequantise, ideal_state_bytes,
                               kept_per_step, quant_step, quantise, state_bytes)


def blockwise_values(n, block, seed=0):
    """Gaussian values whose scale and centre change from block to block (1e-3 to 1e3)."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-n // block)
    scale = (10 ** (6 * torch.rand(blocks, generator=g) - 3)).repeat_interleave(block)[:n]
    shift = torch.randn(blocks, generator=g).repeat_interleave(block)[:n]
    return (shift + torch.randn(n, generator=g)) * scale


def gradient(shape, seed, dtype=torch.float32):
    """Random gradient with heterogeneous magnitudes, exactly representable in bfloat16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 10 ** (2 * torch.rand(shape, generator=g) - 1)
    return x.to(torch.bfloat16).to(dtype)


# -- the 4-bit quantiser -----------------------------------------------------------------------
@pytest.mark.parametrize("n, block", [(3 * 256 + 17, 256), (1001, 64), (255, 1000), (4096, 256)])
def test_quantiser_round_trip_within_half_a_step(n, block):
    x = blockwise_values(n, block)
    codes, lo, hi = quantise(x, block)
    assert codes.dtype == torch.uint8 and codes.numel() == -(-n // 2)  # two codes per byte
    assert lo.dtype == hi.dtype == torch.bfloat16 and lo.numel() == -(-n // block)
    which = torch.arange(n) // block
    lo_x, hi_x = lo.float()[which], hi.float()[which]
    assert (lo_x <= x).all() and (x <= hi_x).all()  # bf16 bounds rounded outwards
    step = (hi_x - lo_x) / 15
    err = (dequantise(codes, lo, hi, n, block) - x).abs()
    assert (err <= step / 2 * (1 + 1e-5)).all()
    unpacked = torch.stack([codes & 15, codes >> 4], dim=1).flatten()[:n]
    assert unpacked.max() == 15 and unpacked.min() == 0  # the whole 4-bit range is used


def test_constant_blocks_decode_without_nan():
    x = torch.cat([torch.zeros(8), torch.full((8,), 3.0), torch.full((8,), 0.1),
                   torch.full((5,), -7.3)])  # the last, partial block is constant too
    codes, lo, hi = quantise(x, 8)
    y = dequantise(codes, lo, hi, x.numel(), 8)
    assert torch.isfinite(y).all()
    # a zero step would make the encoder divide 0 by 0; casting that NaN to uint8 is
    # undefined behaviour (it happens to give code 0 on x86), so the step must never be 0
    assert (quant_step(lo, hi) > 0).all() and torch.isfinite(quant_step(lo, hi)).all()
    assert torch.equal(y[:16], x[:16])  # constants that bf16 holds exactly come back exactly
    half_step = ((hi.float() - lo.float()) / 30).repeat_interleave(8)[: x.numel()]
    assert ((y - x).abs() <= half_step * (1 + 1e-5)).all()


def test_zero_gradient_leaves_the_parameter_and_state_finite():
    p = torch.nn.Parameter(torch.randn(300))
    q = torch.nn.Parameter(torch.randn(300))
    opt = MicroAdamOptimizer([p, q], lr=0.1, quant_block=64)
    start = p.detach().clone()
    for seed in range(3):
        p.grad = torch.zeros(300)  # all-zero error blocks: lo = hi = 0 every step
        q.grad = gradient(300, seed)
        opt.step()
    assert torch.equal(p.detach(), start)
    assert torch.isfinite(q).all() and not torch.equal(q.detach(), start)
    assert torch.equal(opt.error_feedback(p), torch.zeros(300))


# -- Adam over the window --------------------------------------------------------------------
def adam_over_window(params, grads, lr, betas, eps, weight_decay, m):
    """float64 reference: Adam whose moments are the beta^age-weighted sums of the last m
    gradients, with Adam's bias correction. Returns the parameters after every step."""
    b1, b2 = betas
    p = [x.double().clone() for x in params]
    history = []
    for t in range(1, len(grads) + 1):
        for i in range(len(p)):
            window = [grads[t - 1 - age][i].double() for age in range(min(t, m))]
            m1 = sum(b1 ** age * g for age, g in enumerate(window))
            m2 = sum(b2 ** age * g * g for age, g in enumerate(window))
            c1, c2 = (1 - b1) / (1 - b1 ** t), (1 - b2) / (1 - b2 ** t)
            p[i] = p[i] * (1 - lr * weight_decay) - lr * c1 * m1 / ((c2 * m2).sqrt() + eps)
        history.append([x.clone() for x in p])
    return history


SHAPES = [(37,), (64, 50), (5000,)]  # below one top-k block, 3200, a block and a tail
HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-11), (torch.float32, 2e-6)])
@pytest.mark.parametrize("m, weight_decay", [(10, 0.0), (10, 0.1), (3, 0.1)])
def test_full_density_equals_adam_over_the_window(dtype, tol, m, weight_decay):
    steps = 7  # m = 10: the window outlasts the run; m = 3: the ring wraps twice
    torch.manual_seed(0)
    start = [torch.randn(s, dtype=dtype) for s in SHAPES]
    grads = [[gradient(s, seed=10 * t + i, dtype=dtype) for i, s in enumerate(SHAPES)]
             for t in range(steps)]
    params = [torch.nn.Parameter(x.clone()) for x in start]
    opt = MicroAdamOptimizer(params, weight_decay=weight_decay, m=m, k=1.0, **HP)
    expected = adam_over_window(start, grads, weight_decay=weight_decay, m=m, **HP)
    for t in range(steps):
        for p, g in zip(params, grads[t]):
            p.grad = g.clone()
        opt.step()
        for p, ref in zip(params, expected[t]):
            torch.testing.assert_close(p.detach().double(), ref, rtol=tol, atol=tol)
            assert torch.equal(opt.error_feedback(p), torch.zeros(p.shape))  # nothing dropped

    # the reference is Adam while the window holds every gradient, and is not Adam after
    adam = [torch.nn.Parameter(x.double().clone()) for x in start]
    torch_opt = torch.optim.AdamW(adam, weight_decay=weight_decay, **HP)
    for t in range(steps):
        for p, g in zip(adam, grads[t]):
            p.grad = g.double()
        torch_opt.step()
    close = all(torch.allclose(p, ref, rtol=1e-9, atol=1e-12) for p, ref in zip(adam, expected[-1]))
    assert close == (m >= steps)


# -- sparsity and error feedback ---------------------------------------------------------------
def test_update_touches_at_most_m_k_d_coordinates():
    d, m, k = 20000, 3, 0.01
    kept = kept_per_step(d, k, 4096)
    assert kept == 4 * 41 + 37  # four full blocks of 4096 and a tail of 3616
    p = torch.nn.Parameter(torch.randn(d))
    opt = MicroAdamOptimizer([p], lr=1e-2, m=m, k=k)
    changed_counts = []
    for t in range(6):
        p.grad = gradient(d, seed=t)
        before = p.detach().clone()
        opt.step()
        changed = p.detach() != before
        assert changed.sum() <= min(t + 1, m) * kept <= m * k * d * 1.01
        window_idx, _, _ = opt.window(p)
        in_window = torch.zeros(d, dtype=torch.bool)
        in_window[window_idx.flatten()] = True
        assert not (changed & ~in_window).any()  # only the window's coordinates move
        changed_counts.append(int(changed.sum()))
    assert changed_counts[-1] > 2 * kept  # the window holds several different top-k sets
    state = opt.state[p]
    assert state["I"].dtype == torch.int16 and state["V"].dtype == torch.bfloat16



def test_alpha_moves_that_fraction_of_the_error_feedback_into_the_update():
    d, alpha, lr = 20000, 0.25, 1e-2
    start = torch.randn(d, dtype=torch.float64)
    sparse, dense = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt0 = MicroAdamOptimizer([sparse], lr=lr, m=3)
    opt1 = MicroAdamOptimizer([dense], lr=lr, m=3, alpha=alpha)
    sparse.grad, dense.grad = gradient(d, 0, torch.float64), gradient(d, 0, torch.float64)
    opt0.step()
    opt1.step()
    assert (dense.detach() != start).sum() > 0.9 * d  # the update is dense now
    e = opt0.error_feedback(sparse).double()  # e_{t+1}, the same in both before densifying
    torch.testing.assert_close(dense.detach(), sparse.detach() - lr * alpha * e, rtol=0, atol=1e-12)
    s = opt1.state[dense]
    half_step = ((s["error_hi"].float() - s["error_lo"].float()) / 30).repeat_interleave(256)[:d]
    kept = opt1.error_feedback(dense)
    assert ((kept - (1 - alpha) * e.float()).abs() <= half_step * (1 + 1e-5) + 1e-12).all()
    assert (kept - e.float()).abs().max() > 0.1 * e.abs().max()  # 1 - alpha of it is kept


def test_error_feedback_carries_exactly_what_topk_dropped():
    block, k, quant_block = 4096, 0.02, 256
    d = 3 * block + 904  # three full top-k blocks and a tail
    scale = torch.ones(d)
    scale[block:2 * block] = 100.0  # a global top-k would take everything from this block
    p = torch.nn.Parameter(torch.zeros(d))
    opt = MicroAdamOptimizer([p], lr=1e-3, m=4, k=k, quant_block=quant_block)
    carried = torch.zeros(d)
    for t in range(4):
        g = gradient(d, seed=t) * scale
        a = g + carried  # what the step must select from: gradient plus error feedback
        p.grad = g.clone()
        opt.step()
        idx, values, ages = opt.window(p)
        newest, newest_values = idx[ages == 0][0], values[ages == 0][0]
        kept = torch.zeros(d, dtype=torch.bool)
        kept[newest] = True
        assert kept.sum() == kept_per_step(d, k, block) == 3 * 82 + 19
        for start in range(0, d, block):  # every top-k block keeps its own largest |a|
            sl = slice(start, start + block)
            assert kept[sl].sum() == (82 if start + block <= d else 19)
            assert a[sl][kept[sl]].abs().min() >= a[sl][~kept[sl]].abs().max()
        assert torch.equal(newest_values, a[newest].to(torch.bfloat16))
        dropped = torch.where(kept, torch.zeros(()), a)
        carried = opt.error_feedback(p)
        s = opt.state[p]
        half_step = ((s["error_hi"].float() - s["error_lo"].float()) / 30).repeat_interleave(quant_block)[:d]
        assert ((carried - dropped).abs() <= half_step * (1 + 1e-5)).all()
        assert (carried[kept].abs() <= half_step[kept] * (1 + 1e-5)).all()  # selected: gone


# -- memory -----------------------------------------------------------------------------------------
def test_formula():
    d = 256_000  # whole top-k and quantisation blocks, k * block whole: no rounding at all
    assert state_bytes(d, topk_block=1000) == (0.5 + 4 * 10 * 0.01) * d + 4 * d / 256
    assert state_bytes(d, topk_block=1000) == ideal_state_bytes(d)
    # the defaults round k * 4096 = 40.96 up to 41 and odd sizes up to whole bytes
    assert state_bytes(4096 * 1000 + 1) == 4 * 10 * (41 * 1000 + 1) + 2048001 + 4 * 16001
    assert state_bytes(4096 * 1000) / (4096 * 1000) == pytest.approx(0.9 + 4 / 256, abs=1e-3)


@pair_group("microadam")
def test_state_bytes_equal_the_formula_on_real_and_fake_tensors(tiny_job, one_thread):
    real, fake = memory_pair("microadam")  # test_simulated's pair: run once per worker
    bf16 = runner.run(tiny_job(method="microadam", dtype="bfloat16"))
    for r in (real, fake, bf16):
        assert r["status"] == "ok", (r.get("message"), r.get("traceback"))
    assert fake["memory"]["tier"] == "simulated"
    with torch.device("meta"):
        params = list(models.build("gpt2-tiny").parameters())
    expected = sum(state_bytes(p.numel()) for p in params)
    measured = real["memory"]["optimizer_bytes"]
    assert measured == expected
    assert fake["memory"]["optimizer_bytes"] == measured  # fake tensors: the same state
    assert bf16["memory"]["optimizer_bytes"] == measured  # bf16 values, int16 indices for any dtype
    # the paper's (0.5 + 4 m k) d with the lo/hi of each block, up to rounding k * block
    ideal = sum(ideal_state_bytes(p.numel()) for p in params)
    assert ideal <= measured <= 1.01 * ideal
    assert 0.9 < measured / real["n_params"] < 0.95  # AdamW keeps 8


def test_training_decreases_the_loss(one_thread):
    record = runner.run(Job(kind="convergence", method="microadam", model="gpt2-tiny",
                            batch_size=8, seq_len=32, steps=30, log_every=0))
    assert record["status"] == "ok", record.get("message")
    losses = [c["loss"] for c in record["curve"]]
    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.25


# -- the method ---------------------------------------------------------------------------------
def test_loads_with_the_papers_defaults():
    method = load("microadam")
    assert method.name == "microadam" and "2405.15593" in method.paper
    assert (method.hp["m"], method.hp["k"], method.hp["alpha"]) == (10, 0.01, 0.0)
    assert method.hp["topk_block"] < INDEX_LIMIT == 2 ** 15
    model = torch.nn.Linear(4, 3)
    assert isinstance(method.make_optimizer(model), MicroAdamOptimizer)
    with pytest.raises(MethodError, match="options: .*topk_block"):
        load("microadam", {"window": 5})


@pytest.mark.parametrize("option, value, words", [
    ("topk_block", 32768, r"'topk_block' must be in \[1, 32768\), not 32768"),
    ("alpha", 1.0, r"'alpha' must be in \[0, 1\), not 1.0"),
    ("alpha", -2, r"'alpha' must be in \[0, 1\)"),
    ("k", 0.0, r"'k' must be in \(0, 1\]"),
    ("m", 0, r"'m' must be in \[1, inf\)"),
])
def test_bad_options_fail_when_loaded(option, value, words):
    with pytest.raises(MethodError, match=words):
        load("microadam", {option: value})

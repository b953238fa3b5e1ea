"""Muon (methods/muon.py): the split, the updates against torch.optim.Muon + AdamW applied by
hand, one Muon step against a float64 re-derivation, the state formula and where the
Newton-Schulz temporaries go."""
import math
import re

import pytest
import torch

from bench import models
from bench.job import Job
from bench.measure import runner
from bench.measure.tracker import MemoryTracker
from bench.method import MethodError, lm_loss, load
from conftest import lm_batch

MODELS = ["gpt2-tiny", "bert-tiny", "llama-tiny"]
BLOCK = re.compile(r"\.(h|layer|layers)\.\d+\.")  # a parameter inside a Transformer block, by name
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # Keller Jordan's quintic, torch's default
BF16_UNIT_ROUNDOFF = 2.0 ** -8  # bfloat16 keeps 8 significant bits


def build(name, dtype=torch.float32):
    torch.manual_seed(0)
    return models.build(name, dropout=0.0).to(dtype)


def expected_split(model):
    """(names of the 2-D parameters inside the blocks, names of every other parameter)."""
    named = list(model.named_parameters())
    muon = [n for n, p in named if BLOCK.search(n) and p.dim() == 2]
    return muon, [n for n, _ in named if n not in muon]


def names_of(model, params):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for p in params]


# -- the split -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_the_split_puts_exactly_the_block_matrices_in_muon(name):
    model = build(name)
    opt = load("muon").make_optimizer(model)
    muon, adamw = expected_split(model)
    per_block = {"gpt2-tiny": 4, "bert-tiny": 6, "llama-tiny": 7}[name]  # attention + MLP projections
    assert len(muon) == 2 * per_block
    assert names_of(model, opt.muon.param_groups[0]["params"]) == muon
    assert names_of(model, [p for g in opt.adamw.param_groups for p in g["params"]]) == adamw
    # the optimizer's groups are the two optimizers' groups, each parameter once
    assert opt.param_groups == opt.muon.param_groups + opt.adamw.param_groups
    all_params = [p for g in opt.param_groups for p in g["params"]]
    assert len({id(p) for p in all_params}) == len(all_params) == len(list(model.parameters()))
    if name == "bert-tiny":  # the MLM head's transform is a 2-D matrix outside the blocks: AdamW
        assert "cls.predictions.transform.dense.weight" in adamw


# -- the updates: torch's optimizers by hand --------------------------------------------------------

def hand_step_run(name, steps, muon_args, adamw_args):
    model = build(name)
    muon_names, _ = expected_split(model)
    muon = [p for n, p in model.named_parameters() if n in muon_names]
    rest = [p for n, p in model.named_parameters() if n not in muon_names]
    opts = [torch.optim.Muon(muon, **muon_args), torch.optim.AdamW(rest, **adamw_args)]
    for i in range(steps):
        lm_loss(model, lm_batch(4, 16, seed=i)).backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad(set_to_none=True)
    return model, {p: s for o in opts for p, s in o.state.items()}


def method_run(name, spec, steps):
    model = build(name)
    method = load(spec)
    opt = method.make_optimizer(model)
    for i in range(steps):
        method.train_step(model, opt, lm_batch(4, 16, seed=i))
    return model, opt


def assert_same(a, state_a, b, opt_b):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
        for key, value in state_a[p].items():
            assert torch.equal(value, opt_b.state[q][key]), (n, key)


@pytest.mark.parametrize("name", MODELS)
def test_defaults_equal_torch_muon_and_adamw_by_hand(name):
    # the documented defaults: Moonlight's lr rule, one lr (the suite's 1e-3) for both groups
    muon_args = dict(lr=1e-3, weight_decay=0.0, momentum=0.95, nesterov=True, ns_steps=5,
                     adjust_lr_fn="match_rms_adamw")
    adamw_args = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    ref, ref_state = hand_step_run(name, 3, muon_args, adamw_args)
    ours, opt = method_run(name, "muon", 3)
    assert_same(ref, ref_state, ours, opt)
    assert any(not torch.equal(p, q) for p, q in zip(ref.parameters(), build(name).parameters()))


def test_options_reach_torch_optimizers():
    spec = ("muon@adjust_lr_fn=original,lr=0.02,adamw_lr=0.0003,weight_decay=0.1,nesterov=false,"
            "momentum=0.9,ns_steps=3")
    muon_args = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=False, ns_steps=3,
                     adjust_lr_fn="original")
    adamw_args = dict(lr=3e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    ref, ref_state = hand_step_run("gpt2-tiny", 3, muon_args, adamw_args)
    ours, opt = method_run("gpt2-tiny", spec, 3)
    assert_same(ref, ref_state, ours, opt)


def test_nesterov_off_on_bfloat16_is_refused():
    with pytest.raises(MethodError, match="nesterov=false on bfloat16"):
        load("muon@nesterov=false").make_optimizer(build("llama-tiny", torch.bfloat16))
    load("muon").make_optimizer(build("llama-tiny", torch.bfloat16))  # nesterov on: fine


# -- one Muon step against a float64 re-derivation -------------------------------------------------

def reference_muon(w, grads, lr, mu, nesterov, ns_steps, rule):  # w: the weight (its shape)
    """Muon in float64 from the write-up, with no transposition (the quintic's odd
    polynomial of X X^T commutes with transposing): the last step's orthogonalized update
    O, its step size lr_adj and the momentum buffer after it. The weight's own history
    does not enter them (torch's earlier bf16 steps move it by lr_adj times their error):
    a test compares O with the step torch took from its own weight."""
    a, b, c = NS_COEFFICIENTS
    buf = torch.zeros_like(w, dtype=torch.float64)
    for g in grads:
        g = g.double()
        buf = mu * buf + (1 - mu) * g
        x = (1 - mu) * g + mu * buf if nesterov else buf
        x = x / x.norm()
        for _ in range(ns_steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
    m, n = w.shape
    step = 0.2 * lr * math.sqrt(max(m, n)) if rule == "match_rms_adamw" else lr * math.sqrt(max(1, m / n))
    return x, step, buf


# torch orthogonalizes in bfloat16 (a bf16 copy of the update; each of the 5 iterations'
# matmuls rounds its output to bf16): O is within a few bf16 unit roundoffs of the exact
# iteration, relative to its norm (1.2-1.5% measured; a wrong coefficient, step count or
# momentum rule is off by 30% or more)
TOLERANCE = 8 * BF16_UNIT_ROUNDOFF


def relative_error(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("shape", [(48, 80), (80, 48), (128, 128)])
@pytest.mark.parametrize("rule", ["match_rms_adamw", "original"])
def test_one_step_equals_a_float64_rederivation(shape, rule):
    lr, wd, mu = 0.02, 0.1, 0.95
    torch.manual_seed(1)
    w0 = torch.randn(shape)
    grads = [torch.randn(shape) for _ in range(3)]
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.Muon([p], lr=lr, weight_decay=wd, momentum=mu, nesterov=True, adjust_lr_fn=rule)
    for g in grads:
        before = p.detach().double().clone()
        p.grad = g.clone()
        opt.step()
    o_ref, step, buf = reference_muon(w0, grads, lr, mu, True, 5, rule)
    torch.testing.assert_close(opt.state[p]["momentum_buffer"].double(), buf, rtol=1e-6, atol=1e-7)
    o_torch = (before * (1 - lr * wd) - p.detach().double()) / step  # decay with lr, update with lr_adj
    assert relative_error(o_torch, o_ref) < TOLERANCE
    # the tolerance separates: one Newton-Schulz step fewer, or no nesterov, is far outside it
    for variant in (dict(nesterov=True, ns_steps=4), dict(nesterov=False, ns_steps=5)):
        o_other, _, _ = reference_muon(w0, grads, lr, mu, rule=rule, **variant)
        assert relative_error(o_other, o_ref) > 10 * TOLERANCE


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])  # GPT-2's Conv1D is in x out
def test_the_methods_step_on_every_block_matrix_equals_the_rederivation(name):
    """The method's optimizer on the model's own matrices, with full-rank random gradients:
    a training gradient of a tiny batch has rank at most its token count, and the
    iteration's bf16 error on its near-zero singular directions is amplified up to a^5
    (7% relative on these models, 4.5% from rounding the input to bf16 alone), so the
    exactness on real gradients is the by-hand test above; here, the rederivation."""
    model = build(name)
    opt = load("muon").make_optimizer(model)
    muon = opt.muon.param_groups[0]["params"]
    g = torch.Generator().manual_seed(2)
    grads = {id(p): [torch.randn(p.shape, generator=g) for _ in range(2)] for p in muon}
    for i in range(2):  # the second step has momentum (the first is along the gradient)
        for p in model.parameters():
            p.grad = grads[id(p)][i].clone() if id(p) in grads else torch.zeros_like(p)
        before = {id(p): p.detach().double().clone() for p in muon}
        opt.step()
    for p in muon:
        o_ref, step, buf = reference_muon(p, grads[id(p)], 1e-3, 0.95, True, 5, "match_rms_adamw")
        torch.testing.assert_close(opt.state[p]["momentum_buffer"].double(), buf, rtol=1e-6, atol=1e-7)
        o_torch = (before[id(p)] - p.detach().double()) / step  # weight decay 0
        assert relative_error(o_torch, o_ref) < TOLERANCE, tuple(p.shape)


# -- memory -----------------------------------------------------------------------------------------

def state_formula(name, dtype):
    """One momentum buffer per Muon matrix; exp_avg and exp_avg_sq per AdamW parameter, in
    the parameter's dtype, plus AdamW's 0-d float32 step each."""
    model = build(name, dtype)
    muon_names, _ = expected_split(model)
    size = torch.finfo(dtype).bits // 8
    muon = sum(p.numel() for n, p in model.named_parameters() if n in muon_names)
    rest = [p for n, p in model.named_parameters() if n not in muon_names]
    return size * muon + 2 * size * sum(p.numel() for p in rest) + 4 * len(rest)


@pytest.mark.parametrize("name,dtype", [("gpt2-tiny", "float32"), ("llama-tiny", "float32"),
                                        ("bert-tiny", "bfloat16")])
def test_optimizer_bytes_equal_the_formula_and_simulate(name, dtype):
    job = Job(kind="memory", method="muon", model=name, batch_size=4, seq_len=32, dtype=dtype)
    record = runner.run(job)
    assert record["status"] == "ok", record.get("message")
    assert record["memory"]["optimizer_bytes"] == state_formula(name, getattr(torch, dtype))
    fake = runner.run(Job(**{**job.__dict__, "simulate": True}))
    assert fake["status"] == "ok", fake.get("message")
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "other_bytes", "peak_bytes"):
        assert fake["memory"][key] == record["memory"][key], key
    adamw = runner.run(Job(**{**job.__dict__, "method": "adamw"}))
    assert record["memory"]["optimizer_bytes"] < adamw["memory"]["optimizer_bytes"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_newton_schulz_temporaries_are_other_memory(dtype):
    """Muon's step, one matrix at a time, holds beside the state (torch's source): the
    nesterov tensor (m n elements of e bytes), its bf16 copy (the first iterate; in bf16 the
    tensor itself), and per iteration the r x r Gram matrix and polynomial and the next
    r x s iterate beside the previous (r = min(m, n), s = max): at its peak
    e m n + 4 r s + 4 r^2 bytes, all of it `other`; the state stays `optimizer`."""
    model = build("gpt2-tiny", dtype)
    method = load("muon")
    batch = lm_batch(4, 16)
    tracker = MemoryTracker()
    tracker.register_model(model)
    with tracker:
        opt = method.make_optimizer(model)
        method.train_step(model, opt, batch)  # creates the state
        tracker.label(method.state_tensors(opt), "optimizer")
        lm_loss(model, batch).backward()
        start = tracker.live_split()
        tracker.reset_peak()
        opt.muon.step()
        peak = tracker.peak_split
    e = torch.finfo(dtype).bits // 8
    expected = max(e * p.numel() + 4 * min(p.shape) * max(p.shape) + 4 * min(p.shape) ** 2
                   for p in opt.muon.param_groups[0]["params"])
    assert peak.other - start.other == expected
    assert (peak.optimizer, peak.activation, peak.grad, peak.param) == (
        start.optimizer, start.activation, start.grad, start.param)

"""WTA-CRS (methods/wta_crs.py) against autograd, a brute-force winner rule, the exact
expectation of its draw, Monte Carlo with the closed-form variance, the bytes it saves and
tracked memory runs."""
import copy
import math
import warnings

import pytest
import torch
from transformers.pytorch_utils import Conv1D

from bench import models
from bench.measure import runner
from bench.measure.tracker import MemoryTracker
from bench.method import MethodError, lm_loss, load
from conftest import lm_batch, saved_bytes
from methods import wta_crs as wta
from methods.lora import LoRALinear

F64 = torch.float64


def layer(kind="linear", d_in=6, d_out=5, bias=True, ratio=0.3, min_rows=10, dtype=F64, seed=0):
    torch.manual_seed(seed)
    if kind == "linear":
        m = torch.nn.Linear(d_in, d_out, bias=bias, dtype=dtype)
    else:
        m = Conv1D(d_out, d_in).to(dtype)
        with torch.no_grad():
            m.bias.normal_()
    plain = copy.deepcopy(m)
    wta.wrap(m, ratio, min_rows)
    return m, plain


def inputs(n=60, d_in=6, d_out=5, big=(), seed=1, dtype=F64):
    """x (2 x n/2 x d_in) and an output gradient; rows in `big` scaled by 50 (winners)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g, dtype=F64)
    x[list(big)] *= 50
    dy = torch.randn(n, d_out, generator=g, dtype=F64)
    return x.view(2, n // 2, d_in).to(dtype), dy.view(2, n // 2, d_out).to(dtype)


def run(module, x, dy):
    """Output, grad_x, grad_W, grad_b of one forward and backward."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = module(x)
    y.backward(dy)
    b = module.bias.grad if module.bias is not None else None
    return y.detach(), x.grad, module.weight.grad.clone(), b


def exact_grad_w(kind, x, dy):
    x2, g2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    return x2.t() @ g2 if kind == "conv1d" else g2.t() @ x2


def test_kept_rows_formula():
    assert wta.kept_rows(1000, 0.3, 10) == 300
    assert wta.kept_rows(20, 0.3, 10) == 10  # floor(6) < min_rows
    assert wta.kept_rows(7, 0.3, 10) == 7  # never more than n
    assert wta.kept_rows(64, 1.0, 10) == 64
    assert wta.saved_bytes(1000, 128, 4, 0.3, 10) == 300 * (128 * 4 + 8)
    assert wta.saved_bytes(7, 128, 2, 0.3, 10) == 7 * 128 * 2  # k = n: the input itself


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("ratio,n", [(1.0, 60), (0.3, 8)])
def test_exact_when_every_row_is_kept(kind, ratio, n):
    """ratio 1, or n below min_rows (k = n): all four results equal a plain layer's."""
    m, plain = layer(kind, ratio=ratio)
    x, dy = inputs(n=n)
    for got, want in zip(run(m, x, dy), run(plain, x, dy)):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_forward_input_and_bias_gradients_exact_at_ratio_03(kind):
    m, plain = layer(kind)
    x, dy = inputs(big=(3, 17, 40))
    y, gx, gw, gb = run(m, x, dy)
    y0, gx0, gw0, gb0 = run(plain, x, dy)
    assert torch.equal(y, y0)  # the same kernel as the plain layer
    torch.testing.assert_close(gx, gx0, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(gb, gb0, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(gw0, exact_grad_w(kind, x, dy), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(gw, gw0)  # sampled: an estimate, not the sum
    # no bias
    m, plain = layer("linear", bias=False)
    for got, want in zip(run(m, x, dy)[:2], run(plain, x, dy)[:2]):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


def brute_force_winners(p: list[float], k: int) -> int:
    """|C|: the c in 1..k-1 of least (1 - q_c)/(k - c) (the first), if at most 1/k; else 0."""
    top = sorted(p, reverse=True)
    best_c, best = 0, math.inf
    for c in range(1, k):
        score = (1 - sum(top[:c])) / (k - c)
        if score < best:
            best_c, best = c, score
    return best_c if best <= 1 / k else 0


def test_winner_rule_against_brute_force():
    g = torch.Generator().manual_seed(3)
    seen = set()
    for trial in range(200):
        n = int(torch.randint(12, 60, (), generator=g))
        k = wta.kept_rows(n, 0.3, 10)
        norms = torch.rand(n, generator=g, dtype=F64) ** (1 + trial % 7 * 3)  # flat to peaked
        top, _ = torch.topk(norms, k)
        c = int(wta.winner_count(top, norms.sum(), k))
        assert c == brute_force_winners((norms / norms.sum()).tolist(), k)
        seen.add(c > 0)
    assert seen == {True, False}  # both CRS (C empty) and winners occurred


def test_sample_keeps_the_winners_first_and_draws_the_rest():
    x, _ = inputs(big=(3, 17, 40))
    x2 = x.reshape(60, -1)
    k = wta.kept_rows(60, 0.3, 10)
    idx, weight, c = wta.sample(x2, k)
    c = int(c)
    assert c == 3 and idx.shape == weight.shape == (k,) and idx.dtype == torch.int64
    assert sorted(idx[:c].tolist()) == [3, 17, 40] and torch.equal(weight[:c], torch.ones(c, dtype=F64))
    assert not set(idx[c:].tolist()) & {3, 17, 40}
    norms = x2.norm(dim=1)
    rest = norms.sum() - norms[[3, 17, 40]].sum()
    torch.testing.assert_close(weight[c:], rest / ((k - c) * norms[idx[c:]]), rtol=1e-14, atol=0)


def fixed_draws(monkeypatch):
    """Make every draw return index `state["j"]`; record the weights it was given."""
    state = {"j": None, "weights": []}

    def draw(weights, k):
        state["weights"].append(weights.detach().clone())
        if state["j"] is None:
            return torch.multinomial(weights, k, replacement=True)
        return torch.full((k,), state["j"], dtype=torch.int64)

    monkeypatch.setattr(wta, "draw", draw)
    return state


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("big", [(), (3, 17, 40)])
def test_exact_expectation_for_a_fixed_distribution(monkeypatch, kind, big):
    """E over one draw j ~ p' (p'_j = ||x_j|| / R on the rows outside C) of the estimate
    equals the exact gradient: enumerated, not sampled (every draw of a step fixed to j)."""
    state = fixed_draws(monkeypatch)
    m, _ = layer(kind)
    x, dy = inputs(big=big)
    x[0, 5] = 0  # a zero row: probability 0, never drawn
    run(m, x, dy)
    weights = state["weights"][-1]
    x2 = x.reshape(60, -1)
    norms = x2.norm(dim=1)
    winners = set(big)
    assert all(weights[i] == 0 for i in winners) and weights[5] == 0
    others = [i for i in range(60) if i not in winners]
    torch.testing.assert_close(weights[others], norms[others], rtol=1e-15, atol=0)  # p' ∝ ||x_j||
    p = weights / weights.sum()
    expectation = torch.zeros_like(m.weight, dtype=F64)
    for j in range(60):
        if p[j] > 0:
            state["j"] = j
            expectation += p[j] * run(m, x, dy)[2]
    torch.testing.assert_close(expectation, exact_grad_w(kind, x, dy), rtol=1e-12, atol=1e-12)


def test_all_zero_rows_outside_the_winners_are_exact():
    m, plain = layer()
    x, dy = inputs()
    x = torch.zeros_like(x)
    x[0, :3] = 1.0  # three rows carry everything: winners or weight-0 draws, both exact
    torch.testing.assert_close(run(m, x, dy)[2], run(plain, x, dy)[2], rtol=1e-13, atol=1e-13)
    x = torch.zeros_like(x)  # no mass at all
    assert torch.equal(run(m, x, dy)[2], torch.zeros_like(m.weight))


def closed_form(x2, g2, k):
    """(winner set, k_s, per-draw terms Y_j and probabilities p'_j) of the estimator, from
    the paper's rule computed here independently (p ∝ ||x||, float64)."""
    norms = x2.norm(dim=1)
    c = brute_force_winners((norms / norms.sum()).tolist(), k)
    order = torch.argsort(norms, descending=True)
    winners = set(order[:c].tolist())
    rest = [j for j in range(len(norms)) if j not in winners]
    mass = norms[rest].sum()
    probs = norms[rest] / mass
    terms = torch.stack([torch.outer(g2[j], x2[j]) / probs[i] for i, j in enumerate(rest)])
    return winners, k - c, terms, probs


@pytest.mark.parametrize("big", [(), (3, 17, 40)])
def test_monte_carlo_mean_within_3_sigma(big):
    """The mean of T estimates against the exact gradient, in units of the closed-form
    standard deviation: along fixed directions (3 sigma) and in Frobenius norm."""
    m, _ = layer()
    x, dy = inputs(big=big)
    x2, g2 = x.reshape(60, -1), dy.reshape(60, -1)
    exact = exact_grad_w("linear", x, dy)
    winners, k_s, terms, probs = closed_form(x2, g2, wta.kept_rows(60, 0.3, 10))
    rest_sum = (probs[:, None, None] * terms).sum(0)
    # Var_WTA = (1/k_s)[(1 - P_C) sum ||x_j||^2 ||g_j||^2 / p_j - ||sum_{j not in C} g_j x_j^T||_F^2]
    norms = x2.norm(dim=1)
    p = norms / norms.sum()
    rest = [j for j in range(60) if j not in winners]
    var_total = ((1 - p[list(winners)].sum()) * sum(norms[j] ** 2 * g2[j].norm() ** 2 / p[j] for j in rest)
                 - rest_sum.norm() ** 2) / k_s
    var_entry = ((probs[:, None, None] * terms ** 2).sum(0) - rest_sum ** 2) / k_s
    torch.testing.assert_close(var_entry.sum(), var_total, rtol=1e-10, atol=0)
    torch.manual_seed(11)
    T = 1500
    total = torch.zeros_like(exact)
    for _ in range(T):
        total += run(m, x, dy)[2]
    err = total / T - exact
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        d = torch.randn(exact.shape, generator=g, dtype=F64)
        along = (terms * d).sum((1, 2))  # <Y_j, d> for each j outside C
        sigma = math.sqrt(((probs * along ** 2).sum() - (rest_sum * d).sum() ** 2) / (k_s * T))
        assert abs((err * d).sum()) < 3 * sigma
    ratio = err.pow(2).sum() / (var_total / T)  # a sum of 30 squared errors: near 1
    assert 0.3 < ratio < 2.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("n", [60, 8])
def test_saved_bytes_equal_the_formula(kind, dtype, n):
    m, _ = layer(kind, d_in=7, d_out=3, dtype=dtype)
    x = inputs(n=n, d_in=7, d_out=3, dtype=dtype)[0].requires_grad_()
    got = saved_bytes(m, x, exclude=list(m.parameters()))
    assert got == wta.saved_bytes(n, 7, x.element_size(), 0.3, 10)
    _, plain = layer(kind, d_in=7, d_out=3, dtype=dtype)
    assert saved_bytes(plain, x, exclude=list(plain.parameters())) == n * 7 * x.element_size()


def test_layers_reading_one_input_share_one_sample():
    """Two layers on the same input tensor keep one set of rows (one storage); a new input,
    or the same one changed in place, draws again. Each estimate is still unbiased: the
    shared draw is the one each would make alone."""
    a, _ = layer(d_out=5)
    b, _ = layer(d_out=3, seed=1)
    x = inputs()[0].requires_grad_()
    params = [*a.parameters(), *b.parameters()]
    one = wta.saved_bytes(60, 6, 8, 0.3, 10)
    assert saved_bytes(lambda t: a(t).sum() + b(t).sum(), x, exclude=params) == one
    assert saved_bytes(lambda t: a(t).sum() + b(t * 1).sum(), x, exclude=params) == 2 * one

    def changed(t):
        y = a(t).sum()
        with torch.no_grad():
            t.mul_(1.0)  # a new version of the same tensor
        return y + b(t).sum()

    assert saved_bytes(changed, x.detach().clone(), exclude=params) == 2 * one


def test_draws_follow_the_global_seed_and_eval_is_plain():
    m, plain = layer()
    x, dy = inputs()
    torch.manual_seed(4)
    a = run(m, x, dy)[2]
    torch.manual_seed(4)
    b = run(m, x, dy)[2]
    c = run(m, x, dy)[2]
    assert torch.equal(a, b) and not torch.equal(b, c)
    m.eval()
    torch.testing.assert_close(run(m, x, dy)[2], run(plain, x, dy)[2], rtol=1e-13, atol=1e-13)


PAPER = {"gpt2-tiny": ["attn.c_proj", "mlp.c_fc", "mlp.c_proj"],
         "bert-tiny": ["attention.output.dense", "intermediate.dense", "output.dense"],
         "llama-tiny": ["self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]}
LORA_QKV = {"gpt2-tiny": ["attn.c_attn.lora_A"],
            "bert-tiny": [f"attention.self.{n}.lora_A" for n in ("query", "key", "value")],
            "llama-tiny": [f"self_attn.{n}_proj.lora_A" for n in "qkv"]}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_layers_per_family(name):
    method = load("wta_crs")
    model = method.transform_model(models.build(name))
    assert method.report["layers"] == PAPER[name] and method.report["count"] == 2 * len(PAPER[name])
    names = [n for n, m in model.named_modules() if isinstance(m, wta._Sampled)]
    assert len(names) == 2 * len(PAPER[name])
    assert set(dict(model.named_parameters())) == set(dict(models.build(name).named_parameters()))
    method = load("lora+wta_crs@rank=4")
    model = method.transform_model(models.build(name))
    assert method.report["wta_crs"]["layers"] == LORA_QKV[name]
    assert all(isinstance(m.lora_A, wta._Sampled) == (wta.layer_kind(n).split(".")[-1] in wta.QKV)
               for n, m in model.named_modules() if isinstance(m, LoRALinear))
    method = load("wta_crs@wta_layers=all-linear")
    method.transform_model(models.build(name))
    assert method.report["count"] == {"gpt2-tiny": 8, "bert-tiny": 12, "llama-tiny": 14}[name]


def test_lora_without_qkv_is_a_clear_error_and_options_are_checked():
    with pytest.raises(MethodError, match="LoRA A inputs of the query, key and value"):
        load("lora@targets=o_proj+wta_crs").transform_model(models.build("llama-tiny"))
    for bad in ({"ratio": 0.0}, {"ratio": 1.5}, {"min_rows": 0}, {"wta_layers": "qkv"}):
        with pytest.raises(MethodError, match=next(iter(bad))):
            load("wta_crs", bad)


def saved_after_forward(spec, name, batch):
    """Activation bytes the tracker holds once the loss exists (everything saved for
    backward), and the method's report."""
    torch.manual_seed(0)
    method = load(spec)
    model = method.transform_model(models.build(name))
    model.train()
    tracker = MemoryTracker()
    tracker.register_model(model)
    with tracker:
        loss = lm_loss(model, batch)
        activation = tracker.live_split().activation
    del loss
    return activation, method.report


@pytest.mark.parametrize("name", sorted(PAPER))
def test_report_states_what_a_tracked_forward_frees(name):
    """The probe's finding (`inputs_freed`, `inputs_held`, bytes per token and per kept row)
    against the activation bytes a tracked forward of 16 x 64 tokens holds."""
    batch = lm_batch(16, 64, models.vocab_size(name), seed=1)
    plain, _ = saved_after_forward("adamw", name, batch)
    sampled, report = saved_after_forward("wta_crs", name, batch)
    n, k = 16 * 64, wta.kept_rows(16 * 64, 0.3, 10)
    assert plain - sampled == report["freed_bytes_per_token"] * n - report["kept_bytes_per_row"] * k
    _, c = models.config_of(name)
    d = c.get("n_embd") or c["hidden_size"]
    ff = c.get("n_inner") or c.get("intermediate_size") or 4 * d
    if name == "llama-tiny":  # SDPA keeps its output, o_proj's input: only the MLP's inputs go
        assert report["inputs_held"] == {"self_attn.o_proj": 2}
        assert report["freed_bytes_per_token"] == 2 * 4 * (d + ff)  # gate/up share theirs
        assert report["kept_bytes_per_row"] == 2 * (2 * (4 * d + 8) + 4 * ff + 8)  # gate/up share a sample
    else:
        assert report["inputs_held"] == {} and report["freed_bytes_per_token"] == 2 * 4 * (2 * d + ff)


def test_memory_jobs_tracked_and_simulated(tiny_job):
    """At 16 x 64 LLaMA's peak is the end of forward: its activation bytes drop by the
    report's amount exactly; the simulated tier matches the tracked one byte for byte."""
    job = dict(model="llama-tiny", batch_size=16, seq_len=64)
    plain = runner.run(tiny_job(method="adamw", **job))
    real = runner.run(tiny_job(method="wta_crs", **job))
    fake = runner.run(tiny_job(method="wta_crs", simulate=True, **job))
    for r in (plain, real, fake):
        assert r["status"] == "ok", r.get("message")
    for key, value in real["memory"].items():
        if key.endswith("_bytes"):
            assert fake["memory"][key] == value, key
    report, n = real["method_report"], 16 * 64
    drop = report["freed_bytes_per_token"] * n - report["kept_bytes_per_row"] * wta.kept_rows(n, 0.3, 10)
    assert plain["memory"]["activation_bytes"] - real["memory"]["activation_bytes"] == drop > 0
    assert real["loss"] == pytest.approx(plain["loss"], rel=2e-2)  # after one sampled step


def test_lora_stacks_free_what_the_report_says(tiny_job):
    """lora+wta_crs samples the q, k, v LoRA A inputs (one shared sample a block): the
    activation bytes drop by the report's amount; peft's LoRA (lora_peft) the same."""
    job = dict(model="llama-tiny", batch_size=16, seq_len=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora, ours, peft = (runner.run(tiny_job(method=m, **job)) for m in ("lora", "lora+wta_crs",
                                                                               "lora_peft+wta_crs"))
    for r in (lora, ours, peft):
        assert r["status"] == "ok", r.get("message")
    report, n = ours["method_report"]["wta_crs"], 16 * 64
    assert report["kept_bytes_per_row"] == 2 * (4 * 128 + 8)
    drop = report["freed_bytes_per_token"] * n - report["kept_bytes_per_row"] * wta.kept_rows(n, 0.3, 10)
    assert lora["memory"]["activation_bytes"] - ours["memory"]["activation_bytes"] == drop > 0
    assert peft["memory"] == ours["memory"]


@pytest.mark.parametrize("stack", ["lora+wta_crs", "checkpointing+wta_crs"])
def test_stacks_run_and_simulate(tiny_job, stack):
    real = runner.run(tiny_job(method=stack, model="llama-tiny"))
    fake = runner.run(tiny_job(method=stack, model="llama-tiny", simulate=True))
    assert real["status"] == fake["status"] == "ok", (real.get("message"), fake.get("message"))
    for key, value in real["memory"].items():
        if key.endswith("_bytes") and not (stack.startswith("checkpointing") and key in ("peak_bytes", "other_bytes")):
            assert fake["memory"][key] == value, key


def test_checkpointing_redraws_the_same_rows():
    """Recomputation restores the RNG state: the same rows, so the same gradients."""
    name = "llama-tiny"
    batch = lm_batch(2, 32, models.vocab_size(name), seed=2)
    got = []
    for spec in ("wta_crs", "checkpointing+wta_crs"):
        torch.manual_seed(0)
        model = load(spec).transform_model(models.build(name, dropout=0.0).to(F64))
        model.train()
        torch.manual_seed(7)
        lm_loss(model, batch).backward()
        got.append({n: p.grad for n, p in model.named_parameters()})
    for key in got[0]:
        torch.testing.assert_close(got[1][key], got[0][key], rtol=1e-10, atol=1e-12)

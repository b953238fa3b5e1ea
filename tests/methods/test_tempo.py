"""Tempo: each layer against autograd on the layer it replaces, the bytes it saves, whole
models, the report, and the runner (tracked and simulated tiers)."""
import copy
import math

import pytest
import torch
from torch import nn
from transformers import activations

from bench import models
from bench.measure import runner
from bench.method import load, lm_loss
from methods import tempo as T
from conftest import grads, lm_batch, saved_bytes

F64 = torch.float64
GELUS = {  # variant -> the module it replaces
    "erf": lambda: activations.GELUActivation(),
    "erf_python": lambda: activations.GELUActivation(use_gelu_python=True),
    "tanh": lambda: nn.GELU(approximate="tanh"),
    "tanh_python": lambda: activations.NewGELUActivation(),
}


def gelu_points(family, dtype=F64, seed=0):
    """Random points, plus points at and near the minimum and deep in the left tail."""
    g = torch.Generator().manual_seed(seed)
    x_min = T._GELU_MIN[family][0]
    near = x_min + torch.cat([torch.zeros(1, dtype=F64), torch.randn(200, generator=g, dtype=F64) * 1e-6,
                              torch.randn(200, generator=g, dtype=F64) * 1e-3])
    tail = -torch.rand(200, generator=g, dtype=F64) * 40 - 3
    x = torch.cat([torch.randn(2000, generator=g, dtype=F64) * 3, near, tail, torch.zeros(1, dtype=F64)])
    return x.to(dtype)






# -- bit packing -----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 5, 7), (16,), (1,), (2, 4, 8, 8)])
def test_bit_packing_round_trips_in_an_eighth_of_the_bytes(shape):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(0)) > 0.5
    packed = T.pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(mask.numel() / 8)
    assert torch.equal(T.unpack_bits(packed, mask.shape), mask)


# -- GELU --------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(GELUS))
def test_gelu_variant_is_detected(variant):
    assert T.gelu_variant(GELUS[variant]()) == variant


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("variant", list(GELUS))
def test_gelu_float64_matches_autograd(variant, pack):
    family = T.GELU_VARIANTS[variant][1]
    x = gelu_points(family)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    y_ref, g_ref = grads(GELUS[variant](), x, dy)
    y, g = grads(T.InplaceGELU(variant, pack), x, dy)
    assert torch.equal(y, y_ref)  # the same forward op, bit for bit
    assert torch.isfinite(g).all()
    x_min = T._GELU_MIN[family][0]
    far = (x - x_min).abs() > 1e-3
    torch.testing.assert_close(g[far], g_ref[far], rtol=1e-10, atol=1e-12)
    # near the flat minimum x is known from y only to sqrt(rounding): slope error ~1e-8
    torch.testing.assert_close(g[~far], g_ref[~far], rtol=0, atol=1e-7)
    # where GELU(x) rounds to 0 the slope is taken as 0; the true one is negligible there
    lost = (y == 0) & (x < x_min)
    assert lost.any() and g[lost].abs().max() == 0 and g_ref[lost].abs().max() < 1e-13


# float32: 1.6e-4 on one x86 CPU, 2.8e-4 on another (the float32 GELU's own rounding
# near its minimum differs), see methods/tempo's docstring
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 3e-4), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("variant", ["erf", "tanh_python"])
def test_gelu_low_precision_within_stated_error(variant, dtype, atol):
    x = gelu_points(T.GELU_VARIANTS[variant][1], dtype)
    dy = torch.ones_like(x)
    y_ref, g_ref = grads(GELUS[variant](), x, dy)
    y, g = grads(T.InplaceGELU(variant), x, dy)
    assert torch.equal(y, y_ref) and g.dtype == dtype
    torch.testing.assert_close(g.double(), g_ref.double(), rtol=0, atol=atol)


def test_gelu_backward_in_pieces_equals_one_piece(monkeypatch):
    x = gelu_points("erf")
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    _, whole = grads(T.InplaceGELU("erf"), x, dy)
    monkeypatch.setattr(T, "GELU_BACKWARD_MIN_CHUNK", 100)
    _, pieces = grads(T.InplaceGELU("erf"), x, dy)
    assert torch.equal(whole, pieces)


# -- LayerNorm ------------------------------------------------------------------------------


def layer_norm_pair(h=32, gamma=None, seed=0):
    torch.manual_seed(seed)
    ln = nn.LayerNorm(h, eps=1e-5).to(F64)
    with torch.no_grad():
        ln.weight.copy_(torch.randn(h, dtype=F64) if gamma is None else gamma)
        ln.bias.normal_()
    return ln, T.InplaceLayerNorm.from_layer_norm(copy.deepcopy(ln))


def ln_grads(ln, x, dy):
    ln.zero_grad()
    x = x.detach().clone().requires_grad_()
    ln(x).backward(dy)
    return x.grad, ln.weight.grad.clone(), ln.bias.grad.clone()


def test_layernorm_float64_matches_autograd():
    ln, tln = layer_norm_pair()
    x = torch.randn(3, 7, 32, dtype=F64) * 2 + 0.5
    dy = torch.randn_like(x)
    assert torch.equal(tln(x), ln(x))
    for got, ref in zip(ln_grads(tln, x, dy), ln_grads(ln, x, dy)):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)


def test_layernorm_keeps_the_parameter_objects():
    ln = nn.LayerNorm(8)
    tln = T.InplaceLayerNorm.from_layer_norm(ln)
    assert tln.weight is ln.weight and tln.bias is ln.bias and list(tln.parameters()) == list(ln.parameters())


def test_layernorm_zero_gamma_is_finite_and_exact_where_stated():
    gamma = torch.randn(32, dtype=F64, generator=torch.Generator().manual_seed(3))
    gamma[[3, 10, 20]] = 0.0
    gamma[10] = 1e-300  # tiny, not zero: divides into an inf without the clamp
    x = torch.randn(5, 32, dtype=F64)
    dy = torch.randn_like(x)
    for zeros in ([3], [3, 10, 20]):
        g = gamma.clone()
        if zeros == [3]:
            g[[10, 20]] = 1.0
        ln, tln = layer_norm_pair(gamma=g)
        got, ref = ln_grads(tln, x, dy), ln_grads(ln, x, dy)
        assert all(torch.isfinite(t).all() for t in got)
        torch.testing.assert_close(got[2], ref[2], rtol=1e-12, atol=1e-12)  # dbeta never needs xhat
        # the column with the smallest |gamma| keeps xhat exactly; others with gamma ~ 0 do not
        # (their dgamma and their own dx); every other column is exact
        col = int(g.abs().argmin())
        exact = torch.ones(32, dtype=torch.bool)
        exact[[z for z in zeros if z != col]] = False
        assert exact[col]
        torch.testing.assert_close(got[0][:, exact], ref[0][:, exact], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got[1][exact], ref[1][exact], rtol=1e-10, atol=1e-12)


def test_layernorm_all_gamma_zero_gives_zero_input_gradient():
    ln, tln = layer_norm_pair(gamma=torch.zeros(16, dtype=F64), h=16)
    x = torch.randn(4, 16, dtype=F64)
    dy = torch.randn_like(x)
    got, ref = ln_grads(tln, x, dy), ln_grads(ln, x, dy)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-12)  # both 0: y does not depend on x
    assert all(torch.isfinite(t).all() for t in got)


# -- attention -------------------------------------------------------------------------------


class _Module(nn.Module):
    pass


def eager_attention(q, k, v, mask, p):
    from transformers.models.bert.modeling_bert import eager_attention_forward

    module = _Module().train()
    return eager_attention_forward(module, q, k, v, mask, scaling=0.3, dropout=p)[0]


def tempo_attention(q, k, v, mask, p, pack=True):
    module = _Module().train()
    module.tempo_pack_masks = pack
    return T.tempo_attention_forward(module, q, k, v, mask, scaling=0.3, dropout=p)[0]


@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("mask_kind", ["causal", "none", "bool"])
@pytest.mark.parametrize("p", [0.1, 0.0])
def test_attention_matches_eager_bit_for_bit(p, mask_kind, pack):
    b, a, s, d = 2, 3, 9, 4
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, a, s, d, generator=g, dtype=F64, requires_grad=True) for _ in range(3))
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    additive = torch.zeros(b, 1, s, s, dtype=F64).masked_fill(~causal, torch.finfo(F64).min)
    # eager takes additive masks only; a boolean one (True: attend) must mean the same
    masks = {"none": (None, None), "causal": (additive, additive),
             "bool": (additive, causal.expand(b, 1, s, s))}[mask_kind]
    dout = torch.randn(b, s, a, d, generator=g, dtype=F64)
    results = []
    for fn, mask in zip((eager_attention, lambda *args: tempo_attention(*args, pack=pack)), masks):
        torch.manual_seed(5)  # the same dropout mask
        out = fn(q, k, v, mask, p)
        grads_ = torch.autograd.grad(out, (q, k, v), dout)
        results.append((out, *grads_))
    for got, ref in zip(results[1], results[0]):
        assert torch.equal(got, ref)


# -- bytes saved per layer (METHODS.md 4.2), counting what the next Linear saves anyway -----


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("variant, baseline_copies", [("erf", 1), ("tanh_python", 4)])
@pytest.mark.parametrize("pack", [True, False])
def test_gelu_saves_the_predicted_bytes(variant, baseline_copies, pack, dtype):
    h, rows = 16, 2 * 12
    up, down = nn.Linear(h, 4 * h).to(dtype), nn.Linear(4 * h, h).to(dtype)
    x = torch.randn(2, 12, h, dtype=dtype, requires_grad=True)
    params = [*up.parameters(), *down.parameters()]
    base = saved_bytes(lambda x: down(GELUS[variant]()(up(x))), x, exclude=params)
    tempo = saved_bytes(lambda x: down(T.InplaceGELU(variant, pack)(up(x))), x, exclude=params)
    n, e = rows * 4 * h, x.element_size()
    # Baseline: GELU's input (GPT-2's Python GELU: 4 tensors: x, tanh, x/2, 1 + tanh), with the
    # output saved by the next Linear. Tempo: the output (the same storage) and the mask.
    # 4.2's S*4H*(e - 1) for a bool mask, S*4H*(e - 1/8) bit-packed (times 4 for GPT-2's GELU)
    mask = math.ceil(n / 8) if pack else n
    assert base - tempo == baseline_copies * n * e - mask


@pytest.mark.parametrize("exact_columns", [1, 0])
def test_layernorm_saves_the_predicted_bytes(exact_columns):
    h, rows = 32, 2 * 10
    ln, lin = nn.LayerNorm(h), nn.Linear(h, h)
    x = torch.randn(2, 10, h, requires_grad=True)
    params = [*ln.parameters(), *lin.parameters()]
    tln = T.InplaceLayerNorm.from_layer_norm(ln, exact_columns)
    base = saved_bytes(lambda x: lin(ln(x)), x, exclude=params)
    tempo = saved_bytes(lambda x: lin(tln(x)), x, exclude=params)
    e = x.element_size()
    # 4.2: S*H*e per LayerNorm (x is dropped, y is the Linear's input anyway); the mean
    # (S*e) is dropped too, and pays for the one exactly kept xhat column
    assert base - tempo == rows * h * e + rows * e - rows * exact_columns * e


@pytest.mark.parametrize("pack", [True, False])
def test_attention_saves_the_predicted_bytes(pack):
    b, a, s, d = 2, 4, 16, 8
    q, k, v = (torch.randn(b, a, s, d, requires_grad=True) for _ in range(3))
    base = saved_bytes(lambda q, k, v: eager_attention(q, k, v, None, 0.1), q, k, v)
    tempo = saved_bytes(lambda q, k, v: tempo_attention(q, k, v, None, 0.1, pack), q, k, v)
    n, e = b * a * s * s, q.element_size()
    # 4.2: A*S^2*e (the dropout output). On CPU the baseline's dropout keeps its mask as a
    # tensor of the activation dtype (on CUDA as bool), which Tempo stores in n/8 bytes
    mask = math.ceil(n / 8) if pack else n
    assert base - tempo == n * e + n * e - mask


# -- whole models ------------------------------------------------------------------------------




@pytest.mark.parametrize("dropout", [0.1, 0.0])
@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny"])
def test_whole_model_same_loss_and_gradients_float64(name, dropout):
    torch.manual_seed(0)
    base = models.build(name, "eager", dropout).to(F64).train()
    tempo_model = copy.deepcopy(base)
    method = load("tempo")
    params_before = [id(p) for p in tempo_model.parameters()]
    tempo_model = method.transform_model(tempo_model)
    assert [id(p) for p in tempo_model.parameters()] == params_before
    assert method.report["attention"] == 2 if dropout else method.report["attention"].startswith("not replaced")
    batch = lm_batch(n=2, t=24)
    losses = []
    for model in (base, tempo_model):
        torch.manual_seed(1)  # the same dropout masks
        loss = lm_loss(model, batch)
        loss.backward()
        losses.append(loss)
    assert losses[1].item() == losses[0].item()
    scale = max(p.grad.abs().max() for p in base.parameters())
    for (name_, p), q in zip(base.named_parameters(), tempo_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-7, atol=1e-10 * scale, msg=name_)


def test_report_names_what_was_replaced_and_why_not():
    expected = {"bert-tiny": (3, 6), "gpt2-tiny": (2, 5)}  # GELUs; LayerNorms (incl. head/final)
    for name, (gelus, norms) in expected.items():
        method = load("tempo")
        method.transform_model(models.build(name, "sdpa"))
        report = method.report
        assert report["gelu"] == gelus and report["layernorm"] == norms
        assert report["attention"].startswith("not replaced: sdpa attention never materialises the SxS")
        method = load("tempo")
        method.transform_model(models.build(name, "eager"))
        assert method.report["attention"] == 2
    method = load("tempo")
    method.transform_model(models.build("llama-tiny", "eager"))
    report = method.report
    assert "nothing replaced" in report["summary"]
    assert "SiLU" in report["gelu"] and "RMSNorm" in report["layernorm"]
    assert report["attention"].startswith("not replaced: attention dropout is 0")


# -- the runner: tracked and simulated tiers, kinds, stacks -----------------------------------


@pytest.mark.parametrize("model", ["bert-tiny", "gpt2-tiny"])
def test_runner_tracked_equals_simulated_and_saves_activations(tiny_job, model):
    jobs = dict(model=model, attn_implementation="eager", batch_size=16, seq_len=64)  # default dropout 0.1
    plain = runner.run(tiny_job(method="adamw", **jobs))
    real = runner.run(tiny_job(method="tempo", **jobs))
    fake = runner.run(tiny_job(method="tempo", simulate=True, **jobs))
    for r in (plain, real, fake):
        assert r["status"] == "ok", (r.get("message"), r.get("traceback"))
    assert fake["memory"]["tier"] == "simulated"
    for key, value in real["memory"].items():
        if key.endswith("_bytes"):
            assert fake["memory"][key] == value, key
    # the same random draws; the measured step follows a warm-up step whose gradients differ
    # by float32 rounding (GELU's slope is recovered from its output)
    assert real["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    assert real["memory"]["activation_bytes"] < 0.75 * plain["memory"]["activation_bytes"]
    assert real["memory"]["param_bytes"] == plain["memory"]["param_bytes"]
    assert real["method_report"]["attention"] == 2


def test_runner_kinds_and_stacks(tiny_job):
    eager = dict(model="bert-tiny", attn_implementation="eager", batch_size=4, seq_len=16)
    for job in (tiny_job(kind="throughput", method="tempo", steps=2, warmup_steps=1, **eager),
                tiny_job(kind="convergence", method="tempo", steps=3, log_every=0, **eager),
                tiny_job(method="adama+tempo", **eager),
                tiny_job(method="tempo+grad_accum", **eager)):
        record = runner.run(job)
        assert record["status"] == "ok", (job, record.get("message"))
        report = record["method_report"]
        assert (report.get("tempo") or report)["gelu"] == 3


def test_runs_under_autocast():
    # autocast's float32 layer norm and mixed-dtype attention fall back to the plain ops;
    # the GELU runs in the autocast dtype
    torch.manual_seed(0)
    model = load("tempo").transform_model(models.build("gpt2-tiny", "eager")).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(model, lm_batch(n=2, t=16))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())

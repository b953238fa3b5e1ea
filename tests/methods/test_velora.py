"""VeLoRA (methods/velora.py) against autograd, the paper's reconstruction formula and
saved-tensor hooks."""
import weakref

import pytest
import torch
import torch.nn.functional as F
from transformers.pytorch_utils import Conv1D

from bench import models
from bench.measure import runner
from bench.method import MethodError, load, lm_loss
from conftest import lm_batch, saved_bytes
from methods.lora import LoRALinear
from methods.velora import LAYER_CHOICES, VeLoRALayer, groups_for, wrap

DEFAULT_LAYERS = {
    "gpt2-tiny": ["attn.c_attn", "mlp.c_proj"],
    "bert-tiny": ["attention.self.value", "output.dense"],
    "llama-tiny": ["self_attn.v_proj", "mlp.down_proj"],
}
# measured on the tiny models (saved-tensor hooks, below): the value projection's input is
# also kept by the q and k projections in BERT and LLaMA; GPT-2's fused c_attn is its only reader
HELD = {"gpt2-tiny": [], "bert-tiny": ["attention.self.value"], "llama-tiny": ["self_attn.v_proj"]}


def layer(kind="linear", d_in=32, d_out=12, groups=8, scale=1.0, bias=True):
    torch.manual_seed(0)
    if kind == "linear":
        m = torch.nn.Linear(d_in, d_out, bias=bias, dtype=torch.float64)
    else:
        m = Conv1D(d_out, d_in).to(torch.float64)
        torch.nn.init.normal_(m.bias)
    return wrap(m, groups, scale).train()


def plain(m):
    """The layer's own forward (as before wrapping): F.linear, or Conv1D's addmm."""
    return lambda x: super(VeLoRALayer, m).forward(x)


def run(m, x, dy):
    x = x.detach().clone().requires_grad_()
    y = m(x)
    m.zero_grad(set_to_none=True)
    y.backward(dy)
    return y.detach(), x.grad, m.weight.grad.clone(), None if m.bias is None else m.bias.grad.clone()


def reference_dw(m, x, dy, scale):
    """The paper's estimate written out: every sub-token replaced by (x . v) v, then
    scale * dy^T x^, in the weight's layout."""
    v = m.velora_v
    sub = x.reshape(-1, v.numel())
    x_hat = ((sub @ v)[:, None] * v[None, :]).reshape(-1, x.shape[-1])
    dw = scale * dy.reshape(-1, dy.shape[-1]).t() @ x_hat  # [out, in]
    return dw if isinstance(m, torch.nn.Linear) else dw.t()


def data(d_in=32, d_out=12, b=3, n=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, n, d_in, generator=g, dtype=torch.float64) + 0.3,
            torch.randn(b, n, d_out, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_forward_input_and_bias_gradients_exact_weight_gradient_the_papers(kind):
    m = layer(kind, scale=0.7)
    x, dy = data()
    y, dx, dw, db = run(m, x, dy)
    assert torch.equal(y, plain(m)(x))  # the same operation as the unwrapped layer
    want_y, want_dx = (t.detach() for t in torch.autograd.functional.vjp(plain(m), x, dy))
    torch.testing.assert_close(y, want_y, rtol=0, atol=0)
    torch.testing.assert_close(dx, want_dx, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(db, dy.sum((0, 1)), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(dw, reference_dw(m, x, dy, 0.7), rtol=1e-12, atol=1e-12)
    exact = dy.reshape(-1, 12).t() @ x.reshape(-1, 32)
    assert not torch.allclose(dw, exact if kind == "linear" else exact.t(), atol=1e-3)  # it is an estimate


def test_v_is_the_normalised_first_batch_mean_then_frozen():
    m = layer()
    x, dy = data()
    run(m, x, dy)
    want = F.normalize(x.reshape(-1, 4).mean(0), dim=0)
    torch.testing.assert_close(m.velora_v, want, rtol=1e-14, atol=1e-14)
    run(m, data(seed=7)[0] * 3 - 1, dy)
    torch.testing.assert_close(m.velora_v, want, rtol=0, atol=0)
    with torch.no_grad():  # no_grad and eval run the plain layer
        assert torch.equal(m(x), plain(m)(x))
    assert "velora_v" in m.state_dict()


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
def test_one_group_per_feature_or_sub_tokens_on_v_are_exact(kind):
    x, dy = data()
    m = layer(kind, groups=32)  # M = 1: every sub-token is its own projection
    assert m.velora_v.numel() == 1
    _, _, dw, _ = run(m, x, dy)
    exact = dy.reshape(-1, 12).t() @ x.reshape(-1, 32)
    torch.testing.assert_close(dw, exact if kind == "linear" else exact.t(), rtol=1e-12, atol=1e-12)
    m = layer(kind, groups=8)  # every sub-token on one direction u: v = u, reconstruction exact
    u = F.normalize(torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64), dim=0)
    on_u = (torch.rand(3, 5, 8, 1, dtype=torch.float64) + 0.1) * u
    x_on = on_u.reshape(3, 5, 32)
    _, _, dw, _ = run(m, x_on, dy)
    exact = dy.reshape(-1, 12).t() @ x_on.reshape(-1, 32)
    torch.testing.assert_close(m.velora_v, u, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(dw, exact if kind == "linear" else exact.t(), rtol=1e-12, atol=1e-12)


def test_each_groups_block_has_rank_one_with_row_space_v_and_scale_is_linear():
    x, dy = data()
    grads = {}
    for scale in (0.5, 2.0):
        m = layer(groups=8, scale=scale)
        _, dx, dw, _ = run(m, x, dy)
        grads[scale] = (dx, dw)
    dw = grads[0.5][1]
    v = m.velora_v
    for g in range(8):
        block = dw[:, 4 * g: 4 * (g + 1)]
        s = torch.linalg.svdvals(block)
        assert s[0] > 1e-3 and s[1:].max() < 1e-12 * s[0]
        torch.testing.assert_close(block, (block @ v)[:, None] * v[None, :], rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(grads[2.0][1], 4 * grads[0.5][1], rtol=1e-13, atol=0)
    torch.testing.assert_close(grads[2.0][0], grads[0.5][0], rtol=0, atol=0)  # dx does not depend on it


@pytest.mark.parametrize("kind", ["linear", "conv1d"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_are_the_formula(kind, dtype):
    """B N G elements of z and the M of v, in x's dtype; the weight is the parameter."""
    b, n, d_in, d_out, groups = 4, 16, 128, 48, 32
    m = layer(kind, d_in, d_out, groups).to(dtype)
    x = torch.randn(b, n, d_in, dtype=dtype, requires_grad=True)
    e = x.element_size()
    params = list(m.parameters())
    assert saved_bytes(m, x, exclude=params) == (b * n * groups + d_in // groups) * e
    m.velora_ready = True  # the second batch: the same
    assert saved_bytes(m, x, exclude=params) == (b * n * groups + d_in // groups) * e
    assert saved_bytes(plain(m), x, exclude=params) == b * n * d_in * e  # the plain layer keeps x


def test_groups_for_widths_it_does_not_divide():
    assert [groups_for(d, 32) for d in (128, 512, 4096, 11008)] == [32, 32, 32, 32]
    assert groups_for(344, 32) == 43 and groups_for(5461, 32) == 43  # llama-tiny, llama-1b
    assert groups_for(344, 86) == 86 and groups_for(1376, 86) == 86  # the C4-60M script
    assert groups_for(16, 100) == 16 and groups_for(7, 3) == 7
    assert "vd" in LAYER_CHOICES and "qkvogud" in LAYER_CHOICES and "dv" not in LAYER_CHOICES
    for bad in ({"velora_layers": "x"}, {"num_groups": 0}, {"velora_scale": 0.0}):
        with pytest.raises(MethodError, match=next(iter(bad))):
            load("velora", bad)
    assert load("lora+velora").hp["rank"] == 16  # no option clashes with LoRA's


def build(name, spec, dtype=torch.float64):
    torch.manual_seed(0)
    method = load(spec)
    model = method.transform_model(models.build(name, dropout=0.0).to(dtype)).train()
    return method, model


def velora_report(method):
    return method.report["velora"] if "velora" in method.report else method.report


@pytest.mark.parametrize("name", sorted(DEFAULT_LAYERS))
def test_default_layers_per_family_keep_their_type_and_names(name):
    torch.manual_seed(0)
    before = models.build(name)
    names = [n for n, _ in before.named_parameters()]
    method, model = build(name, "velora")
    wrapped = sorted({n.split(".", 4 if name == "bert-tiny" else 3)[-1]
                      for n, m in model.named_modules() if isinstance(m, VeLoRALayer)})
    assert wrapped == sorted(DEFAULT_LAYERS[name]) == sorted(method.report["layers"])
    assert [n for n, _ in model.named_parameters()] == names
    for m in model.modules():
        if isinstance(m, VeLoRALayer):
            assert isinstance(m, (torch.nn.Linear, Conv1D))
    layers = method.report["layers"]
    if name == "llama-tiny":  # 344 = 43 x 8: the smallest divisor not below 32
        assert layers["mlp.down_proj"]["num_groups"] == 43 and layers["mlp.down_proj"]["sub_token_size"] == 8
    assert all(e["count"] == 2 for e in layers.values())


def test_lora_velora_wraps_the_adapters_A_and_As_gradient_is_the_formula():
    method, model = build("llama-tiny", "lora@dropout=0.0+velora@velora_scale=0.1")
    adapters = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    for n, m in adapters.items():
        wrapped = n.endswith(("v_proj", "down_proj"))
        assert isinstance(m.lora_A, VeLoRALayer) == wrapped, n
        assert not isinstance(m.base_layer, VeLoRALayer) and not isinstance(m.lora_B, VeLoRALayer)
    assert method.report["velora"]["layers"]["self_attn.v_proj"]["wraps"] == "self_attn.v_proj.lora_A"
    g = torch.Generator().manual_seed(3)
    for m in adapters.values():  # B off zero, so A has a gradient
        torch.nn.init.normal_(m.lora_B.weight, generator=g)
    seen = {}
    target = adapters["model.layers.1.mlp.down_proj"].lora_A
    target.register_forward_hook(lambda mod, args, out: seen.update(x=args[0].detach(), y=out))
    loss = lm_loss(model, lm_batch(2, 16, 256, seed=1))
    dy = torch.autograd.grad(loss, seen["y"], retain_graph=True)[0]
    loss.backward()
    torch.testing.assert_close(target.weight.grad, reference_dw(target, seen["x"], dy, 0.1), rtol=1e-10, atol=1e-14)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    with pytest.raises(MethodError, match="frozen"):  # no adapter on v or down: nothing to wrap
        build("llama-tiny", "lora@targets=q_proj+velora")
    method, model = build("llama-tiny", "velora+lora")  # LoRA freezes what VeLoRA wrapped: plain
    lm_loss(model, lm_batch(2, 16, 256, seed=1)).backward()
    report = method.report["velora"]
    assert "frozen by a later method" in report["saving"] and report["expected_activation_change_bytes"] == 0


@pytest.mark.parametrize("spec", ["velora", "lora+velora"])
@pytest.mark.parametrize("name", sorted(DEFAULT_LAYERS))
def test_report_of_freed_and_held_inputs_matches_saved_tensor_hooks(name, spec):
    """The report's weak-reference measurement against another: the storages autograd
    saves (hooks) while the same forward runs, and the saved bytes against the baseline."""
    batch = lm_batch(2, 16, 256, seed=1)
    method, model = build(name, spec, torch.float32)
    saved, inputs, held_names = {}, {}, set()  # weak references only: nothing kept alive here

    def saw(module, args, name):
        storage = args[0].untyped_storage()
        ref = saved.get(storage._cdata)
        if ref is not None and ref() is storage:  # saved by an op before this layer ran
            held_names.add(name)
        inputs[name] = weakref.ref(storage)

    def pack(t):
        storage = t.untyped_storage()
        saved[storage._cdata] = weakref.ref(storage)
        held_names.update(n for n, ref in inputs.items() if ref() is storage)  # saved after
        return t

    for n, m in model.named_modules():
        if isinstance(m, VeLoRALayer):
            m.register_forward_pre_hook(lambda mod, args, n=n: saw(mod, args, n))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model, batch)
    report = velora_report(method)
    held = sorted({k for k, e in report["layers"].items() if e["held"]})
    measured = sorted({kind for kind in report["layers"] for n in held_names
                       if n.split(".lora_A")[0].endswith(kind)})
    assert held == measured == HELD[name]
    for kind, e in report["layers"].items():
        assert e["freed"] + e["held"] == e["count"] == 2
        if kind in HELD[name]:
            assert any(r.startswith(("self_attn.q_proj", "self_attn.k_proj", "attention.self.query"))
                       for r in e["read_also_by"])
    del loss
    base_spec = "lora" if spec.startswith("lora") else "adamw"
    _, base = build(name, base_spec, torch.float32)
    _, again = build(name, spec, torch.float32)
    params = [*base.parameters(), *base.buffers(), *again.parameters(), *again.buffers()]
    diff = saved_bytes(lambda: lm_loss(again, batch), exclude=params) - \
        saved_bytes(lambda: lm_loss(base, batch), exclude=params)
    assert diff == report["expected_activation_change_bytes"] < 0


def test_memory_run_activation_bytes_as_the_report_says(tiny_job):
    """bert-tiny at 16 x 64: the peak is at the end of the forward, so the activation bytes
    differ from AdamW's by the report's expected change, and the peak by that plus v."""
    job = dict(model="bert-tiny", batch_size=16, seq_len=64)
    base = runner.run(tiny_job(method="adamw", **job))
    real = runner.run(tiny_job(method="velora", **job))
    fake = runner.run(tiny_job(method="velora", simulate=True, **job))
    assert base["status"] == real["status"] == fake["status"] == "ok", (real.get("message"), fake.get("message"))
    report = real["method_report"]
    assert fake["method_report"] == report and report["tokens_measured"] == 16 * 64
    change = report["expected_activation_change_bytes"]
    # value: z added (16 x 64 x 32 x 4 bytes, twice), x held by query/key; output.dense: x
    # (16 x 64 x 512 x 4) freed, z (x 32) added, twice
    t = 16 * 64
    assert change == 2 * t * 32 * 4 + 2 * t * (32 - 512) * 4
    assert real["memory"]["activation_bytes"] - base["memory"]["activation_bytes"] == change
    v_bytes = 2 * (4 + 16) * 4
    assert real["memory"]["peak_bytes"] - base["memory"]["peak_bytes"] == change + v_bytes
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "peak_bytes"):
        assert fake["memory"][key] == real["memory"][key], key
    assert "input still held" in report["saving"] and "attention.self.value" in report["saving"]

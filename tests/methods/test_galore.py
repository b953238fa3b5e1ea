"""GaLore (methods/galore.py, galore_layerwise.py, galore_torch.py) against independent
references: an fp64 Algorithm 1, galore-torch, and the optimizer-state formula."""
import sys

import pytest
import torch

from bench import models
from bench.measure import runner
from bench.method import MethodError, load, lm_loss
from bench.job import Job
from methods.galore import GaLoreAdamW
from conftest import lm_batch

HP = dict(rank=16, update_proj_gap=2)  # llama-tiny has hidden size 128: rank 16 projects


def llama(dtype=torch.float32):
    torch.manual_seed(0)
    return models.build("llama-tiny").to(dtype)


def batch(seed=0, n=4, t=16):
    return lm_batch(n, t, seed=seed)


def trained(method="galore", steps=1, model=None, **hp):
    model = model or llama()
    m = load(method, {**HP, **hp})
    opt = m.make_optimizer(model)
    for s in range(steps):
        m.train_step(model, opt, batch(s))
    return model, opt


# -- which weights are projected, and the shapes of their state -----------------------------

PROJECTED = {
    "gpt2-tiny": ["transformer.h.{}.attn.c_attn.weight", "transformer.h.{}.attn.c_proj.weight",
                  "transformer.h.{}.mlp.c_fc.weight", "transformer.h.{}.mlp.c_proj.weight"],
    "bert-tiny": [f"bert.encoder.layer.{{}}.{n}.weight" for n in (
        "attention.self.query", "attention.self.key", "attention.self.value",
        "attention.output.dense", "intermediate.dense", "output.dense")],
    "llama-tiny": [f"model.layers.{{}}.{n}.weight" for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")],
}


@pytest.mark.parametrize("name", sorted(PROJECTED))
def test_attention_and_mlp_weights_are_projected_the_rest_is_adamw(name):
    torch.manual_seed(0)
    model = models.build(name)
    opt = load("galore", HP).make_optimizer(model)
    names = {id(p): n for n, p in model.named_parameters()}
    plain, projected = opt.param_groups
    assert plain["rank"] is None and projected["rank"] == 16
    expected = {n.format(layer) for n in PROJECTED[name] for layer in (0, 1)}
    assert {names[id(p)] for p in projected["params"]} == expected
    assert len(plain["params"]) + len(projected["params"]) == len(list(model.parameters()))


def test_state_shapes_follow_the_rule():
    model, opt = trained()
    r = HP["rank"]
    for name, p in model.named_parameters():
        state = opt.state[p]
        if p.dim() == 2 and ("self_attn" in name or "mlp" in name):
            m, n = p.shape
            if m >= n:  # project from the right: Q is r x n, states m x r
                assert state["proj_right"].shape == (r, n) and "proj_left" not in state
                assert state["exp_avg"].shape == state["exp_avg_sq"].shape == (m, r)
            else:  # from the left: P is m x r, states r x n
                assert state["proj_left"].shape == (m, r) and "proj_right" not in state
                assert state["exp_avg"].shape == state["exp_avg_sq"].shape == (r, n)
        else:
            assert state["exp_avg"].shape == p.shape and not {"proj_left", "proj_right"} & set(state)


def test_rank_above_the_smaller_side_is_clamped():
    # documented: r = min(rank, m, n); the projector is square and nothing is saved
    model, opt = trained(rank=1000)
    q = model.model.layers[0].self_attn.q_proj.weight  # 128 x 128
    up = model.model.layers[0].mlp.up_proj.weight  # 344 x 128
    assert opt.state[q]["proj_right"].shape == (128, 128)
    assert opt.state[q]["exp_avg"].shape == (128, 128)
    assert opt.state[up]["proj_right"].shape == (128, 128)
    assert opt.state[up]["exp_avg"].shape == (344, 128)


@pytest.mark.parametrize("proj_type", ["std", "full"])
def test_projector_is_orthonormal(proj_type):
    model, opt = trained(steps=3, proj_type=proj_type)  # refreshed at steps 0 and 2
    eye = torch.eye(HP["rank"])
    checked = 0
    for p in opt.param_groups[1]["params"]:
        state = opt.state[p]
        if "proj_left" in state:  # P^T P = I
            torch.testing.assert_close(state["proj_left"].T @ state["proj_left"], eye, atol=2e-6, rtol=0)
            checked += 1
        if "proj_right" in state:  # Q Q^T = I (Q^T is the orthonormal n x r projector)
            torch.testing.assert_close(state["proj_right"] @ state["proj_right"].T, eye, atol=2e-6, rtol=0)
            checked += 1
    assert checked == (28 if proj_type == "full" else 14)


# -- the projector is refreshed at steps 0, T, 2T, ... only --------------------------------

@pytest.mark.parametrize("method", ["galore", "galore_layerwise"])
def test_svd_only_at_multiples_of_the_gap(monkeypatch, method):
    calls = []
    step = [0]
    svd = torch.linalg.svd

    def counting(*args, **kwargs):
        calls.append(step[0])
        return svd(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "svd", counting)
    model = llama()
    m = load(method, {"rank": 16, "update_proj_gap": 3})
    opt = m.make_optimizer(model)
    for s in range(8):
        step[0] = s
        m.train_step(model, opt, batch(s))
    assert sorted(set(calls)) == [0, 3, 6]
    assert all(calls.count(s) == 14 for s in (0, 3, 6))  # once per projected weight


# -- our update against an fp64 reference of Algorithm 1 -----------------------------------

def reference(w0, grads, rank, gap, scale, lr, betas, eps, wd, proj_type, reset_states=False):
    """The paper's Algorithm 1, written out for one weight, in float64."""
    b1, b2 = betas
    w, m_, v_ = w0.clone(), 0.0, 0.0
    rows, cols = w0.shape
    use_p = proj_type in ("left", "full") or (proj_type == "std" and rows < cols) or (
        proj_type == "reverse_std" and rows >= cols)
    use_q = proj_type in ("right", "full") or (proj_type == "std" and rows >= cols) or (
        proj_type == "reverse_std" and rows < cols)
    out = []
    for t, g in enumerate(grads):
        if t % gap == 0:
            u, _, vh = torch.linalg.svd(g)
            p_, q_ = u[:, :rank], vh[:rank, :]
            if reset_states:
                m_, v_ = 0.0, 0.0
        r = g
        r = p_.T @ r if use_p else r
        r = r @ q_.T if use_q else r
        m_ = b1 * m_ + (1 - b1) * r
        v_ = b2 * v_ + (1 - b2) * r * r
        m_hat = m_ / (1 - b1 ** (t + 1))
        v_hat = v_ / (1 - b2 ** (t + 1))
        n_ = m_hat / (v_hat.sqrt() + eps)
        n_ = p_ @ n_ if use_p else n_
        n_ = n_ @ q_ if use_q else n_
        w = w - lr * wd * w
        w = w + lr * (-scale * n_)  # Algorithm 1 steps along G~ = alpha P N of the negative gradient
        out.append(w)
    return out


CASES = [((12, 20), "std"), ((20, 12), "std"), ((12, 20), "reverse_std"), ((20, 12), "left"),
         ((12, 20), "right"), ((20, 12), "full")]


def run_ours(shape, proj_type, wd, grads, w0, settings):
    w = torch.nn.Parameter(w0.clone())
    opt = GaLoreAdamW([{"params": [w], "rank": settings["rank"], "update_proj_gap": settings["gap"],
                        "scale": settings["scale"], "proj_type": proj_type}],
                      lr=settings["lr"], betas=settings["betas"], eps=settings["eps"], weight_decay=wd)
    out = []
    for g in grads:
        w.grad = g.clone()
        opt.step()
        out.append(w.detach().clone())
    return out


SETTINGS = dict(rank=4, gap=3, scale=0.25, lr=1e-2, betas=(0.9, 0.999), eps=1e-8)


def gradients(shape, steps=8):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(steps)]


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("shape, proj_type", CASES)
def test_update_equals_fp64_algorithm_1(shape, proj_type, wd):
    grads = gradients(shape)
    w0 = torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ours = run_ours(shape, proj_type, wd, grads, w0, SETTINGS)
    ref = reference(w0, grads, SETTINGS["rank"], SETTINGS["gap"], SETTINGS["scale"], SETTINGS["lr"],
                    SETTINGS["betas"], SETTINGS["eps"], wd, proj_type)
    # "full": at a refresh P^T G Q^T is diagonal up to rounding (~1e-16), and N turns that
    # noise into noise / (|noise| + eps) ~ 1e-8, moving W by lr alpha 1e-8 either way
    atol = 1e-9 if proj_type == "full" else 1e-14
    for step, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=atol, msg=f"step {step}")


def test_states_are_kept_across_projector_refreshes():
    # guards the test above: resetting M and V at a refresh gives a different update
    shape = (12, 20)
    grads = gradients(shape)
    w0 = torch.zeros(shape, dtype=torch.float64)
    ours = run_ours(shape, "std", 0.0, grads, w0, SETTINGS)
    reset = reference(w0, grads, 4, 3, 0.25, 1e-2, (0.9, 0.999), 1e-8, 0.0, "std", reset_states=True)
    torch.testing.assert_close(ours[2], reset[2], rtol=1e-12, atol=1e-14)  # before the first refresh
    assert (ours[3] - reset[3]).abs().max() > 1e-4


# -- against the authors' package ----------------------------------------------------------

@pytest.mark.parametrize("proj_type, wd", [("std", 0.0), ("full", 0.0), ("std", 0.1)])
def test_trajectory_equals_galore_torch(proj_type, wd):
    """Same model, same gradients, fp32: our optimizer against galore-torch's GaLoreAdamW.

    Both see the gradients computed on our model (teacher forcing): free-running runs
    separate after the first refresh, as the top-r singular vectors rotate within nearly
    equal singular values under rounding-level changes and M, V are kept in the rotated
    coordinates. eps = 1e-30 removes the one formula difference (galore-torch adds eps
    before the bias correction, an effective eps / sqrt(1 - b2^t)); its weight decay after
    the update moves each step by lr^2 wd |N| more (1e-5 here), within atol.
    """
    pytest.importorskip("galore_torch")
    hp = {**HP, "eps": 1e-30, "proj_type": proj_type, "weight_decay": wd}
    ours, theirs, start = llama(), llama(), llama()
    opt_a = load("galore", hp).make_optimizer(ours)
    opt_b = load("galore_torch", hp).make_optimizer(theirs)
    for s in range(5):  # refreshes at steps 0, 2, 4
        lm_loss(ours, batch(s)).backward()
        for p, q in zip(ours.parameters(), theirs.parameters()):
            q.grad = p.grad.clone()
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=2e-6 if wd == 0 else 6e-5,
                                       msg=lambda m: f"step {s} {name}: {m}")
    moved = max((p - q).abs().max() for p, q in zip(ours.parameters(), start.parameters()))
    assert moved > 0.03  # the tolerance is far below the parameters' own movement


def test_galore_torch_missing_is_a_method_error(monkeypatch, tiny_job):
    monkeypatch.setitem(sys.modules, "galore_torch", None)  # makes the import fail
    with pytest.raises(MethodError, match="pip install galore-torch==1.0"):
        load("galore_torch").make_optimizer(llama())
    record = runner.run(tiny_job(method="galore_torch", model="llama-tiny", hparams={"rank": 16}))
    assert record["status"] == "error" and "galore-torch" in record["message"]


# -- the per-layer variant --------------------------------------------------------------------

def test_layerwise_releases_each_gradient_in_its_hook():
    def grads_seen_after_optimizer_hooks(method):
        model = llama()
        m = load(method, HP)
        opt = m.make_optimizer(model)
        seen = []
        for p in model.parameters():  # registered after the optimizer's hooks: run after them
            p.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
        m.train_step(model, opt, batch())
        return seen, model

    seen, model = grads_seen_after_optimizer_hooks("galore_layerwise")
    assert len(seen) == len(list(model.parameters())) and not any(seen)
    assert all(p.grad is None for p in model.parameters())
    seen, _ = grads_seen_after_optimizer_hooks("galore")  # the control keeps its gradients
    assert all(seen)


def test_layerwise_equals_galore():
    a, _ = trained("galore", steps=3)
    b, _ = trained("galore_layerwise", steps=3)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_layerwise_refuses_micro_batches(tiny_job):
    with pytest.raises(MethodError, match="micro_batches=2 is not supported"):
        load("galore_layerwise", {"micro_batches": 2})
    with pytest.raises(MethodError, match="disagree on micro_batches"):
        load("galore_layerwise+grad_accum")
    record = runner.run(tiny_job(method="galore_layerwise", hparams={"micro_batches": 2}))
    assert record["status"] == "error" and "micro_batches=2" in record["message"]


# -- configuration --------------------------------------------------------------------------

def test_paper_defaults_and_config_overrides():
    hp = load("galore").hp
    assert (hp["rank"], hp["update_proj_gap"], hp["scale"], hp["proj_type"], hp["lr"]) == (
        128, 200, 0.25, "std", 0.01)
    method = load("galore", {"rank": 32, "update_proj_gap": 50})
    group = method.make_optimizer(llama()).param_groups[1]
    assert (group["rank"], group["update_proj_gap"], group["scale"]) == (32, 50, 0.25)
    with pytest.raises(MethodError, match="options: .*update_proj_gap"):
        load("galore", {"gap": 50})
    with pytest.raises(MethodError, match="'proj_type' must be one of \"std\", \"reverse_std\""):
        load("galore", {"proj_type": "diagonal"})
    for spec in ("galore_layerwise", "galore_torch"):  # they declare what galore does
        with pytest.raises(MethodError, match=r"'update_proj_gap' must be in \[1, inf\), not 0"):
            load(spec, {"update_proj_gap": 0})


# -- memory, as the runner measures it ---------------------------------------------------------

def formula_elements(rank):
    """Optimizer-state elements of llama-tiny: L = 2 layers, hidden h = 128, MLP i = 344,
    vocabulary V = 256. A projected m x n weight ("std") keeps M and V of r x max(m, n) and
    a projector of r x min(m, n); everything else keeps AdamW's two full-size moments."""
    L, h, i, V, r = 2, 128, 344, 256, rank

    def projected(m, n):
        return 2 * r * max(m, n) + r * min(m, n)

    per_layer = 4 * projected(h, h) + 2 * projected(i, h) + projected(h, i)  # q k v o, gate up, down
    plain = 2 * (V * h + V * h + (2 * L + 1) * h)  # embeddings, lm_head, 2L + 1 RMSNorm weights
    return L * per_layer + plain


@pytest.mark.parametrize("method", ["galore", "galore_layerwise"])
def test_optimizer_bytes_equal_the_formula(method):
    job = Job(kind="memory", method=method, model="llama-tiny", batch_size=4, seq_len=32,
              hparams={"rank": 16})
    record = runner.run(job)
    assert record["status"] == "ok", record.get("message")
    assert record["memory"]["optimizer_bytes"] == 4 * formula_elements(16)  # float32
    assert formula_elements(16) == 259_840  # vs AdamW's 2 x 739,584
    if method == "galore_layerwise":
        assert record["memory"]["grad_bytes"] == 0  # no gradient alive at the peak
    fake = runner.run(Job(**{**job.__dict__, "simulate": True}))  # fake tensors, same split
    assert fake["status"] == "ok", fake.get("message")
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "peak_bytes"):
        assert fake["memory"][key] == record["memory"][key], key


def test_galore_torch_keeps_the_whole_svd_factor_in_float32():
    """galore-torch's float32 projector is a view of U or V' (min(m, n) x min(m, n)):
    its state is ours plus (min(m, n) - r) min(m, n) elements per projected weight."""
    pytest.importorskip("galore_torch")
    record = runner.run(Job(kind="memory", method="galore_torch", model="llama-tiny", batch_size=4,
                            seq_len=32, hparams={"rank": 16}))
    assert record["status"] == "ok", record.get("message")
    extra = 2 * 7 * (128 - 16) * 128  # every projected weight of llama-tiny has min(m, n) = 128
    assert record["memory"]["optimizer_bytes"] == 4 * (formula_elements(16) + extra)


def test_bfloat16_runs_and_keeps_state_in_bfloat16():
    model, opt = trained(steps=3, model=llama(torch.bfloat16))
    assert all(v.dtype == torch.bfloat16 for s in opt.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))
    assert all(torch.isfinite(p).all() for p in model.parameters())

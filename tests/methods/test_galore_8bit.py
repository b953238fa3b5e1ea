"""8-bit GaLore (methods/galore_8bit.py, galore_layerwise_8bit.py) against 32-bit GaLore
within the block-wise quantizer's error, against an fp64 re-derivation of each 8-bit step,
against bitsandbytes' 8-bit blockwise Adam (its maps, layout and CPU kernel), and the
optimizer-state formula."""
import inspect

import pytest
import torch

from bench import models
from bench.job import Job
from bench.measure import runner
from bench.method import MethodError, load
from methods._common.quant8 import BLOCK, DYNAMIC, CodeMap, Quantized8bit
from methods.galore import GaLoreAdamW
from methods.galore_8bit import GaLoreAdamW8bit
from conftest import lm_batch

HP = dict(rank=16, update_proj_gap=2)  # llama-tiny has hidden size 128: rank 16 projects
BETAS = (0.9, 0.999)
# float32 roundings in a round trip (x to float32, x / s, D[c] s), each at most 2^-24 of
# the block's absmax s: 3 x 2^-24 < 2^-22
ROUNDING = 2.0 ** -22


def half_gap(signed: bool) -> float:
    """The map's largest rounding error, relative to the block's absmax: half the widest gap
    between neighbouring codes (signed: also -1, which lies below the lowest code)."""
    d = torch.tensor(DYNAMIC[signed], dtype=torch.float64)
    h = ((d[1:] - d[:-1]) / 2).max().item()
    return max(h, 1 + d[0].item()) if signed else h


def per_element(q: Quantized8bit) -> torch.Tensor:
    """Each element's block scale, in the tensor's shape (float64)."""
    return q.scale.double().flatten().repeat_interleave(BLOCK)[:q.numel].view(q.shape)


def assert_nearest(q: Quantized8bit, x: torch.Tensor, signed: bool) -> None:
    """`q` holds `x` (float64, any shape) as the rule says: scale = the block's absmax of
    x in float32, each code the nearest (a negative value never 0), decoded D[c] s."""
    x32 = x.float().double().flatten()
    n = x32.numel()
    blocks = torch.nn.functional.pad(x32, (0, -n % BLOCK)).view(-1, BLOCK)
    absmax = blocks.abs().amax(1)
    torch.testing.assert_close(q.scale.double().flatten(), torch.where(absmax > 0, absmax, 1.0),
                               rtol=2.0 ** -23, atol=0)
    d = torch.tensor(DYNAMIC[signed], dtype=torch.float64)
    s = per_element(q).flatten()
    best = (x32[:, None] / s[:, None] - d[None, :]).abs().argmin(1)
    zero = DYNAMIC[signed].index(0.0)
    if signed:  # the sign rule: a negative value whose nearest code is 0 takes the next one down
        best = torch.where((best == zero) & (x32 < 0), zero - 1, best)
    decoded = q.decode().double().flatten()
    assert torch.equal(decoded, (d.float()[q.codes.long()] * q.scale.flatten().repeat_interleave(BLOCK)[:n]).double())
    err, least = (decoded - x32).abs(), (d[best] * s - x32).abs()
    assert (err <= least + ROUNDING * s).all()  # the nearest code (ties either way)
    assert (err <= (half_gap(signed) + ROUNDING) * s).all()  # hence within half the widest gap


# -- the quantizer: bitsandbytes' maps and layout, nearest rounding ----------------------------

def test_maps_block_and_threshold_are_bitsandbytes():
    bnb = pytest.importorskip("bitsandbytes")
    from bitsandbytes import functional as F

    for signed in (True, False):
        assert DYNAMIC[signed] == tuple(F.create_dynamic_map(signed=signed).tolist())
    assert half_gap(True) == pytest.approx(0.9 / 128, rel=1e-4)  # the widest gap: 0.9 / 64
    assert half_gap(False) == pytest.approx(0.9 / 256, rel=1e-4)
    # bitsandbytes' own 8-bit AdamW state: m on the signed map, v on the unsigned one, one
    # byte an element and one absmax per 256; a tensor under min_8bit_size keeps float32
    big, small = torch.nn.Parameter(torch.randn(4096 + 300)), torch.nn.Parameter(torch.randn(4095))
    opt = bnb.optim.AdamW8bit([big, small])
    for p in (big, small):
        p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state[big]
    assert state["qmap1"].tolist() == list(DYNAMIC[True]) and state["qmap2"].tolist() == list(DYNAMIC[False])
    assert state["state1"].dtype == state["state2"].dtype == torch.uint8
    assert state["state1"].numel() == big.numel() and state["absmax1"].numel() == -(-big.numel() // BLOCK)
    assert BLOCK == 256 and opt.state[small]["state1"].dtype == torch.float32
    threshold = inspect.signature(bnb.optim.AdamW8bit).parameters["min_8bit_size"].default
    assert load("galore_8bit").hp["min_8bit_size"] == load("galore_layerwise_8bit").hp["min_8bit_size"] == threshold


@pytest.mark.parametrize("signed", [True, False])
def test_quantizer_rounds_to_the_nearest_code(signed):
    n = 3 * BLOCK + 100  # a short last block
    gen = torch.Generator().manual_seed(0)
    magnitude = torch.logspace(-7, 0, n, dtype=torch.float64)[torch.randperm(n, generator=gen)]
    x = torch.randn(n, generator=gen, dtype=torch.float64) * magnitude  # seven decades
    x = x if signed else x.abs()
    x[BLOCK:2 * BLOCK] = 0  # an all-zero block: scale 1, exact zeros
    if signed:
        x[5] = -1e-9 * x[:BLOCK].abs().max()  # below half the smallest code: keeps its sign
    mapping = "dynamic" if signed else "udynamic"
    q = Quantized8bit((n,), "cpu", mapping, CodeMap(signed, "cpu"), padded=False)
    q.encode(x)
    assert q.codes.dtype == torch.uint8 and q.codes.numel() == n and q.scale.numel() == 4
    assert_nearest(q, x, signed)
    out = q.decode()
    assert (out[BLOCK:2 * BLOCK] == 0).all()
    if signed:
        assert out[5] < 0
    # range by range (whole blocks): the same bytes and values
    r = Quantized8bit((n,), "cpu", mapping, CodeMap(signed, "cpu"), padded=False)
    r.encode(x[:2 * BLOCK], 0)
    r.encode(x[2 * BLOCK:], 2 * BLOCK)
    assert torch.equal(r.codes, q.codes) and torch.equal(r.scale, q.scale)
    assert torch.equal(torch.cat([q.decode(0, 2 * BLOCK), q.decode(2 * BLOCK, n)]), out)


# -- against 32-bit GaLore ----------------------------------------------------------------------

def llama(dtype=torch.float32):
    torch.manual_seed(0)
    return models.build("llama-tiny").to(dtype)


def trained(method, steps=1, model=None, **hp):
    model = model or llama()
    m = load(method, {**HP, **hp})
    opt = m.make_optimizer(model)
    for s in range(steps):
        m.train_step(model, opt, lm_batch(4, 16, seed=s))
    return model, opt


@pytest.mark.parametrize("method", ["galore_8bit", "galore_layerwise_8bit"])
def test_first_step_equals_32bit_galore_states_within_the_error(method):
    """The update uses the moments before they are rounded, so the first step is 32-bit
    GaLore's bit for bit; the stored moments are then 32-bit GaLore's within the map's
    error. llama-tiny at rank 16: gate/up/down keep 16 x 344 = 5504-element states and the
    embeddings and LM head 32768 (8-bit); q/k/v/o 16 x 128 = 2048 and the norms 128 (under
    min_8bit_size: float32, galore's own update)."""
    ref_model, ref_opt = trained("galore")
    model, opt = trained(method)
    quantized = 0
    for p_ref, p in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(p, p_ref)
        a, b = ref_opt.state[p_ref], opt.state[p]
        for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            if isinstance(b[key], Quantized8bit):
                quantized += 1
                assert a[key].numel() >= 4096
                bound = (half_gap(signed) + ROUNDING) * per_element(b[key])
                assert ((b[key].decode().double() - a[key].double()).abs() <= bound).all()
                assert_nearest(b[key], a[key].double(), signed)
            else:
                assert a[key].numel() < 4096 and torch.equal(b[key], a[key])
    assert quantized == 2 * (2 + 2 * 3)  # 2 moments of: embeddings, LM head, 2 x gate/up/down


CASES = [((40, 300), "std"), ((300, 40), "std"), ((40, 300), "full"), ((300, 40), "left"),
         ((40, 300), None)]  # None: a plain AdamW parameter (an embedding, a norm)
SETTINGS = dict(rank=8, gap=3, scale=0.25, lr=1e-2, eps=1e-8)


def gradients(shape, steps=6):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(steps)]


def snapshots(cls, shape, proj_type, grads, **kw):
    """One float64 weight stepped on `grads`; after each step: (weight, state copies)."""
    w = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64))
    group = {"params": [w]}
    if proj_type is not None:
        group.update(rank=SETTINGS["rank"], update_proj_gap=SETTINGS["gap"], scale=SETTINGS["scale"],
                     proj_type=proj_type)
    opt = cls([group], lr=SETTINGS["lr"], betas=BETAS, eps=SETTINGS["eps"], **kw)
    out = [(w.detach().clone(), {})]
    for g in grads:
        w.grad = g.clone()
        opt.step()
        state = {k: (v if isinstance(v, (int, Quantized8bit)) else v.clone()) for k, v in opt.state[w].items()}
        if isinstance(state["exp_avg"], Quantized8bit):  # keep this step's codes
            for key in ("exp_avg", "exp_avg_sq"):
                q = state[key]
                copy = Quantized8bit(q.shape, "cpu", q.mapping, q.code, padded=False)
                copy.codes.copy_(q.codes)
                copy.scale.copy_(q.scale)
                state[key] = copy
        out.append((w.detach().clone(), state))
    return out


@pytest.mark.parametrize("shape, proj_type", CASES)
def test_moments_stay_within_the_quantizers_error_over_steps(shape, proj_type):
    """Same gradients (so the same projectors), 6 steps, refreshes at 0 and 3. Each step
    rounds once and the earlier rounding decays by beta: |M8_t - M32_t| <= e_t +
    b1 |M8_{t-1} - M32_{t-1}|, e_t = (half the widest gap + rounding) x the block's absmax
    at step t; the same for V with b2."""
    grads = gradients(shape)
    ours = snapshots(GaLoreAdamW8bit, shape, proj_type, grads, min_8bit_size=0)
    ref = snapshots(GaLoreAdamW, shape, proj_type, grads)
    assert torch.equal(ours[1][0], ref[1][0])  # the first step: equal weights
    bound = {"exp_avg": 0.0, "exp_avg_sq": 0.0}
    for t in range(1, len(grads) + 1):
        for key, signed, beta in (("exp_avg", True, BETAS[0]), ("exp_avg_sq", False, BETAS[1])):
            q, exact = ours[t][1][key], ref[t][1][key]
            bound[key] = (half_gap(signed) + ROUNDING) * per_element(q) + beta * bound[key]
            assert ((q.decode().double() - exact).abs() <= bound[key]).all(), (t, key)
    assert (ours[-1][1]["exp_avg"].decode().double() - ref[-1][1]["exp_avg"]).abs().max() > 0


@pytest.mark.parametrize("shape, proj_type", CASES)
def test_each_step_is_the_fp64_update_of_its_decoded_moments(shape, proj_type):
    """An independent re-derivation of every 8-bit step from the moments it decoded:
    M' = b1 M~ + (1 - b1) R, V' likewise, W <- W - lr alpha / (1 - b1^t) P N(M', V'), and
    M', V' stored as their nearest codes; the projector is the one the step used."""
    grads = gradients(shape)
    ours = snapshots(GaLoreAdamW8bit, shape, proj_type, grads, min_8bit_size=0)
    b1, b2 = BETAS
    m_prev = v_prev = 0.0
    for t, g in enumerate(grads, 1):
        w_prev, (w, state) = ours[t - 1][0], ours[t]
        p_, q_ = state.get("proj_left"), state.get("proj_right")
        r = g if p_ is None else p_.T @ g
        r = r if q_ is None else r @ q_.T
        m_new, v_new = b1 * m_prev + (1 - b1) * r, b2 * v_prev + (1 - b2) * r * r
        n = m_new / ((v_new.sqrt() / (1 - b2 ** t) ** 0.5) + SETTINGS["eps"])
        n = n if p_ is None else p_ @ n
        n = n if q_ is None else n @ q_
        alpha = 1.0 if proj_type is None else SETTINGS["scale"]
        expected = w_prev - SETTINGS["lr"] * alpha / (1 - b1 ** t) * n
        torch.testing.assert_close(w, expected, rtol=1e-12, atol=1e-15, msg=f"step {t}")
        assert_nearest(state["exp_avg"], m_new, signed=True)
        assert_nearest(state["exp_avg_sq"], v_new, signed=False)
        m_prev, v_prev = state["exp_avg"].decode().double(), state["exp_avg_sq"].decode().double()


@pytest.mark.parametrize("shape, proj_type", [((300, 40), "std"), ((40, 300), None)])
def test_update_in_chunks_equals_one_piece(monkeypatch, shape, proj_type):
    """Large states are updated in chunks of whole blocks (the last one short): the same
    bytes as in one piece (2,400 and 12,000 elements: 5 and 8 chunks here)."""
    import methods.galore_8bit as galore_8bit

    grads = gradients(shape, steps=3)
    whole = snapshots(GaLoreAdamW8bit, shape, proj_type, grads, min_8bit_size=0)
    monkeypatch.setattr(galore_8bit, "CHUNK_LEAST", BLOCK)
    monkeypatch.setattr(galore_8bit, "CHUNK_PIECES", 8)
    chunked = snapshots(GaLoreAdamW8bit, shape, proj_type, grads, min_8bit_size=0)
    for (w, state), (v, other) in zip(whole[1:], chunked[1:]):
        assert torch.equal(w, v)
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key].codes, other[key].codes) and torch.equal(state[key].scale, other[key].scale)


@pytest.mark.parametrize("proj_type", ["std", None])
def test_step_agrees_with_bitsandbytes_8bit_adam_kernel(proj_type):
    """bitsandbytes' `optimizer_update_8bit_blockwise` (its CPU kernel, 0.50) from the same
    codes and gradient (the projected one, as galore-torch's GaLoreAdamW8bit feeds it):
    the same weight, the same absmax; the same codes except where bitsandbytes' CPU
    library, which rounds through a 65536-bin table, picks a farther one."""
    pytest.importorskip("bitsandbytes")
    shape = (40, 300)
    grads = [g.float() for g in gradients(shape, steps=4)]
    w = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(2)))
    group = {"params": [w]}
    if proj_type is not None:
        group.update(rank=8, update_proj_gap=3, scale=SETTINGS["scale"], proj_type=proj_type)
    lr = SETTINGS["lr"]
    opt = GaLoreAdamW8bit([group], lr=lr, betas=BETAS, eps=SETTINGS["eps"], min_8bit_size=0)
    maps = [torch.tensor(DYNAMIC[s], dtype=torch.float32) for s in (True, False)]
    for t, g in enumerate(grads, 1):
        state = opt.state[w]
        if state:
            codes = [state[k].codes.clone() for k in ("exp_avg", "exp_avg_sq")]
            absmax = [state[k].scale.flatten().clone() for k in ("exp_avg", "exp_avg_sq")]
            before = [state[k].decode() for k in ("exp_avg", "exp_avg_sq")]
        w_prev = w.detach().clone()
        w.grad = g.clone()
        opt.step()
        state = opt.state[w]
        r = g if proj_type is None else state["proj_left"].T @ g
        if t == 1:  # bitsandbytes' initial state: zero codes and absmax
            n = r.numel()
            codes = [torch.zeros(n, dtype=torch.uint8) for _ in range(2)]
            absmax = [torch.zeros(-(-n // BLOCK)) for _ in range(2)]
            before = [torch.zeros_like(r), torch.zeros_like(r)]
        # a plain weight is stepped itself; a projected one gets -N / (1 - b1^t) (lr 1, from 0)
        p = w_prev.clone() if proj_type is None else torch.zeros_like(r)
        torch.ops.bitsandbytes.optimizer_update_8bit_blockwise(
            "adam", r.contiguous(), p, codes[0].view(r.shape), codes[1].view(r.shape), BETAS[0], BETAS[1],
            0.0, 0.0, SETTINGS["eps"], t, lr if proj_type is None else 1.0, maps[0], maps[1], absmax[0], absmax[1],
            0.0, 1.0, False)
        if proj_type is None:
            torch.testing.assert_close(w.detach(), p, rtol=1e-6, atol=1e-7)
        else:
            expected = w_prev + lr * SETTINGS["scale"] * (state["proj_left"] @ p)
            torch.testing.assert_close(w.detach(), expected, rtol=ROUNDING, atol=1e-8)  # float32 rounding
        for i, (key, beta) in enumerate((("exp_avg", BETAS[0]), ("exp_avg_sq", BETAS[1]))):
            q = state[key]
            # the same moments up to the order of float32 operations (bitsandbytes: mul_, add_)
            torch.testing.assert_close(q.scale.flatten(), absmax[i], rtol=ROUNDING, atol=0)
            x = beta * before[i].flatten() + (1 - beta) * (r if i == 0 else r * r).flatten()
            s = absmax[i].repeat_interleave(BLOCK)[:x.numel()]
            ours = (maps[i][q.codes.long()] * s - x).abs()
            theirs = (maps[i][codes[i].long()] * s - x).abs()
            assert ((q.codes == codes[i]) | (theirs > ours)).all(), (t, key)  # where they differ, ours is nearer


# -- the per-layer variant ----------------------------------------------------------------------

def test_layerwise_releases_each_gradient_in_its_hook_and_equals_galore_8bit():
    model = llama()
    m = load("galore_layerwise_8bit", HP)
    opt = m.make_optimizer(model)
    seen = []
    for p in model.parameters():  # registered after the optimizer's hooks: run after them
        p.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is not None))
    for s in range(3):
        m.train_step(model, opt, lm_batch(4, 16, seed=s))
    assert len(seen) == 3 * len(list(model.parameters())) and not any(seen)
    assert all(p.grad is None for p in model.parameters())
    reference, _ = trained("galore_8bit", steps=3)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_layerwise_refuses_micro_batches():
    with pytest.raises(MethodError, match="micro_batches=2 is not supported"):
        load("galore_layerwise_8bit", {"micro_batches": 2})


def test_defaults_are_galores_and_galore_is_unchanged():
    galore = load("galore").hp
    assert "min_8bit_size" not in galore
    for name in ("galore_8bit", "galore_layerwise_8bit"):
        hp = load(name).hp
        assert {k: v for k, v in hp.items() if k != "min_8bit_size"} == galore
        with pytest.raises(MethodError, match=r"'min_8bit_size' must be in \[0, inf\)"):
            load(name, {"min_8bit_size": -1})


# -- memory, as the runner measures it --------------------------------------------------------

def formula_bytes(rank: int, min_8bit_size: int = 4096, item: int = 4) -> int:
    """Optimizer-state bytes of llama-tiny (L = 2 layers, hidden h = 128, MLP i = 344,
    vocabulary V = 256), float32: a state of N >= min_8bit_size elements keeps N bytes of
    codes and a float32 absmax per 256 (else N float32 values); two per parameter; a
    projected m x n weight's states are r x max(m, n) (r = min(rank, m, n)) plus its
    projector r x min(m, n); the two code maps and their midpoints once."""
    L, h, i, V = 2, 128, 344, 256

    def moment(numel):
        return numel + 4 * -(-numel // BLOCK) if numel >= min_8bit_size else item * numel

    def projected(m, n):
        r = min(rank, m, n)
        return 2 * moment(r * max(m, n)) + item * r * min(m, n)

    per_layer = 4 * projected(h, h) + 2 * projected(i, h) + projected(h, i) + 2 * 2 * moment(h)
    maps = 2 * (256 + 255) * 4
    return L * per_layer + 2 * 2 * moment(V * h) + 2 * moment(h) + maps


@pytest.mark.parametrize("method", ["galore_8bit", "galore_layerwise_8bit"])
def test_optimizer_bytes_equal_the_formula_and_simulate(method):
    job = Job(kind="memory", method=method, model="llama-tiny", batch_size=4, seq_len=32,
              hparams={"rank": 16})
    record = runner.run(job)
    assert record["status"] == "ok", record.get("message")
    assert record["memory"]["optimizer_bytes"] == formula_bytes(16)
    assert formula_bytes(16) < formula_bytes(16, min_8bit_size=10**9)  # every state in float32
    if method == "galore_layerwise_8bit":  # at most one parameter's gradient alive at the peak
        largest = max(p.numel() for p in models.build("llama-tiny").parameters())
        assert record["memory"]["grad_bytes"] <= 4 * largest
    fake = runner.run(Job(**{**job.__dict__, "simulate": True}))  # fake tensors, same split
    assert fake["status"] == "ok", fake.get("message")
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "other_bytes", "peak_bytes"):
        assert fake["memory"][key] == record["memory"][key], key


def test_bfloat16_keeps_codes_and_small_states_in_bfloat16():
    model, opt = trained("galore_8bit", steps=2, model=llama(torch.bfloat16))
    for state in opt.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            value = state[key]
            if isinstance(value, Quantized8bit):
                assert value.codes.dtype == torch.uint8 and value.scale.dtype == torch.float32
            else:
                assert value.dtype == torch.bfloat16
    assert all(torch.isfinite(p).all() for p in model.parameters())

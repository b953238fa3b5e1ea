"""AdamA against independent references: torch's Adam/AdamW and Adam with accumulation."""
import pytest
import torch

from bench import models
from bench.measure import runner
from bench.measure.tracker import MemoryTracker
from bench.method import MethodError, load, split_batch
from methods.adama import BLOCK, LOG_RANGE, LOG_STEP, Quantized8bit


def tiny_model(dtype=torch.float64):
    torch.manual_seed(0)
    return models.build("gpt2-tiny", dropout=0.0).to(dtype)


def batch(n=4, t=16, seed=0, identical=False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (1 if identical else n, t), generator=g).repeat(n if identical else 1, 1)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    return {"input_ids": ids, "labels": labels}


HP = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8)


@pytest.mark.parametrize("v_norm", ["mean", "sum_scaled"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_one_micro_batch_equals_torch_adamw(v_norm, weight_decay):
    ours, ref = tiny_model(), tiny_model()
    adama = load("adama", {"micro_batches": 1, "v_norm": v_norm, "weight_decay": weight_decay, **HP})
    opt = adama.make_optimizer(ours)
    torch_opt = (torch.optim.AdamW(ref.parameters(), weight_decay=weight_decay, **HP) if weight_decay
                 else torch.optim.Adam(ref.parameters(), **HP))
    adamw = load("adamw")
    for step in range(4):
        b = batch(seed=step)
        adama.train_step(ours, opt, b)
        adamw.train_step(ref, torch_opt, b)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def first_step_states(micro_batches, b, v_norm="mean"):
    ours, ref = tiny_model(), tiny_model()
    adama = load("adama", {"micro_batches": micro_batches, "v_norm": v_norm, **HP})
    accum = load("grad_accum", {"micro_batches": micro_batches, **HP})
    opt = adama.make_optimizer(ours)
    torch_opt = torch.optim.Adam(ref.parameters(), **HP)
    adama.train_step(ours, opt, b)
    accum.train_step(ref, torch_opt, b)
    pairs = []
    for p, q in zip(ours.parameters(), ref.parameters()):
        pairs.append((opt.state[p], torch_opt.state[q]))
    return pairs


def test_many_micro_batches_m_equals_accumulation_and_v_is_larger():
    pairs = first_step_states(4, batch())
    strictly_larger = False
    for ours, ref in pairs:
        torch.testing.assert_close(ours["exp_avg"], ref["exp_avg"], rtol=1e-10, atol=1e-15)
        assert (ours["exp_avg_sq"] >= ref["exp_avg_sq"] * (1 - 1e-12) - 1e-30).all()
        strictly_larger |= bool((ours["exp_avg_sq"] > ref["exp_avg_sq"] * (1 + 1e-6)).any())
    assert strictly_larger  # different micro-batches: Jensen's gap is real


def test_identical_micro_batches_give_adams_v():
    for ours, ref in first_step_states(4, batch(identical=True)):
        torch.testing.assert_close(ours["exp_avg"], ref["exp_avg"], rtol=1e-10, atol=1e-15)
        torch.testing.assert_close(ours["exp_avg_sq"], ref["exp_avg_sq"], rtol=1e-9, atol=1e-20)


def test_sum_scaled_v_is_n_times_smaller_for_identical_micro_batches():
    for ours, ref in first_step_states(4, batch(identical=True), v_norm="sum_scaled"):
        torch.testing.assert_close(ours["exp_avg_sq"] * 4, ref["exp_avg_sq"], rtol=1e-9, atol=1e-20)


def test_gradients_never_survive_a_backward():
    model = tiny_model()
    adama = load("adama", {"micro_batches": 2})
    opt = adama.make_optimizer(model)
    from bench.method import lm_loss
    opt.begin(2)
    for micro in split_batch(batch(), 2):
        (lm_loss(model, micro) / 2).backward()
        assert all(p.grad is None for p in model.parameters())
    opt.step()
    assert all(opt.state[p]["step"] == 1 for p in model.parameters())


def live_grad_bytes_during_backward(method_name):
    """Largest number of gradient bytes alive at any parameter's gradient hook."""
    model = tiny_model(torch.float32)
    method = load(method_name)
    b = batch(n=8)
    tracker = MemoryTracker()
    tracker.register_model(model)
    tracker.register(b.values(), "other")
    seen = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(tracker.live_split().grad))
    with tracker:
        opt = method.make_optimizer(model)
        method.train_step(model, opt, b)
    return max(seen), model


def test_live_gradient_stays_one_tensor():
    adama_grad, model = live_grad_bytes_during_backward("adama")
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert adama_grad <= largest
    accum_grad, _ = live_grad_bytes_during_backward("grad_accum")
    assert accum_grad == total  # the reference keeps every gradient


@pytest.mark.parametrize("option, value, words", [
    ("max_grad_norm", 1.0, ["'max_grad_norm' must be one of null", "not 1.0"]),
    ("weight_decay_mode", "l2", ["'weight_decay_mode' must be one of \"decoupled\"", "not \"l2\""]),
    ("grad_scaler", True, ["'grad_scaler' must be one of false", "not true"]),
    ("v_norm", "sum", ["'v_norm' must be one of \"mean\", \"sum_scaled\""]),
])
def test_incompatible_options_fail_when_loaded(option, value, words):
    with pytest.raises(MethodError) as err:
        load("adama", {option: value})  # the config check loads it: before any job
    for w in words:
        assert w in str(err.value)


def test_fp16_parameters_are_refused():
    with pytest.raises(MethodError, match="GradScaler"):
        load("adama").make_optimizer(tiny_model(torch.float16))


def _values(n, signed):
    torch.manual_seed(0)
    x = torch.randn(n) * 10 ** (-10 * torch.rand(n))  # ten decades inside every block
    return x if signed else x.abs()


def test_8bit_linear_round_trip_within_half_a_step():
    x = _values(3 * BLOCK + 17, signed=True)
    q = Quantized8bit(x.shape, "cpu", "linear")
    q.encode(x)
    step = q.scale.flatten().repeat_interleave(BLOCK)[: x.numel()]
    assert ((q.decode() - x).abs() <= step / 2 * (1 + 1e-6)).all()


def test_8bit_log_round_trip_within_its_relative_step():
    x = _values(3 * BLOCK + 17, signed=False)
    q = Quantized8bit(x.shape, "cpu", "log")
    q.encode(x)
    top = q.scale.flatten().repeat_interleave(BLOCK)[: x.numel()]
    err = (q.decode() - x).abs()
    above = x >= top * LOG_RANGE
    assert above.sum() > 100 and (~above).sum() > 10  # both regimes are exercised
    assert (err[above] <= LOG_STEP / 2 * x[above] * (1 + 1e-4)).all()
    assert (err[~above] <= top[~above] * LOG_RANGE).all()


@pytest.mark.parametrize("mapping", ["linear", "log"])
def test_8bit_constant_and_zero_blocks(mapping):
    for value in (0.0, 3.0):
        q = Quantized8bit((10,), "cpu", mapping)
        q.encode(torch.full((10,), value))
        torch.testing.assert_close(q.decode(), torch.full((10,), value))  # no NaN


@pytest.mark.parametrize("mapping", ["linear", "log"])
def test_8bit_encode_holds_one_float_temporary_of_the_tensor_at_a_time(mapping):
    """A float32 tensor of whole blocks is quantised without a padded copy of it: of the
    tensor-sized allocations the encode makes (a float32 temporary each), at most one is
    alive at a time (the padding copy made it two for every moment AdamA folds)."""
    x = _values(64 * BLOCK, signed=mapping == "linear")
    q = Quantized8bit(x.shape, "cpu", mapping)
    events: list = []
    with MemoryTracker(events=events):
        q.encode(x)
    freed = {e[1] for e in events if e[0] == "free"}  # its temporaries (x itself is seen, not freed)
    alive, most, made = set(), 0, 0
    for event in events:
        if event[0] == "alloc" and event[1] in freed and event[2] == x.numel() * 4:
            alive.add(event[1])
            made += 1
        elif event[0] == "free":
            alive.discard(event[1])
        most = max(most, len(alive))
    assert made >= 1 and most == 1


@pytest.mark.parametrize("state_dtype, rtol", [("bfloat16", 2e-2), ("int8", 5e-2)])
def test_low_precision_states_track_float32(state_dtype, rtol):
    ref, low = tiny_model(torch.float32), tiny_model(torch.float32)
    a = load("adama", {"micro_batches": 2})
    b = load("adama", {"micro_batches": 2, "state_dtype": state_dtype})
    opt_a, opt_b = a.make_optimizer(ref), b.make_optimizer(low)
    a.train_step(ref, opt_a, batch())
    b.train_step(low, opt_b, batch())
    p = next(ref.parameters())
    m_ref = opt_a.state[p]["exp_avg"]
    q = next(low.parameters())
    m_low = opt_b._moments(opt_b.state[q])[0].float()
    assert (m_low - m_ref).norm() <= rtol * m_ref.norm()
    # parameters moved the same way, up to the states' precision
    delta_ref = torch.cat([(x - y).flatten() for x, y in zip(ref.parameters(), tiny_model(torch.float32).parameters())])
    delta_low = torch.cat([(x - y).flatten() for x, y in zip(low.parameters(), tiny_model(torch.float32).parameters())])
    assert torch.nn.functional.cosine_similarity(delta_ref, delta_low, dim=0) > 0.95


def test_state_bytes(tiny_job):
    full = runner.run(tiny_job(method="adama"))
    bf16 = runner.run(tiny_job(method="adama", hparams={"state_dtype": "bfloat16"}))
    int8 = runner.run(tiny_job(method="adama", hparams={"state_dtype": "int8"}))
    assert full["status"] == bf16["status"] == int8["status"] == "ok"
    n = full["n_params"]
    assert full["memory"]["optimizer_bytes"] == 8 * n  # m and v in float32; the step is an int
    assert bf16["memory"]["optimizer_bytes"] == 4 * n
    blocks = sum(-(-p.numel() // BLOCK) for p in tiny_model().parameters())
    assert int8["memory"]["optimizer_bytes"] == 2 * BLOCK * blocks + 2 * 4 * blocks  # codes + scales


def test_less_peak_memory_than_gradient_accumulation(tiny_job):
    accum = runner.run(tiny_job(method="grad_accum", batch_size=8))
    adama = runner.run(tiny_job(method="adama", batch_size=8))
    assert adama["status"] == "ok", adama.get("message")
    assert adama["memory"]["peak_bytes"] < accum["memory"]["peak_bytes"]
    assert adama["memory"]["grad_bytes"] < accum["memory"]["grad_bytes"] / 4

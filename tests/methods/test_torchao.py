"""torchao's low-bit AdamW peers (methods/torchao_adamw*.py): state bytes against torchao's
storage formats, and the steps against a float64 AdamW."""
import pytest
import torch

from bench import models
from bench.measure import runner
from bench.measure.tracker import MemoryTracker
from bench.method import load, lm_loss
from conftest import lm_batch

pytest.importorskip("torchao.optim")

METHODS = ["torchao_adamw8bit", "torchao_adamw4bit", "torchao_adamwfp8"]
HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def state_bytes(params, method) -> int:
    """torchao 0.18.0's storage (torchao/optim/adam.py, subclass_*.py): m and v of a tensor
    of n >= 4096 elements, n a multiple of the block, are quantised; others are plain
    tensors in the parameter's dtype. Plus a float32 step per parameter, a float32 lr."""
    total = 4  # the group's lr tensor
    for p in params:
        n = p.numel()
        total += 4  # state["step"]
        block = 128 if method.endswith("4bit") else 256
        if n >= 4096 and n % block == 0:
            one = {"torchao_adamw8bit": n + 4 * n // 256 + 256 * 4,  # codes, scales, 256-map
                   "torchao_adamw4bit": n // 2 + 4 * n // 128 + 16 * 4,  # packed, scales, 16-map
                   "torchao_adamwfp8": n + 4 * n // 256}[method]  # e4m3 codes, scales
        else:
            one = n * p.element_size()
        total += 2 * one
    return total


def llama(dtype=torch.float32):
    """LLaMA has no biases: every gradient is a real one (GPT-2's key bias has a zero
    gradient up to rounding, which Adam turns into a full-size random step)."""
    torch.manual_seed(0)
    return models.build("llama-tiny").to(dtype)


@pytest.mark.parametrize("method", METHODS)
def test_optimizer_bytes_are_torchaos_formula(tiny_job, method):
    record = runner.run(tiny_job(method=method))
    assert record["status"] == "ok", record.get("message")
    torch.manual_seed(0)
    params = list(models.build("gpt2-tiny").parameters())
    assert record["memory"]["optimizer_bytes"] == state_bytes(params, method)
    per_param = record["memory"]["optimizer_bytes"] / record["n_params"]
    assert per_param < {"torchao_adamw4bit": 1.5}.get(method, 2.5)  # AdamW: 8
    assert record["method_report"] == {"step": "eager"}  # no torch.compile under the tracker


@pytest.mark.parametrize("method", METHODS)
def test_the_tracker_sees_no_phantom_bytes(method):
    """A wrapper subclass reports numel x 4 bytes of `untyped_storage()` but holds none;
    what stays alive after a step is exactly the weight and torchao's inner tensors."""
    layer = torch.nn.Linear(128, 256, bias=False)
    m = load(method, {"compile": False})
    tracker = MemoryTracker()
    tracker.register([layer.weight], "param")
    with tracker:
        opt = m.make_optimizer(layer)
        for _ in range(2):
            layer(torch.ones(2, 128)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    live = tracker.live_split()
    assert live.param == 128 * 256 * 4 and live.grad == 0
    assert live.other == state_bytes([layer.weight], method)  # unlabelled state, lr tensor


def first_steps(method, steps):
    """Our method and torchao's state after `steps` steps, with each step's gradients."""
    model, m = llama(), load(method, {**HP, "compile": False})
    opt = m.make_optimizer(model)
    grads = []
    for s in range(steps):
        lm_loss(model, lm_batch(4, 16, seed=s)).backward()
        grads.append([p.grad.double().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, grads


def adamw_step(w, m, v, g, t):
    """torch's AdamW, float64: decoupled decay, moments, bias-corrected step."""
    lr, (b1, b2), eps, wd = HP["lr"], HP["betas"], HP["eps"], HP["weight_decay"]
    w = w * (1 - lr * wd)
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    return w - lr * (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + eps)


@pytest.mark.parametrize("method", METHODS)
def test_first_step_is_adamw(method):
    """Step 1 updates from the float32 moments before they are quantised: AdamW, up to
    float32 rounding, from the same gradients."""
    ours, _, grads = first_steps(method, 1)
    for p, w, g in zip(ours.parameters(), llama(torch.float64).parameters(), grads[0]):
        w = w.detach()
        expected = adamw_step(w, 0 * g, 0 * g, g, 1)
        torch.testing.assert_close(p.double() - w, expected - w, rtol=1e-4, atol=1e-7)  # float32 weights


def quantised(state) -> bool:
    from methods._common.torchao import _subclasses

    return isinstance(state, _subclasses())


def dequantized(state):
    return (state.dequantize() if quantised(state) else state).double()


def max_rounding_error(state, x):
    """The largest round-to-nearest error the format allows for the values x."""
    from torchao.optim.subclass_fp8 import OptimStateFp8

    block = state.block_size
    scale = state.scale.double().repeat_interleave(block).view(x.shape)
    if isinstance(state, OptimStateFp8):
        # e4m3: 3 mantissa bits (half an ulp is 2^-4 of the value), subnormal step 2^-9
        return x.abs() * 2 ** -4 + scale * 2 ** -10
    qmap = state.qmap.double()
    gaps = qmap.diff()
    return scale * float(gaps.max()) / 2 + scale * float(qmap.abs().min())


@pytest.mark.parametrize("method", METHODS)
def test_states_hold_the_moments_within_their_format(method):
    _, opt, grads = first_steps(method, 1)
    b1, b2 = HP["betas"]
    checked = 0
    for p, g in zip(opt.param_groups[0]["params"], grads[0]):
        state = opt.state[p]
        m, v = (1 - b1) * g, (1 - b2) * g * g
        for key, x in (("exp_avg", m), ("exp_avg_sq", v)):
            s = state[key]
            if quantised(s):
                err = (dequantized(s) - x).abs()
                assert (err <= max_rounding_error(s, x) * (1 + 1e-3) + 1e-30).all(), key
                assert dequantized(s).abs().max() > 0
                checked += 1
            else:  # small tensors: plain float32
                torch.testing.assert_close(s.double(), x, rtol=1e-5, atol=1e-30)
    assert checked >= 10


@pytest.mark.parametrize("method", METHODS)
def test_second_step_is_adamw_from_the_dequantised_moments(method):
    model, opt, _ = first_steps(method, 1)
    before = [p.detach().double().clone() for p in model.parameters()]
    moments = [(dequantized(opt.state[p]["exp_avg"]), dequantized(opt.state[p]["exp_avg_sq"]))
               for p in model.parameters()]
    lm_loss(model, lm_batch(4, 16, seed=1)).backward()
    grads = [p.grad.double() for p in model.parameters()]
    opt.step()
    for p, w, (m, v), g in zip(model.parameters(), before, moments, grads):
        expected = adamw_step(w, m, v, g, 2)
        torch.testing.assert_close(p.double() - w, expected - w, rtol=1e-4, atol=1e-7)  # float32 weights


@pytest.mark.parametrize("method", ["torchao_adamw8bit", "torchao_adamw4bit"])
def test_simulates_in_a_fresh_process(tiny_job, method):
    """torchao builds its code maps with `.tolist()` on first use; on fake tensors that
    fails unless the method builds them on real tensors first (a fresh process, e.g.
    `python -m bench --simulate`, has no cached maps). Equality with the real run:
    tests/methods/test_simulated.py."""
    from torchao.optim import subclass_4bit, subclass_8bit

    for module in (subclass_8bit, subclass_4bit):
        module.get_qmap_signed.cache_clear()
        module.get_qmap_unsigned.cache_clear()
    fake = runner.run(tiny_job(method=method, model="llama-tiny", simulate=True))
    assert fake["status"] == "ok", fake.get("message")

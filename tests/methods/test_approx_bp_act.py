"""Approx-BP's activations (methods/approx_bp/activations.py) and the approx_bp method:
ReGELU2 and ReSiLU2 against the paper's primitive h~ = sum a_i max(x - c_i, 0), the 2 bits
they keep, and memory jobs on the three tiny models."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from bench.measure import runner
from bench.measure.tracker import MemoryTracker
from bench.method import load
from methods.approx_bp import activations as A
from methods.fewbit import tables as T
from methods._common.step_activation import StepDerivativeActivation

F64 = torch.float64
PAIRS = {"regelu2": (A.ReGELU2, F.gelu, A.REGELU2_A, A.REGELU2_C, "gelu"),
         "resilu2": (A.ReSiLU2, F.silu, A.RESILU2_A, A.RESILU2_C, "silu")}


def points(dtype=F64):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=g, dtype=F64) * 4,
                   torch.tensor([*A.REGELU2_C, *A.RESILU2_C, 0.0, -30.0, 30.0], dtype=F64)])
    return x.to(dtype)


@pytest.mark.parametrize("which", list(PAIRS))
def test_derivative_is_that_of_the_sum_of_relus(which):
    """dx = h~'(x) dy with h~'(x) = sum_i a_i [x > c_i], and the forward is f itself."""
    layer_cls, f, a, c, _ = PAIRS[which]
    x = points().requires_grad_()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    y = layer_cls()(x)
    y.backward(dy)
    assert torch.equal(y.detach(), f(x.detach()))
    slope = torch.zeros_like(dy)
    for a_i, c_i in zip(a, c):  # the CUDA kernel's sum, in its order
        slope = slope + a_i * (x.detach() > c_i).to(F64)
    assert torch.equal(x.grad, slope * dy)
    # and h~' is the derivative of h~ (autograd through the primitive)
    xs = x.detach().clone().requires_grad_()
    h = sum(a_i * torch.relu(xs - c_i) for a_i, c_i in zip(a, c))
    (grad_h,) = torch.autograd.grad(h.sum(), xs)
    torch.testing.assert_close(slope, grad_h, rtol=0, atol=1e-15)


@pytest.mark.parametrize("which", list(PAIRS))
def test_table_is_the_papers_constraint_and_close_to_f(which):
    """sum a_i = 1 and sum a_i c_i = 0 (h~(x) = x for large x, 0 for very negative x),
    and h~ stays near f: within 0.16 (GELU) and 0.26 (SiLU), the official search's fit."""
    _, f, a, c, name = PAIRS[which]
    assert sum(a) == pytest.approx(1, abs=1e-12)
    assert sum(ai * ci for ai, ci in zip(a, c)) == pytest.approx(0, abs=1e-12)
    borders, levels = A.TABLES[which]
    assert borders == list(c) and levels[0] == 0 and levels[-1] == pytest.approx(1, abs=1e-12)
    x = np.linspace(-20, 20, 40001)
    h = sum(ai * np.maximum(x - ci, 0) for ai, ci in zip(a, c))
    gap = np.abs(h - T.f(name, x)).max()
    assert gap < {"gelu": 0.16, "silu": 0.26}[name]


@pytest.mark.parametrize("which", list(PAIRS))
def test_the_fewbit_dp_fits_the_derivative_better(which):
    """Approx-BP fits the primitive, Few-Bit the derivative: at 2 bits Few-Bit's table has
    the lower L2 error on f' (w = 1 on [-100, 100])."""
    name = PAIRS[which][4]
    integrals = T.Integrals(name)
    assert T.table_error(name, 2) < 0.5 * T.l2_error(integrals, *A.TABLES[which])


def tracked_activation_bytes(layer, shape, fake: bool, dtype):
    """Activation bytes the tracker holds after the layer's forward, its input made while
    tracked (as a Linear's output would be) and its output alive."""
    mode = FakeTensorMode() if fake else torch.device("cpu")
    with mode:
        w = torch.randn(shape, dtype=dtype, requires_grad=True)
        tracker = MemoryTracker()
        with tracker:
            x = w * 2
            y = layer(x)
            split = tracker.live_split()
        del x, y
    return split.activation


@pytest.mark.parametrize("fake", [False, True])
@pytest.mark.parametrize("which", list(PAIRS))
def test_keeps_two_bits_per_element(which, fake):
    shape = (5, 9, 13)
    n = math.prod(shape)
    for dtype in (torch.float32, torch.bfloat16):
        assert tracked_activation_bytes(PAIRS[which][0](), shape, fake, dtype) == math.ceil(n * 2 / 8)


def test_swap_names_what_it_replaced_and_left():
    model = nn.Sequential(nn.GELU(), nn.SiLU(), nn.GELU(approximate="tanh"), nn.Tanh())
    report = A.swap_activations_approx(model)
    assert report["replaced"] == {"GELU -> regelu2": 2, "SiLU -> resilu2": 1}
    assert report["left"] == {"Tanh (no table for tanh)": 1}
    assert all(isinstance(m, StepDerivativeActivation) and m.bits == 2 for m in model[:3])
    assert list(model[2].levels) == A.TABLES["regelu2"][1]


def test_method_without_norms_and_with_them():
    from bench import models

    method = load("approx_bp", {"norms": False})
    method.transform_model(models.build("llama-tiny"))
    assert method.report == {"activations": {"replaced": {"SiLUActivation -> resilu2": 2}}}
    method = load("approx_bp")
    method.transform_model(models.build("bert-tiny"))
    assert method.report["activations"]["replaced"] == {"GELUActivation -> regelu2": 3}
    assert "norms" in method.report


def test_does_not_stack_with_methods_that_replace_the_same_layers():
    from bench.method import MethodError

    for spec in ("approx_bp+fewbit", "fewbit+approx_bp", "tempo+approx_bp"):
        with pytest.raises(MethodError, match="cannot be stacked"):
            load(spec)
    load("fewbit+tempo")  # GELU from fewbit, LayerNorm and attention from Tempo


@pytest.mark.parametrize("model", ["gpt2-tiny", "bert-tiny", "llama-tiny"])
def test_memory_job_tracked_equals_simulated(tiny_job, model):
    plain = runner.run(tiny_job(batch_size=16, seq_len=64, method="adamw", model=model))
    real = runner.run(tiny_job(batch_size=16, seq_len=64, method="approx_bp@norms=false", model=model))
    fake = runner.run(tiny_job(batch_size=16, seq_len=64, method="approx_bp@norms=false", model=model, simulate=True))
    for r in (plain, real, fake):
        assert r["status"] == "ok", (r.get("message"), r.get("traceback"))
    for key, value in real["memory"].items():
        if key.endswith("_bytes"):
            assert fake["memory"][key] == value, key
    assert real["memory"]["activation_bytes"] < plain["memory"]["activation_bytes"]
    # the measured step follows a warm-up step with the approximate gradient
    assert real["loss"] == pytest.approx(plain["loss"], rel=1e-2)

"""The method contract and the three baselines."""
import importlib

import pytest
import torch

from bench import models
from bench.measure import runner
from bench.method import Method, MethodError, Stack, available, load, split_batch
from conftest import lm_batch


def batch(n=8, t=16, vocab=256, seed=0):
    return lm_batch(n, t, vocab, seed)


def tiny_model(dtype=torch.float64):
    torch.manual_seed(0)
    return models.build("gpt2-tiny", dropout=0.0).to(dtype)


def test_every_module_follows_the_contract():
    assert {"adamw", "grad_accum", "checkpointing"} <= set(available())
    for name in available():
        module = importlib.import_module(f"methods.{name}")
        assert module.__doc__ and module.__doc__.strip(), f"{name} needs a docstring"
        assert issubclass(module.METHOD, Method)
        assert module.METHOD.paper, f"{name} must cite its paper"
        assert load(name).name == name


def test_grad_accum_equals_one_big_batch_fp64():
    b = batch()
    big, acc = tiny_model(), tiny_model()
    adamw, accum = load("adamw"), load("grad_accum")
    assert accum.hp["micro_batches"] == 4
    loss_big = adamw.train_step(big, adamw.make_optimizer(big), b)
    loss_acc = accum.train_step(acc, accum.make_optimizer(acc), b)
    torch.testing.assert_close(loss_acc, loss_big, rtol=1e-12, atol=1e-12)
    for p, q in zip(big.parameters(), acc.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-10, atol=1e-12)


def test_grad_accum_differs_from_a_single_micro_batch():
    # guards the test above: the comparison must be able to fail
    b = batch()
    full, part = tiny_model(), tiny_model()
    adamw = load("adamw")
    adamw.train_step(full, adamw.make_optimizer(full), b)
    adamw.train_step(part, adamw.make_optimizer(part), split_batch(b, 4)[0])
    assert any(not torch.allclose(p, q) for p, q in zip(full.parameters(), part.parameters()))


def test_checkpointing_same_math_less_activation_memory(tiny_job):
    plain = runner.run(tiny_job(method="adamw", batch_size=8, seq_len=64, dropout=0.0))
    ckpt = runner.run(tiny_job(method="checkpointing", batch_size=8, seq_len=64, dropout=0.0))
    assert plain["status"] == ckpt["status"] == "ok", (plain.get("message"), ckpt.get("message"))
    assert ckpt["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    # gpt2-tiny has 2 blocks: at the peak one block's activations are recomputed, so about
    # half of the plain run's activations are alive (block inputs are small beside them)
    assert ckpt["memory"]["activation_bytes"] < 0.6 * plain["memory"]["activation_bytes"]
    assert ckpt["memory"]["peak_bytes"] < plain["memory"]["peak_bytes"]
    assert ckpt["memory"]["param_bytes"] == plain["memory"]["param_bytes"]


def test_stack_merges_and_applies_both():
    stack = load("checkpointing+grad_accum")
    assert isinstance(stack, Stack) and stack.name == "checkpointing+grad_accum"
    assert stack.hp["micro_batches"] == 4
    model = stack.transform_model(tiny_model())
    assert model.is_gradient_checkpointing


def test_stack_rejects_two_step_owners_and_incompatibles():
    class OwnStepA(Method):
        paper = "a"
        def train_step(self, model, optimizer, batch):
            return torch.tensor(0.0)

    class OwnStepB(OwnStepA):
        pass

    with pytest.raises(MethodError, match="both provide train_step"):
        Stack([OwnStepA(), OwnStepB()])

    class Picky(Method):
        paper = "p"
        incompatible = frozenset({"test_contract"})

    with pytest.raises(MethodError, match="cannot be stacked"):
        Stack([Picky(), Method()])


def test_stack_rejects_disagreeing_defaults():
    class Four(Method):
        paper = "4"
        defaults = dict(micro_batches=4)

    class Two(Method):
        paper = "2"
        defaults = dict(micro_batches=2)

    with pytest.raises(MethodError, match="disagree on micro_batches"):
        Stack([Four(), Two()])


def test_unknown_method_and_option_name_the_choices():
    with pytest.raises(MethodError, match="available: .*adamw"):
        load("adamx")
    with pytest.raises(MethodError, match="options: .*lr"):
        load("adamw", {"learning_rate": 1.0})
    assert load("grad_accum", {"micro_batches": 2}).hp["micro_batches"] == 2


def test_split_batch_needs_equal_parts():
    with pytest.raises(MethodError, match="cannot be split"):
        split_batch(batch(n=6), 4)


def test_a_variant_fixes_hyperparameters_over_overrides():
    method = load("grad_accum@micro_batches=2,lr=0.5", {"micro_batches": 8, "eps": 1e-6})
    assert (method.hp["micro_batches"], method.hp["lr"], method.hp["eps"]) == (2, 0.5, 1e-6)
    assert load("checkpointing+grad_accum@micro_batches=2").hp["micro_batches"] == 2
    with pytest.raises(MethodError, match="expected name@key=value"):
        load("grad_accum@micro_batches")

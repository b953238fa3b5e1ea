"""The method contract and the three baselines."""
import importlib

import pytest
import torch

from bench import models
from bench.measure import runner
from bench import method as method_module
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


# -- declared option values --------------------------------------------------------------------

def test_declared_choices_and_ranges_reject_bad_values_naming_the_key():
    class Declared(Method):
        paper = "d"
        defaults = dict(mode="a", rank=4, frac=0.5, pair=(0.1, 0.2), cap=None)
        choices = {"mode": ("a", "b")}
        ranges = {"rank": "[1, inf)", "frac": "(0, 1]", "pair": "[0, 1)", "cap": "(0, inf)"}

    def loaded(**overrides):
        method = Declared()
        for key, value in overrides.items():
            method.hp[key] = value
        method_module._check_declared("declared", [method])
        return method

    assert loaded(mode="b", rank=1, frac=1.0, pair=(0.0, 0.99), cap=2.0).hp["cap"] == 2.0
    assert loaded(cap=None).hp["cap"] is None  # None passes where the default is None
    bad = {
        "mode": ("c", "option 'mode' must be one of \"a\", \"b\", not \"c\""),
        "rank": (0, "option 'rank' must be in [1, inf), not 0"),
        "frac": (0.0, "option 'frac' must be in (0, 1], not 0.0"),
        "pair": ((0.5, 1.0), "option 'pair' must have every element in [0, 1), not [0.5, 1.0]"),
        "cap": (0, "option 'cap' must be in (0, inf), not 0"),
    }
    for key, (value, message) in bad.items():
        with pytest.raises(MethodError) as err:
            loaded(**{key: value})
        assert message in str(err.value), key
    with pytest.raises(MethodError, match="'rank' must be in .*, not null"):
        loaded(rank=None)  # the default is not None: None is not a value of it


def test_load_checks_the_declarations_of_every_member():
    with pytest.raises(MethodError, match="galore@proj_type=bogus: option 'proj_type' must be one of "
                                          "\"std\", \"reverse_std\", \"left\", \"right\", \"full\""):
        load("galore@proj_type=bogus")
    with pytest.raises(MethodError, match=r"checkpointing\+galore: option 'rank' must be in \[1, inf\)"):
        load("checkpointing+galore", {"rank": 0})
    with pytest.raises(MethodError, match="micro_batches=4 is not supported: lomo takes at most 1"):
        load("checkpointing+lomo", {"micro_batches": 4})
    with pytest.raises(MethodError, match="micro_batches=0 is not supported"):
        load("grad_accum", {"micro_batches": 0})


def test_every_declaration_names_an_option_and_holds_for_the_defaults():
    for name in available():
        cls = importlib.import_module(f"methods.{name}").METHOD
        options = set(load(name).hp)  # loading checks the defaults against the declarations
        assert set(cls.choices) <= options, (name, set(cls.choices) - options)
        assert set(cls.ranges) <= options, (name, set(cls.ranges) - options)
        assert all(isinstance(c, tuple) and c for c in cls.choices.values()), name
        for interval in cls.ranges.values():
            method_module._within(1, interval)  # parses, or raises


# -- peers -------------------------------------------------------------------------------------

def test_every_peer_names_the_method_it_is_compared_against():
    peers = {}
    for name in available():
        module = importlib.import_module(f"methods.{name}")
        cls = module.METHOD
        calls_itself_a_peer = module.__doc__.lstrip().startswith("Peer:")
        assert calls_itself_a_peer == (cls.peer_of is not None), name
        if cls.peer_of is not None:
            assert cls.peer_of in available() and cls.peer_of != name, (name, cls.peer_of)
            assert importlib.import_module(f"methods.{cls.peer_of}").METHOD.peer_of is None, name
            assert cls.package and "==" in cls.package, f"{name}: package is a pinned pip requirement"
            peers[name] = cls.peer_of
    assert peers["galore_torch"] == "galore" and peers["apollo_torch"] == "apollo"
    assert {"adam_mini_pkg", "came_pytorch", "torchao_adamw8bit", "optimi_accum"} <= set(peers)


def test_a_missing_package_is_a_method_error_naming_it(monkeypatch):
    import sys

    from bench.method import require_package

    monkeypatch.setitem(sys.modules, "no_such_peer_package", None)
    with pytest.raises(MethodError, match=r"peer needs `pip install nope==1.0` \(ModuleNotFoundError"):
        require_package("no_such_peer_package", "nope==1.0", "peer")

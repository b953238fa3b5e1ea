"""<Method name>: one line on what it saves and how.

<Authors>, "<Title>", <venue, year>.  Algorithm box, in the paper's notation:

    for each step:
        ...

Copy this file to methods/<name>.py (the file name is the method's name in configs and
results) and keep only what the method changes: everything left out is plain AdamW
training (bench/method.py documents each part). Import only the contract from bench
(bench.method; bench.hooks for what a method may use of the memory tracker); helpers
that several methods share live in methods/_common/. Check at run time only what depends
on the model or the installed packages: what depends on an option alone is declared
(`choices`, `ranges`, `max_micro_batches`). Add tests/methods/test_<name>.py that checks
the method against an independent reference.
"""
import torch

from bench.method import Method


class MyMethod(Method):
    paper = "<Authors>, <Title>, <venue year>"
    # Hyperparameters with the paper's defaults; the config may override any of them (with
    # a value of the same type). lr, betas, eps, weight_decay and micro_batches exist
    # already (bench.method.BASE_DEFAULTS); list them here only to change their value.
    defaults = dict(lr=1e-3)
    # The values an option may take, checked when the method is loaded (so a config with
    # another value is rejected before any job, naming the option): a tuple of choices,
    # or an interval as in mathematics ("[1, inf)", "(0, 1]"; a list option: each element).
    choices = {}  # e.g. {"proj_type": ("std", "left", "right")}
    ranges = {}  # e.g. {"rank": "[1, inf)", "alpha": "[0, 1)"}
    # Methods this one cannot be stacked with (e.g. two that both own the step).
    incompatible = frozenset()
    # What the method can do, read by the suite before any job is planned:
    simulates = True  # False if the step reads a tensor's value (no fake tensors)
    max_micro_batches = None  # 1 if it cannot accumulate gradients over micro-batches
    # A peer (a published package run to compare with one of our methods; its docstring
    # starts with "Peer:"): the method it is compared against and its pip requirement,
    # imported with bench.method.require_package(module, self.package, self.name).
    peer_of = None
    package = ""

    # Change the model (swap layers, wrap blocks). Delete if unused.
    def transform_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    # Provide the optimizer. Delete if plain AdamW is right.
    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        # adam_args: lr, betas, eps and weight_decay, as the config resolved them
        return torch.optim.AdamW(model.parameters(), **self.adam_args)

    # Own the training step only if the method must (e.g. it updates during backward).
    # Must return the mean loss of the batch as a detached tensor.
    # def train_step(self, model, optimizer, batch): ...
    # A method that owns the step states whether it scales a float16 loss (the default
    # step does; see bench.method's module docstring, Precision):
    # loss_scaling = False

    # Persistent optimizer state kept outside `optimizer.state`, if any.
    # def state_tensors(self, optimizer): ...

    # Compute the loss otherwise (chunked_ce); transform_model then calls
    # bench.method.use_loss(model, self.loss), so every step's loss (lm_loss) is this one.
    # def loss(self, model, batch): ...


METHOD = MyMethod

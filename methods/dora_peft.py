"""Peer: DoRA from Hugging Face peft 0.21.2 (`LoraConfig(use_dora=True)`, `get_peft_model`).

Liu et al., "DoRA: Weight-Decomposed Low-Rank Adaptation", ICML 2024, arXiv 2402.09353;
PyPI peft 0.21.2 (huggingface/peft, Apache-2.0). Set up as methods/lora_peft.py sets up
LoRA, with `use_dora=True`: the layers adapted are the ones methods/lora.py selects from
`targets` (default: every Linear/Conv1D inside the Transformer blocks), passed to peft by
their full names; `r`, `lora_alpha`, `lora_dropout` from rank, alpha, dropout;
`bias="none"` (every base parameter frozen), `init_lora_weights=True` (A as nn.Linear's
default, B zero; m the row norms of W), `fan_in_fan_out` for GPT-2's Conv1D layers, and
`autocast_adapter_dtype=False` (adapters and m in the base weight's dtype, as ours).

On fake tensors (the simulated tier) peft adapts the fake model as it would a real one:
its adapters are made real on the CPU (a fake parameter cannot be moved), and DoRA's
magnitude init mixes them with the fake base weight (||W + s B A||), which the fake mode
then accepts by converting the real operands (`allow_non_fake_inputs`, for that call
only), so m comes out fake; the real adapters are then replaced by fake ones of the same
shape, dtype and device. The model returned is peft's `PeftModel` around ours.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from bench.method import Method, require_package
from methods.dora import DoRA, dora_targets
from methods.lora import fake_mode_of, report
from methods.lora_peft import make_fake


class DoRAPeft(Method):
    paper = ("peft 0.21.2 (LoraConfig(use_dora=True), get_peft_model), Liu et al., DoRA: Weight-Decomposed "
             "Low-Rank Adaptation, ICML 2024, arXiv 2402.09353")
    defaults = dict(DoRA.defaults)
    choices, ranges = DoRA.choices, DoRA.ranges
    peer_of = "dora"
    package = "peft==0.21.2"

    def transform_model(self, model):
        peft = require_package("peft", self.package, self.name)
        hp = self.hp
        names = dora_targets(model, hp["targets"], self.name)
        conv1d = [not isinstance(model.get_submodule(n), torch.nn.Linear) for n in names]
        config = peft.LoraConfig(r=hp["rank"], lora_alpha=hp["alpha"], lora_dropout=hp["dropout"],
                                 target_modules=names, bias="none", init_lora_weights=True,
                                 fan_in_fan_out=all(conv1d), use_dora=True)
        fake = fake_mode_of(model.get_submodule(names[0]).weight)
        with warnings.catch_warnings(), mixed_inputs(fake):
            # peft warns when it flips fan_in_fan_out for a mix of Linear and Conv1D targets
            warnings.simplefilter("ignore", UserWarning)
            model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
        if fake is not None:
            make_fake(model, fake)
        self.report = report(names, model)
        return model


@contextlib.contextmanager
def mixed_inputs(fake):
    """Let the fake mode (if any) take real tensors beside fake ones: peft's DoRA init
    computes ||W + s B A|| from the fake W and its real (CPU) A and B."""
    if fake is None:
        yield
        return
    before = fake.allow_non_fake_inputs
    fake.allow_non_fake_inputs = True
    try:
        yield
    finally:
        fake.allow_non_fake_inputs = before


METHOD = DoRAPeft

"""Peer: LoRA from Hugging Face peft 0.21.2 (`LoraConfig`, `get_peft_model`) on our models.

Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022, arXiv
2106.09685; PyPI peft 0.21.2 (huggingface/peft, Apache-2.0). The layers adapted are the
ones methods/lora.py selects from `targets` (default: every Linear/Conv1D inside the
Transformer blocks), passed to peft by their full names, so both rows adapt the same
layers; rank, alpha and dropout are passed as `r`, `lora_alpha`, `lora_dropout`, with
`bias="none"` (every base parameter frozen), `init_lora_weights=True` (A as nn.Linear's
default init, B zero) and `fan_in_fan_out` set for GPT-2's Conv1D layers.
`autocast_adapter_dtype=False`: adapters take the base weight's dtype, as ours do (peft's
default upcasts bfloat16 adapters to float32, and then each adapted layer keeps its own
float32 copy of its input).

On fake tensors (the simulated tier) peft adapts the fake model as it would a real one;
the adapters it makes are real (on the CPU: a fake parameter cannot be moved, so peft
cannot make them in the fake mode) and are then replaced by fake ones of the same shape,
dtype and device. The model returned is peft's `PeftModel` around ours.
"""
from __future__ import annotations

import warnings

import torch

from bench.method import Method, require_package
from methods.lora import LoRA, fake_mode_of, report, select_targets


class LoRAPeft(Method):
    paper = ("peft 0.21.2 (LoraConfig, get_peft_model), Hu et al., LoRA: Low-Rank Adaptation of Large "
             "Language Models, ICLR 2022, arXiv 2106.09685")
    defaults = dict(LoRA.defaults)
    choices, ranges = LoRA.choices, LoRA.ranges
    peer_of = "lora"
    package = "peft==0.21.2"

    def transform_model(self, model):
        peft = require_package("peft", self.package, self.name)
        hp = self.hp
        names = select_targets(model, hp["targets"])
        conv1d = [not isinstance(model.get_submodule(n), torch.nn.Linear) for n in names]
        config = peft.LoraConfig(r=hp["rank"], lora_alpha=hp["alpha"], lora_dropout=hp["dropout"],
                                 target_modules=names, bias="none", init_lora_weights=True,
                                 fan_in_fan_out=all(conv1d))
        fake = fake_mode_of(model.get_submodule(names[0]).weight)
        with warnings.catch_warnings():
            # peft warns when it flips fan_in_fan_out for a mix of Linear and Conv1D targets
            warnings.simplefilter("ignore", UserWarning)
            model = peft.get_peft_model(model, config, autocast_adapter_dtype=False)
        if fake is not None:
            make_fake(model, fake)
        self.report = report(names, model)
        return model


def make_fake(model: torch.nn.Module, fake) -> None:
    """Replace each real parameter (peft's adapters, made on the CPU) by a fake one of the
    same shape, dtype, device and requires_grad."""
    from torch._subclasses.fake_tensor import FakeTensor

    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None and not isinstance(p, FakeTensor):
                module._parameters[key] = torch.nn.Parameter(fake.from_tensor(p.detach()),
                                                              requires_grad=p.requires_grad)


METHOD = LoRAPeft

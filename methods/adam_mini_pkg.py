"""Peer: the authors' Adam-mini package, adam-mini 1.1.1 (`adam_mini.Adam_mini`), on our models.

Zhang et al., Adam-mini: Use Fewer Learning Rates To Gain More, arXiv 2406.16793; PyPI
adam-mini 1.1.1 (zyushun/Adam-mini). Built as its README shows: the model's named
parameters, `dim` (hidden size), `n_heads` and `n_kv_heads` from the model's config, with
the suite's AdamW hyperparameters (as methods/adam_mini.py), `verbose=False`.

Its partition goes by substrings of parameter names, written for LLaMA-style names: on
LLaMA it is ours (methods/adam_mini.py; the test checks the same trajectory); on GPT-2 and
BERT some weights get one block per tensor or per input row (listed in
methods/adam_mini.py). On CPU it needs no torch.distributed: it reads
`torch.cuda.device_count()` as its world size, which is 0 without a GPU, and calls no
collective. Its step runs on fake tensors: the one value it reads (`block_numel.item()`
of a `torch.tensor(numel)`) is a constant that fake tensors track.

Needs `pip install adam-mini==1.1.1`; without it `make_optimizer` raises a MethodError.
"""
from __future__ import annotations

from bench.method import Method, require_package
from methods.adam_mini import AdamMini


class AdamMiniPkg(Method):
    paper = ("adam-mini 1.1.1 (Adam_mini), Zhang et al., Adam-mini: Use Fewer Learning Rates To "
             "Gain More, arXiv 2406.16793")
    defaults = dict(AdamMini.defaults)
    peer_of = "adam_mini"
    package = "adam-mini==1.1.1"

    def make_optimizer(self, model):
        adam_mini = require_package("adam_mini", self.package, self.name)
        config = model.config
        heads = config.num_attention_heads
        return adam_mini.Adam_mini(model.named_parameters(), **self.adam_args,
                                   dim=config.hidden_size, n_heads=heads,
                                   n_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                                   verbose=False)


METHOD = AdamMiniPkg

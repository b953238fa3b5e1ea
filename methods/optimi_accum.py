"""Peer: torch-optimi's "optimizer accumulation", an approximation of AdamA.

Warner, torch-optimi 0.3.3 (PyPI `torch-optimi`, MIT), `AdamW(gradient_release=True)`
with `optimizer_accumulation`. Like AdamA it folds each micro-batch gradient into the
moments inside backward and frees it; unlike AdamA it runs a full EMA step per
micro-batch (beta, the step count and the debiasing advance N times per optimizer
step), which its documentation calls an approximation of gradient accumulation.
Hyperparameters are aligned with ours (betas, eps, weight decay passed explicitly;
optimi's own defaults differ: betas (0.9, 0.99), eps 1e-6, weight decay 1e-2).
"""
from bench.method import Method, accumulate, require_package


class OptimiAccumulation(Method):
    paper = "torch-optimi 0.3.3, optimizer accumulation (approximates AdamA, arXiv 2305.19982)"
    defaults = dict(micro_batches=4)
    peer_of = "adama"
    package = "torch-optimi==0.3.3"
    # gradients are folded into the optimizer in backward, before they could be unscaled
    loss_scaling = False

    def make_optimizer(self, model):
        optimi = require_package("optimi", self.package, self.name)
        optimizer = optimi.AdamW(model.parameters(), **self.adam_args, gradient_release=True)
        # the memory tracker's own gradient hooks may already be registered
        optimi.prepare_for_gradient_release(model, optimizer, ignore_existing_hooks=True)
        return optimizer

    def train_step(self, model, optimizer, batch):
        n = self.hp["micro_batches"]

        def last_updates(i):  # the last micro-batch's backward updates; earlier ones accumulate
            optimizer.optimizer_accumulation = i < n - 1

        return accumulate(model, batch, n, before_backward=last_updates)


METHOD = OptimiAccumulation

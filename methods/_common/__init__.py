"""Helpers that more than one method uses, so that no method imports another's module
for them: gradient release (act on a gradient inside backward, then free it;
release.py), a base for optimizers that update one parameter at a time (optim.py), the
weights low-rank optimizers project (lowrank.py), the step-derivative activation of
Few-Bit and Approx-BP (step_activation.py), bit packing (bitpack.py), the chunk size of
large tensors (chunks.py), and the running and counting of torchao's low-bit AdamWs
(torchao.py). Not a method: names starting with `_` are skipped by method discovery."""

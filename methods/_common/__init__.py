"""Helpers that more than one method uses: gradient release (act on a gradient inside
backward, then free it), a base for optimizers that update one parameter at a time, bit
packing and the chunk size of large tensors.
Not a method: names starting with `_` are skipped by method discovery."""
